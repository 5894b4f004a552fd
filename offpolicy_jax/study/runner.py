"""A seeded grid of methods x lag schedules, run with `jax.vmap` over seeds.

Every cell (method, lag) runs all seeds at once: the run states of the seeds
are stacked on a leading axis and one jitted `vmap(rl_step.rl_steps)` advances
them together, evaluating every `config.eval_every` steps with a vmapped
greedy sampler on `config.eval_prompts` held-out prompts. Runs with the same
seed share the warm start (`sft.warm_start`, computed once per seed) and the
prompt stream, so they are paired (`study.stats`). The lag schedule is a traced
argument and every cell has the same number of snapshot slots, so the lags of
one method share one compiled program.

Each method's cells run in a worker process of their own (`isolation="process"`:
they share its compiled programs; a crash costs the cell it hit only, which the
next run of the same command retries) or here (`"inline"`), from the seeds'
warm starts kept in `workdir/warm_starts/` (`study.warm_starts`). Finished cells go to
`workdir/cells/<method>@<lag>.json` (atomically); a rerun skips them, so an
interrupted study resumes (`study.report` makes the tables), unless a field
a finished cell depends on has changed (`config_schema`: every field whose
role reaches a study cell; not how seeds are batched, the report's settings,
checkpoints, logging, the mesh or the reward workers). Methods may be added
to `study.methods` (the others as they were): the rerun runs the new ones.

A/A calibration: for every lag of `config.study.aa_lags` the baseline method
runs a second time as the cell `aa-<method>@<lag>` (`study.grid`).

The pieces: `study.grid` (the grid of `config.study`: methods, lags, seeds,
A/A lags), `study.cell` (one cell's seeds under one `jax.vmap`) and
`study.warm_starts`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from offpolicy_jax import config_schema, errors, files
from offpolicy_jax.config_spec import RunSpec
from offpolicy_jax.run import data_checks
from offpolicy_jax.store import workdir
from offpolicy_jax.study import sweep_runs, sweeps
from offpolicy_jax.study.cell import run_cell
from offpolicy_jax.study.grid import (
  AA_STREAM_OFFSET,
  Grid,
  grid_from_config,
  parse_lags,
  parse_methods,
)
from offpolicy_jax.study.warm_starts import Starts

CELLS_DIR = "cells"
STARTS_DIR = "warm_starts"
CONFIG_FILE = "study_config.json"


def cell_path(path: str, method: str, lag_name: str) -> str:
  return os.path.join(path, CELLS_DIR, f"{method}@{lag_name}.json")


def load_cells(path: str, grid: Grid) -> dict[tuple[str, str], dict]:
  """The finished cells of the grid in `path` (a corrupt cell file raises, naming it)."""
  return {
    (method, lag_name): read_cell(path, grid, method, lag_name)
    for method, lag_name in grid.cells()
    if os.path.exists(cell_path(path, method, lag_name))
  }


def read_cell(path: str, grid: Grid, method: str, lag_name: str) -> dict:
  """The record of one finished cell, checked against the grid (ValueError naming the file)."""
  file = cell_path(path, method, lag_name)
  try:
    with open(file) as f:
      cell = json.load(f)
    seeds = [r["seed"] for r in cell["runs"]]
    if (cell["method"], cell["lag"]) != (method, lag_name) or seeds != list(grid.seeds):
      raise ValueError(f"holds {cell['method']}@{cell['lag']} seeds {seeds}")
    if method == grid.aa_method and cell.get("stream_offset") != AA_STREAM_OFFSET:
      raise ValueError(f"an A/A cell with stream offset {cell.get('stream_offset')!r}")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{file}: unreadable cell record ({e}); delete it to rerun the cell") from e
  return cell


def _write_json(file: str, record: Any) -> None:
  files.write_text_atomic(file, json.dumps(record), sync=True)


def stored_config(path: str) -> ml_collections.ConfigDict:
  """The config the study in `path` ran with (its `study_config.json`), over the schema defaults.

  Fields added to the schema after the study ran take their defaults; the
  report's tables depend only on the grid, `study.alpha` and
  `study.equivalence_margin`.
  """
  file = os.path.join(path, CONFIG_FILE)
  try:
    with open(file) as f:
      stored = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{file}: unreadable study config ({e})") from e
  config = config_schema.config_dict()
  config_schema.config_dict(config_schema.STUDY_FIELDS, into=config)

  def overlay(node: ml_collections.ConfigDict, values: dict) -> None:
    for key, value in values.items():
      if isinstance(value, dict) and isinstance(node.get(key), ml_collections.ConfigDict):
        overlay(node[key], value)
      else:
        node[key] = value

  overlay(config, stored)
  return config


def _check_config(path: str, config: ml_collections.ConfigDict) -> None:
  """Records the study's config, or refuses to resume one started with another config."""
  file = os.path.join(path, CONFIG_FILE)
  cfg = json.loads(config.to_json_best_effort())
  if not os.path.exists(file):
    _write_json(file, cfg)
    return
  with open(file) as f:
    stored = json.load(f)
  changes = workdir.config_changes(stored, cfg, matters=lambda role: role.cell)
  if "study.methods" in changes and _only_added(*changes["study.methods"]):
    del changes["study.methods"]  # the finished cells' methods are as they ran
  lags = changes.get("study.lags")
  if lags is not None and _only_added_lags(*lags, total_steps=config.total_steps):
    del changes["study.lags"]  # likewise their lags
  if changes:
    listed = workdir.describe_changes(changes)
    raise workdir.ConfigChanged(
      f"{path} holds a study started with another config ({file}): {listed}. "
      "Use a new --workdir or restore the old values.",
      listed,
    )
  if stored != cfg:  # fields no cell depends on (baseline, A/A lags, ...): the report's
    _write_json(file, cfg)


