"""The study wing: many runs, compared.

  runner     the lag study: run_study, every cell of the grid once, resumable
  grid       the study's grid (methods x lags x seeds, A/A lags) from config.study
  cell       one cell's seeds under one jax.vmap: warm starts, evaluation, the record
  stats      bootstrap intervals, paired verdicts against a baseline, run summaries
  report     study.csv (one row per run and metric), curves and interval plots, write_report
  report_tables  study.md: verdicts against the baseline, learning speed, the A/A rate, ...
  bandit     the paper's 3-armed bandit as a seeded study of the losses
  sweeps     run_sweep(config, sweep, workdir): runs of a get_sweep() list, summary table
  launchers  a sweep as per-host scripts, SLURM scripts or GKE JobSets (written, not run)
  reports    curves of several runs' metrics, run summaries, summary tables

May import: every other wing.
"""

from offpolicy_jax.study import (
  bandit,
  cell,
  grid,
  launchers,
  report,
  report_tables,
  reports,
  runner,
  stats,
  sweeps,
)

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
  "sweeps",
]
