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

import importlib
from typing import Any

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


# The modules load on first use: the sweep and study binaries read their config (and refuse
# a wrong one) before they pay for importing JAX and the models.
def __getattr__(name: str) -> Any:
  if name not in __all__:
    raise AttributeError(f"module 'offpolicy_jax.study' has no attribute {name!r}")
  module = importlib.import_module(f"offpolicy_jax.study.{name}")
  globals()[name] = module
  return module


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