def _only_added(old: str, new: str) -> bool:
  """Whether the methods `new` keep every method of `old` as it was (and may add others).

  A study extended with more methods runs only the new methods' cells; a
  method whose definition changed would leave its finished cells stale.
  """
  before, after = parse_methods(old), parse_methods(new)
  return all(after.get(name) == spec for name, spec in before.items())


def _only_added_lags(old: str, new: str, *, total_steps: int) -> bool:
  """Whether the lags `new` keep every lag of `old` with its schedule (and may add others).

  The cells of an added lag run from the stored warm starts; the finished
  cells stand as they ran (a larger snapshot ring for a longer lag changes
  no version a cell reads).
  """
  before, after = parse_lags(old, total_steps), parse_lags(new, total_steps)
  return all(after.get(name) == schedule for name, schedule in before.items())


def require_study(path: str) -> None:
  """Refuses a `path` that holds no study (checked before anything is created there).

  Raises:
    errors.WorkdirError: no study in `path`.
  """
  if not os.path.exists(os.path.join(path, CONFIG_FILE)):
    raise errors.WorkdirError(f"{path}: no study here (no {CONFIG_FILE}); run the study first")


def check_report_config(path: str, config: ml_collections.ConfigDict) -> None:
  """Refuses to report on `path` unless it holds a study of `config` (cell fields equal).

  Fields no cell depends on may differ: the study's record (`study_config.json`) then
  takes `config`'s values, so the tables rebuild from it as reported.

  Raises:
    errors.WorkdirError: no study in `path`.
    workdir.ConfigChanged: the study ran with other values of fields its cells depend on.
  """
  require_study(path)
  _check_config(path, config)


class StudyError(RuntimeError):
  """Some cells of a study failed (their worker crashed or raised); every other cell ran.

  Attributes:
    failed: cell name `method@lag` -> how it failed (one line), in grid order.
  """

  def __init__(self, failed: dict[str, str], num_cells: int):
    self.failed = dict(failed)
    super().__init__(
      f"{len(failed)} of {num_cells} study cells failed: {', '.join(failed)}; "
      "rerunning the same command runs them again and skips the finished ones (fix first "
      "what their errors name)"
    )


def machine() -> dict[str, Any]:
  """What a cell's numbers depend on beyond the code and config: the backend and the CPU.

  XLA's CPU code rounds reductions differently with and without AVX-512, and
  sampled training amplifies a last-bit difference, so the same cell differs
  between the project's machines (docs/results/lag_study.md, the full grid).
  """
  flags: list[str] = []
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          have = set(line.split(":", 1)[1].split())
          flags = sorted(x for x in ("avx2", "avx512f", "avx512bf16", "amx_tile") if x in have)
          break
  except OSError:
    pass
  return {
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "machine": platform.machine(),
    "cpu_flags": flags,
    "jax": jax.__version__,
  }


