"""Sweeps: a config's `get_sweep()` list of dotted overrides, run one after another.

`run_sweep(config, sweep, workdir)` runs each entry in `workdir/<run name>`
(resumable like a single run), each in a worker process of its own
(`sweep_runs`), records a failing run and goes on, prints progress with an
ETA, and writes `summary.md`, `summary.csv` and `curves.png`.
The `experiments.sweep` binary is a thin wrapper around this module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from offpolicy_jax import config_schema, errors, files
from offpolicy_jax.study import reports, sweep_runs

ISOLATIONS = ("process", "inline")
STATUS_FILE = "sweep_status.json"


def run_name(overrides: dict) -> str:
  """A directory-safe name from a dict of overrides, e.g. `loss.name=grpo,lag.sync_interval=20`."""
  if "name" in overrides:
    return str(overrides["name"])
  parts = [f"{k.split('.')[-1]}={v}" for k, v in overrides.items()]
  return ",".join(parts).replace("/", "_") or "base"


def apply_overrides(config, overrides: dict):
  """Returns a copy of `config` with dotted `overrides` set (the key `name` is skipped).

  Raises:
    errors.ConfigError: an override names no field of `config` (its hint
      suggests the nearest field) or has a value of the wrong type.
  """
  config = config.copy_and_resolve_references()
  for key, value in overrides.items():
    if key == "name":
      continue
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      if not isinstance(node, ml_collections.ConfigDict) or p not in node:
        raise _no_such_field(config, key)
      node = node[p]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise _no_such_field(config, key)
    try:
      node[leaf] = value
    except (TypeError, ValueError) as e:
      raise errors.ConfigError(f"override {key}={value!r}: {' '.join(str(e).split())}") from e
  return config


def _no_such_field(config, key: str) -> errors.ConfigError:
  """`override 'x': no such config field`, suggesting the nearest of the config's fields."""
  fields = config_schema.flatten(config.to_dict())
  return errors.ConfigError(
    f"override {key!r}: no such config field",
    errors.did_you_mean(key, fields) or "docs/config.md lists the fields",
  )


def run_configs(config, sweep: list[dict]) -> dict[str, Any]:
  """Each run's config by run name: `config` with that run's overrides.

  Raises:
    errors.ConfigError: two runs share a name, or an override does not apply
      (`apply_overrides`; the message starts with `sweep run <name>: `).
  """
  check_unique_names(sweep)
  configs = {}
  for overrides in sweep:
    name = run_name(overrides)
    with errors.about(f"sweep run {name}"):
      configs[name] = apply_overrides(config, overrides)
  return configs


def check_runs(configs: Mapping[str, Any], check: Callable[[Any], object]) -> None:
  """Runs `check` on every run's config (`run_configs`), naming the run whose config fails.

  Args:
    configs: run name -> config.
    check: e.g. `validation.validate_config` (before running here), or
      `validation.validate_settings` (before launching elsewhere).

  Raises:
    errors.ConfigError: `sweep run <name>: config.<field>: ...` for the first run refused.
  """
  for name, run_config in configs.items():
    with errors.about(f"sweep run {name}"):
      check(run_config)


def load_sweep(config_path: str) -> list[dict]:
  """Loads `get_sweep()` from a config file."""
  path = config_path.split(":")[0]
  spec = importlib.util.spec_from_file_location("_sweep_config", path)
  if spec is None or spec.loader is None:
    raise errors.ConfigError(f"--config={path}: cannot load the sweep config")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise errors.ConfigError(
      f"--config={config_path}: the file has no get_sweep()", "see configs/lag_study.py"
    )
  return list(module.get_sweep())


def check_unique_names(sweep: list[dict]) -> None:
  """Two runs with one name would share a workdir: the second would resume the first."""
  names = [run_name(o) for o in sweep]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise errors.ConfigError(f"sweep runs share names {repeated}; give each a distinct 'name'")


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


def _fingerprint(config) -> str:
  """What a run is: its whole config (a finished run with another config runs again)."""
  return hashlib.sha256(
    json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
  ).hexdigest()


