r"""Runs a seeded study (methods x lags x seeds) and writes its tables and plots.

  python -m experiments.study --config=configs/lag_study.py --workdir=/tmp/lag_study

Writes `workdir/study.md` (final accuracy with 95% t intervals, verdicts
against the baseline from Holm-corrected sign-flip permutation tests and
equivalence tests against `study.equivalence_margin`,
learning speed, the A/A calibration's false-verdict rate, pass@k, area under
the training curve, collapses, costs and the Pareto fronts of accuracy against
seconds and sampled tokens, the bandit), `workdir/study.csv` (one row per run and
metric) and `workdir/curves_<lag>.png`, `workdir/final.png`, `workdir/pareto.png`.
Each method's cells run in a worker process of their own (each cell's output in
`workdir/cells/<method>@<lag>.log`; `--inline` runs them here, for debugging),
so a crash or an OOM kill costs the cell it hit only: the others run, the
failed ones are listed and the command exits 1. Finished cells are kept in
`workdir/cells/` and the seeds' warm starts in `workdir/warm_starts/`; a rerun
(after a kill or a failure) runs only the missing cells, and refuses a workdir
holding a study with another config. `--report_only` rewrites the files from
the finished cells without running anything (it too refuses a workdir whose
study ran with other values of the fields its cells depend on).
"""

import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from offpolicy_jax import cli, errors
from offpolicy_jax.store import workdir

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  cli.config_help(
    "Study config (with a `study` block)",
    ("study.methods", "study.lags", "study.seeds", "study.baseline", "total_steps", "task"),
  ),
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the study's cells and reports.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only rewrite the reports.")
_INLINE = flags.DEFINE_bool(
  "inline", False, "Run every cell in this process (debugging) instead of one worker per method."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  config, path = _CONFIG.value, _WORKDIR.value
  if "study" not in config:
    raise errors.ConfigError(
      f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}: not a study config "
      "(no `study` block)",
      "see configs/lag_study.py",
    )
  cli.early_checks(config, workdir=path, study=True)
  # After the checks above: a wrong config is refused before JAX and the models are imported.
  from offpolicy_jax.study import grid as study_grid
  from offpolicy_jax.study import report as study_report
  from offpolicy_jax.study import runner as study

  begin = time.perf_counter()
  try:
    if _REPORT_ONLY.value:
      study.require_study(path)  # before the lock, which would create a mistyped workdir
      with workdir.lock(path):
        study.check_report_config(path, config)
        cells = study.load_cells(path, study_grid.grid_from_config(config)[1])
        if not cells:
          raise errors.WorkdirError(f"{path}: no finished cell to report on")
        files = study_report.write_report(config, path, cells)
    else:
      isolation = "inline" if _INLINE.value else "process"
      cells = study.run_study(config, path, log=lambda s: print(s, flush=True), isolation=isolation)
      files = study_report.write_report(config, path, cells)
  except study.StudyError as e:
    print(e, file=sys.stderr, flush=True)
    for name, error in e.failed.items():
      print(f"  {name}: {error}", file=sys.stderr)
    return 1
  except errors.UserError:
    raise  # one line with its hint (cli.run): a locked workdir, a bad field of a method
  except ValueError as e:
    raise errors.UserError(str(e)) from e
  print(f"study: {len(cells)} cells, {time.perf_counter() - begin:.0f}s; wrote", *files, sep="\n  ")
  return 0


if __name__ == "__main__":
  cli.run(main)