def _log_path(path: str, method: str, lag_name: str) -> str:
  return os.path.splitext(cell_path(path, method, lag_name))[0] + ".log"


def _run_and_write(config, path: str, method: str, lag_name: str, starts: Starts) -> dict:
  """Runs one cell and writes its record (atomically) to `cells/<method>@<lag>.json`."""
  base, grid = grid_from_config(config)
  begin = time.perf_counter()
  record = run_cell(base, grid, method, lag_name, starts)
  record["seconds"] = time.perf_counter() - begin
  record["machine"] = machine()
  _write_json(cell_path(path, method, lag_name), record)
  failed = {
    k: sum(r.get("reward_failures", {}).get(k, 0) for r in record["runs"])
    for k in ("eval_reward_failures", "train_reward_failures")
  }
  if any(failed.values()):  # to the cell's log; the report has a table of them
    print(
      f"cell {method}@{lag_name}: {failed['eval_reward_failures']:.0f} evaluation and "
      f"{failed['train_reward_failures']:.0f} training rewards failed (timed out, raised or "
      "crashed; scored 0): on a loaded machine that measures the machine; rerun the cell "
      "(delete its file) on an idle one or raise reward_timeout",
      flush=True,
    )
  return record


def _cells_in_worker(config, path: str, cells: list[tuple[str, str]]) -> None:
  """A worker process's cells, one after another, each logged to its own file.

  The cells are one method's (`_groups`), so they share its compiled programs
  (`components.build_components` keeps them per model and method). A cell that
  raises leaves its error in `cells/<method>@<lag>.error` and the next one runs;
  the seeds' warm starts are read from (or first written to) disk.
  """
  starts = Starts(os.path.join(path, STARTS_DIR))
  try:
    for method, lag_name in cells:
      log_path = _log_path(path, method, lag_name)
      sweep_runs.redirect_output(log_path)
      started = time.strftime("%Y-%m-%d %H:%M:%S")
      print(f"=== cell {method}@{lag_name}, started {started}", flush=True)
      try:
        record = _run_and_write(config, path, method, lag_name, starts)
      except errors.Interrupted:
        raise
      except Exception as e:
        sweep_runs.record_error(e, log_path)
        continue
      print(f"cell {method}@{lag_name} done in {record['seconds']:.0f} s", flush=True)
  finally:
    starts.close()


