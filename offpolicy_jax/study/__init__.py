"""The study wing: many runs, compared.

  runner     the lag study: run_study, each cell of the grid once, in a worker, resumable
  grid       the study's grid (methods x lags x seeds, A/A lags) from config.study
  cell       one cell's seeds under one jax.vmap: evaluation, the record
  warm_starts  every seed's warm start, trained once per study and kept in its workdir
  stats      t intervals, paired and equivalence verdicts against a baseline, run summaries
  report     study.csv (one row per run and metric), curves and interval plots, write_report
  report_tables  study.md: verdicts against the baseline, learning speed, the A/A rate, ...
  bandit     the paper's 3-armed bandit as a seeded study of the losses
  sweeps     run_sweep(config, sweep, workdir): runs of a get_sweep() list, summary table
  sweep_runs  a run (or any function) in a worker process of its own: a crash costs that run
  launchers  a sweep as per-host scripts, SLURM scripts or GKE JobSets (written, not run)
  reports    curves of several runs' metrics, run summaries, summary tables

May import: every other wing.
"""

from offpolicy_jax import lazy

__all__ = [
  "bandit",
  "cell",
  "grid",
  "launchers",
  "report",
  "report_tables",
  "reports",
  "runner",
  "stats",
  "sweep_runs",
  "sweeps",
  "warm_starts",
]

# The modules load on first use: a binary refuses a wrong config or workdir before it pays
# for importing JAX, orbax and the models.
__getattr__, __dir__ = lazy.modules(__name__, __all__)
