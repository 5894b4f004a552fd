"""Sweeps: a config's `get_sweep()` list of dotted overrides, run one after another.

`run_sweep(config, sweep, workdir)` runs each entry in `workdir/<run name>`
(resumable like a single run), records a failing run and goes on, and writes
`summary.md`, `summary.csv` and `curves.png`. Runs that share compiled shapes
share compiled functions and warm starts (`components.build_components`).
The `experiments.sweep` binary is a thin wrapper around this module.
"""

from __future__ import annotations

import importlib.util
import os
import time
import traceback
from collections.abc import Mapping

from offpolicy_jax.study import reports


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
  path = config_path.split(":")[0]
  spec = importlib.util.spec_from_file_location("_sweep_config", path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot load the sweep config {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{config_path} has no get_sweep()")
  return list(module.get_sweep())


def check_unique_names(sweep: list[dict]) -> None:
  """Two runs with one name would share a workdir: the second would resume the first."""
  names = [run_name(o) for o in sweep]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"sweep runs share names {repeated}; give each a distinct 'name'")


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
  from offpolicy_jax.run import loop

  check_unique_names(sweep)
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
  summary = reports.write_summary_table(runs, workdir, extra=status)
  reports.plot_runs(runs, os.path.join(workdir, "curves.png"))
  if failed:
    raise SweepError(summary, failed, len(runs))
  return summary
