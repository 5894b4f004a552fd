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
import time
import traceback
from collections.abc import Mapping

from absl import app, flags, logging
from ml_collections import config_flags

from offpolicy_jax import metrics

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file with get_sweep().")
_WORKDIR = flags.DEFINE_string("workdir", None, "Parent directory of the runs.")
_PRINT_ONLY = flags.DEFINE_bool("print_only", False, "Print one train command per run and exit.")
flags.mark_flags_as_required(["config", "workdir"])


def run_name(overrides: dict) -> str:
  """A directory-safe name from a dict of overrides, e.g. `loss.name=grpo,lag.sync_interval=20`."""
  if "name" in overrides:
    return str(overrides["name"])
  parts = [f"{k.split('.')[-1]}={v}" for k, v in overrides.items()]
  return ",".join(parts).replace("/", "_") or "base"


def apply_overrides(config, overrides: dict):
  """Returns a copy of `config` with dotted `overrides` set (the key `name` is skipped)."""
  config = config.copy_and_resolve_references()
  for key, value in overrides.items():
    if key == "name":
      continue
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    if leaf not in node:
      raise ValueError(f"sweep override {key!r}: no such config field")
    node[leaf] = value
  return config


def load_sweep(config_path: str) -> list[dict]:
  """Loads `get_sweep()` from a config file."""
  import importlib.util

  path = config_path.split(":")[0]
  spec = importlib.util.spec_from_file_location("_sweep_config", path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot load the sweep config {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{config_path} has no get_sweep()")
  return list(module.get_sweep())


def _check_unique_names(sweep: list[dict]) -> None:
  """Two runs with one name would share a workdir: the second would resume the first."""
  names = [run_name(o) for o in sweep]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"sweep runs share names {repeated}; give each a distinct 'name'")


def _cli_overrides() -> list[str]:
  return [a for a in sys.argv[1:] if a.startswith("--config.")]


class SweepError(RuntimeError):
  """Some runs of a sweep failed; every other run ran and the summary was written.

  Attributes:
    summary: path of `summary.md`.
    failed: run name -> error message (one line), in sweep order.
  """

  def __init__(self, summary: str, failed: Mapping[str, str], num_runs: int):
    self.summary = summary
    self.failed = dict(failed)
    names = ", ".join(self.failed)
    super().__init__(f"{len(self.failed)} of {num_runs} sweep runs failed: {names} (see {summary})")


def _error_line(e: BaseException) -> str:
  """`Type: message` on one line (newlines and runs of spaces collapsed)."""
  return " ".join(f"{type(e).__name__}: {e}".split())


def run_sweep(config, sweep: list[dict], workdir: str) -> str:
  """Runs every entry of `sweep` (dotted overrides of `config`) here, one after another.

  Runs sharing compiled shapes reuse one set of compiled functions and one warm
  start. A run that raises is recorded and the sweep goes on with the next
  one. Writes `summary.md` and `summary.csv` (every run, with a `status`
  column, `ok` or `failed`, and the failed runs' `error`) and `curves.png`
  under `workdir`.

  Returns:
    The path of `summary.md`.

  Raises:
    ValueError: before any run, for repeated run names or an override that
      names no config field.
    SweepError: after every run and the summary, if any run failed.
  """
  from offpolicy_jax import loop

  _check_unique_names(sweep)
  configs = {run_name(o): apply_overrides(config, o) for o in sweep}
  runs: dict[str, str] = {}
  failed: dict[str, str] = {}
  for name, run_config in configs.items():
    runs[name] = os.path.join(workdir, name)
    start = time.time()
    try:
      loop.train_and_evaluate(run_config, runs[name])
    except Exception as e:
      traceback.print_exc()
      failed[name] = _error_line(e)
      print(f"sweep run {name} FAILED after {time.time() - start:.1f}s: {failed[name]}", flush=True)
      continue
    print(f"sweep run {name} done in {time.time() - start:.1f}s", flush=True)
  status = {
    n: {"status": "failed" if n in failed else "ok", "error": failed.get(n, "")} for n in runs
  }
  summary = metrics.write_summary_table(runs, workdir, extra=status)
  metrics.plot_runs(runs, os.path.join(workdir, "curves.png"))
  if failed:
    raise SweepError(summary, failed, len(runs))
  return summary


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
    _check_unique_names(sweep)
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