def _groups(grid: Grid, todo: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
  """The cells to run in one worker each: a method's lags, the A/A twin's with the baseline's.

  A cell's program depends on its method, not on its lag (the schedule is a traced
  argument), so one worker per method traces and compiles it once; a few cells per
  process also keep the crash that XLA showed after ~50 cells in one process away.
  """
  groups: dict[str, list[tuple[str, str]]] = {}
  for method, lag_name in todo:
    key = grid.baseline[0] if method == grid.aa_method else method
    groups.setdefault(key, []).append((method, lag_name))
  return list(groups.values())


Outcome = Callable[[tuple[str, str], "str | None"], None]


def _run_group(config, path: str, group: list[tuple[str, str]], outcome: Outcome) -> None:
  """Runs `group`'s cells in worker processes, reporting each as it ends, in the group's order.

  `outcome(cell, None)` for a finished cell, `outcome(cell, how it failed)` for a
  failed one. A worker that dies (a segfault, the OOM killer) fails the cell it
  was running; a new worker runs the cells after it.

  Raises:
    errors.Interrupted: SIGINT or SIGTERM; the current cell was stopped.
  """
  remaining = list(group)

  def resolve(code: int | None) -> None:
    """Reports the leading cells that ended (`code`: the worker's exit status; None: running)."""
    while remaining:
      cell = remaining[0]
      log_path = _log_path(path, *cell)
      error = sweep_runs.error_path(log_path)  # written atomically by the worker
      if os.path.exists(cell_path(path, *cell)):
        how = None
      elif os.path.exists(error):
        sweep_runs.print_tail(log_path)
        with open(error) as f:
          how = f.read().strip()
      elif code is None:
        return
      else:  # the worker ended during this cell; a new one runs the rest
        sweep_runs.print_tail(log_path)
        how = sweep_runs.describe_exit(code, log_path) if code else "its worker ended before it"
        remaining.pop(0)
        outcome(cell, how)
        return
      remaining.pop(0)
      outcome(cell, how)

  while remaining:
    logs = [_log_path(path, m, g) for m, g in remaining]
    for log_path in logs:
      with contextlib.suppress(FileNotFoundError):
        os.remove(sweep_runs.error_path(log_path))  # a previous attempt's
    names = ", ".join(f"{m}@{g}" for m, g in remaining)
    code = sweep_runs.run_worker(
      _cells_in_worker,
      (config, path, list(remaining)),
      log_path=logs[0],
      cache_dir=os.path.join(path, sweep_runs.CACHE_DIR),
      what=f"study stopped during one of the cells {names}",
      poll=lambda: resolve(None),
    )
    resolve(code)


def run_study(
  config: ml_collections.ConfigDict,
  path: str,
  *,
  log: Callable[[str], None] = print,
  isolation: str = "process",
) -> dict[tuple[str, str], dict]:
  """Runs the cells of `config`'s grid not yet in `path`; returns every cell's record.

  With `isolation="process"` each method's cells run in a worker process of
  their own (`sweep_runs.run_worker`; each cell's output in
  `cells/<method>@<lag>.log`), so a crash, an OOM kill or a hung compile ends
  the cell it hit only, and what the method compiled leaves with its worker;
  `"inline"` runs the cells here (debugging). Either way the seeds' warm starts
  are trained once and kept in `warm_starts/`.

  Raises:
    StudyError: after every other cell ran, if any cell failed.
    errors.Interrupted: SIGINT or SIGTERM; the current cell was stopped.
  """
  if isolation not in sweeps.ISOLATIONS:
    raise ValueError(f"isolation must be one of {sweeps.ISOLATIONS}, got {isolation!r}")
  base, grid = grid_from_config(config)
  data_checks.check_task(base)  # the cells' shared task and data, once, before any workdir
  workdir.refuse_file(path, "give a directory")
  os.makedirs(os.path.join(path, CELLS_DIR), exist_ok=True)
  with workdir.lock(path):
    _check_config(path, config)
    cells = load_cells(path, grid)
    todo = [c for c in grid.cells() if c not in cells]
    total, seeds, begin = len(grid.cells()), len(grid.seeds), time.perf_counter()
    log(f"study: {len(cells)}/{total} cells done, {len(todo)} to run ({seeds} seeds each)")
    here = machine()
    elsewhere = [f"{m}@{g}" for (m, g), c in cells.items() if c.get("machine", here) != here]
    if elsewhere:
      log(
        f"study: {len(elsewhere)} finished cells ran on another machine or JAX "
        f"({', '.join(elsewhere[:3])}{', ...' if len(elsewhere) > 3 else ''}; this one: "
        f"{here}): on a CPU the same cell differs between instruction sets, so compare "
        "cells from one machine (cells/<cell>.json, 'machine')"
      )
    starts = Starts(os.path.join(path, STARTS_DIR))
    failed: dict[str, str] = {}
    try:
      if (
        todo
        and RunSpec.from_config(base).sft.enabled
        and not os.path.exists(os.path.join(path, STARTS_DIR))
      ):
        log(f"study: the first cell trains the {seeds} seeds' warm starts first")
      done = 0

      def outcome(cell: tuple[str, str], how: str | None) -> None:
        nonlocal done
        done += 1
        name = f"{cell[0]}@{cell[1]}"
        if how is None:
          cells[cell] = read_cell(path, grid, *cell)
        else:
          failed[name] = how
          log(f"study cell {name} failed: {how}")
        elapsed = time.perf_counter() - begin
        eta = elapsed / done * (len(todo) - done)
        failures = f", {len(failed)} failed" if failed else ""
        log(
          f"[{len(cells)}/{total} cells{failures}, {len(cells) * seeds}/{total * seeds} runs] "
          f"{name}: {elapsed:.0f}s elapsed, ETA {math.ceil(eta / 60)} min"
        )

      if isolation == "inline":
        for cell in todo:
          _run_and_write(config, path, *cell, starts)
          outcome(cell, None)
      else:
        for group in _groups(grid, todo):
          _run_group(config, path, group, outcome)
    finally:
      starts.close()
  if failed:
    raise StudyError(failed, total)
  # In the grid's order (a resumed study finished its cells in another): the report's
  # columns and rows follow it.
  return {cell: cells[cell] for cell in grid.cells() if cell in cells}