class _Progress:
  """`sweep: 12/108 done (1 failed), 96 to go, ETA 41m` after every run."""

  def __init__(self, total: int, log: Callable[[str], None]):
    self.total, self.log = total, log
    self.done = self.failed = 0
    self.spent: list[float] = []  # seconds of the runs that ran here

  def update(self, name: str, error: str | None, seconds: float | None) -> None:
    self.done += 1
    self.failed += error is not None
    if seconds is not None:
      self.spent.append(seconds)
    left = self.total - self.done
    eta = ""
    if left and self.spent:
      eta = f", ETA {_duration(left * sum(self.spent) / len(self.spent))}"
    if seconds is None:
      what = "skipped (done before)"
    else:
      what = f"FAILED after {seconds:.1f}s: {error}" if error else f"done ({seconds:.1f}s)"
    failed = f" ({self.failed} failed)" if self.failed else ""
    self.log(f"sweep run {name} {what}")
    self.log(f"sweep: {self.done}/{self.total} done{failed}, {left} to go{eta}")


def _duration(seconds: float) -> str:
  if seconds < 120:
    return f"{seconds:.0f}s"
  if seconds < 7200:
    return f"{seconds / 60:.0f}m"
  return f"{seconds / 3600:.1f}h"


def _read_status(workdir: str) -> dict[str, dict[str, Any]]:
  path = os.path.join(workdir, STATUS_FILE)
  if not os.path.exists(path):
    return {}
  try:
    return dict(files.read_json_object(path))
  except ValueError:
    return {}  # unreadable: every run runs (a finished one resumes at its end)


def _write_status(workdir: str, status: Mapping[str, Any]) -> None:
  text = json.dumps(status, indent=1, sort_keys=True)
  files.write_text_atomic(os.path.join(workdir, STATUS_FILE), text)


def run_sweep(
  config,
  sweep: list[dict],
  workdir: str,
  *,
  isolation: str = "process",
  log: Callable[[str], None] = lambda s: print(s, flush=True),
) -> str:
  """Runs every entry of `sweep` (dotted overrides of `config`), one after another.

  Each run trains in a worker process of its own (`isolation="process"`,
  `sweep_runs.run_in_process`): a crash or a kill ends that run only, and
  memory stays flat over hundreds of runs. `isolation="inline"` trains here
  (debugging; runs sharing compiled shapes then share compiled functions and
  warm starts). A failed run is recorded and the sweep goes on. The status of
  each run is kept in `sweep_status.json`: rerunning the command skips the
  runs that finished with the same config and retries the others. Writes
  `summary.md` and `summary.csv` (every run, with a `status` column, `ok` or
  `failed`, and the failed runs' `error`) and `curves.png` under `workdir`.

  Returns:
    The path of `summary.md`.

  Raises:
    ValueError: before any run, for repeated run names, an override that
      names no config field, a run config that `validation.validate_config`
      refuses, or an unknown `isolation`.
    SweepError: after every run and the summary, if any run failed.
    errors.Interrupted: SIGINT or SIGTERM; the current run saved and stopped.
  """
  if isolation not in ISOLATIONS:
    raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
  configs = run_configs(config, sweep)
  from offpolicy_jax.run import validation  # here, as `sweep_runs` imports the loop: it loads JAX

  check_runs(configs, validation.validate_config)  # every run's config, before any worker starts
  os.makedirs(workdir, exist_ok=True)
  status = _read_status(workdir)
  progress = _Progress(len(configs), log)
  runs: dict[str, str] = {}
  failed: dict[str, str] = {}
  for name, run_config in configs.items():
    runs[name] = os.path.join(workdir, name)
    key = _fingerprint(run_config)
    if status.get(name, {}).get("status") == "ok" and status[name].get("config") == key:
      progress.update(name, None, None)
      continue
    start = time.time()
    if isolation == "inline":
      error = sweep_runs.run_inline(run_config, runs[name])
    else:
      error = sweep_runs.run_in_process(run_config, runs[name], workdir)
    status[name] = {"status": "failed" if error else "ok", "error": error or "", "config": key}
    _write_status(workdir, status)
    if error:
      failed[name] = error
    progress.update(name, error, time.time() - start)
  table = {
    n: {"status": "failed" if n in failed else "ok", "error": failed.get(n, "")} for n in runs
  }
  summary = reports.write_summary_table(runs, workdir, extra=table)
  with_rows = {n: w for n, w in runs.items() if reports.summarize_run(w)["steps"]}
  if with_rows:
    reports.plot_runs(with_rows, os.path.join(workdir, "curves.png"))
  if failed:
    raise SweepError(summary, failed, len(runs))
  return summary
