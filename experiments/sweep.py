r"""Expands a config's `get_sweep()` into runs: runs them here one by one, or prints commands.

  python -m experiments.sweep --config=configs/lag_study.py --workdir=/tmp/lag_study
  python -m experiments.sweep --config=configs/lag_study.py --workdir=DIR --print_only

Each run goes to `workdir/<run name>` (resumable like train.py); at the end the
sweep writes `workdir/summary.md`, `workdir/summary.csv` and `workdir/curves.png`.
A run that fails is recorded (`status` failed and its `error` in the summary)
and the sweep goes on; the process then exits with status 1, naming the
failed runs.
"""

import os
import shlex
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from offpolicy_jax.sweeps import (  # noqa: F401  (the binary's names, used by tests)
  SweepError,
  apply_overrides,
  check_unique_names,
  load_sweep,
  run_name,
  run_sweep,
)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file with get_sweep().")
_WORKDIR = flags.DEFINE_string("workdir", None, "Parent directory of the runs.")
_PRINT_ONLY = flags.DEFINE_bool("print_only", False, "Print one train command per run and exit.")
flags.mark_flags_as_required(["config", "workdir"])


def _cli_overrides() -> list[str]:
  return [a for a in sys.argv[1:] if a.startswith("--config.")]


def _print_file(path: str) -> None:
  with open(path) as f:
    print(f.read())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  sweep = load_sweep(config_path)
  if _PRINT_ONLY.value:
    check_unique_names(sweep)
    for overrides in sweep:
      args = [f"--config.{k}={v}" for k, v in overrides.items() if k != "name"]
      cmd = [
        "python",
        "-m",
        "experiments.train",
        f"--config={config_path}",
        f"--workdir={os.path.join(_WORKDIR.value, run_name(overrides))}",
        *_cli_overrides(),
        *args,
      ]
      print(shlex.join(cmd))
    return
  try:
    summary = run_sweep(_CONFIG.value, sweep, _WORKDIR.value)
  except SweepError as e:
    _print_file(e.summary)
    print(e, file=sys.stderr, flush=True)
    for name, error in e.failed.items():
      print(f"  {name}: {error}", file=sys.stderr)
    return 1
  _print_file(summary)


if __name__ == "__main__":
  app.run(main)
