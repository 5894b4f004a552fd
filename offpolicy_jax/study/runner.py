"""A seeded grid of methods x lag schedules, run with `jax.vmap` over seeds.

Every cell (method, lag) runs all seeds at once: the run states of the seeds
are stacked on a leading axis and one jitted `vmap(rl_step.rl_steps)` advances
them together, evaluating every `config.eval_every` steps with a vmapped
greedy sampler on `config.eval_prompts` held-out prompts. Runs with the same
seed share the warm start (`sft.warm_start`, computed once per seed) and the
prompt stream, so they are paired (`study.stats`). The lag schedule is a traced
argument and every cell has the same number of snapshot slots, so the lags of
one method share one compiled program.

Finished cells go to `workdir/cells/<method>@<lag>.json` (atomically); a rerun
skips them, so an interrupted study resumes (`study.report` makes the tables),
unless a field a finished cell depends on has changed (`config_schema`: every
field whose role reaches a study cell; not how seeds are batched, the report's
settings, checkpoints, logging, the mesh or the reward workers).

A/A calibration: for every lag of `config.study.aa_lags` the baseline method
runs a second time as the cell `aa-<method>@<lag>` (`study.grid`).

The pieces: `study.grid` (the grid of `config.study`: methods, lags, seeds,
A/A lags) and `study.cell` (one cell's seeds under one `jax.vmap`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import ml_collections

from offpolicy_jax.store import workdir
from offpolicy_jax.study.cell import run_cell
from offpolicy_jax.study.grid import AA_STREAM_OFFSET, Grid, grid_from_config

CELLS_DIR = "cells"
CONFIG_FILE = "study_config.json"


def cell_path(path: str, method: str, lag_name: str) -> str:
  return os.path.join(path, CELLS_DIR, f"{method}@{lag_name}.json")


def load_cells(path: str, grid: Grid) -> dict[tuple[str, str], dict]:
  """The finished cells of the grid in `path` (a corrupt cell file raises, naming it)."""
  cells = {}
  for method, lag_name in grid.cells():
    file = cell_path(path, method, lag_name)
    if not os.path.exists(file):
      continue
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
    cells[method, lag_name] = cell
  return cells


def _write_json(file: str, record: Any) -> None:
  tmp = file + ".tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, file)


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
  if changes:
    listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
    raise workdir.ConfigChanged(
      f"{path} holds a study started with another config ({file}): {listed}. "
      "Use a new --workdir or restore the old values."
    )


def run_study(
  config: ml_collections.ConfigDict, path: str, *, log: Callable[[str], None] = print
) -> dict[tuple[str, str], dict]:
  """Runs the cells of `config`'s grid not yet in `path`; returns every cell's record."""
  base, grid = grid_from_config(config)
  os.makedirs(os.path.join(path, CELLS_DIR), exist_ok=True)
  with workdir.lock(path):
    _check_config(path, config)
    cells = load_cells(path, grid)
    todo = [c for c in grid.cells() if c not in cells]
    total, seeds, begin = len(grid.cells()), len(grid.seeds), time.perf_counter()
    log(f"study: {len(cells)}/{total} cells done, {len(todo)} to run ({seeds} seeds each)")
    starts: dict[int, Any] = {}  # every cell of a seed starts from the same parameters
    for i, (method, lag_name) in enumerate(todo, start=1):
      cell_begin = time.perf_counter()
      record = run_cell(base, grid, method, lag_name, starts)
      record["seconds"] = time.perf_counter() - cell_begin
      _write_json(cell_path(path, method, lag_name), record)
      cells[method, lag_name] = record
      elapsed = time.perf_counter() - begin
      eta = elapsed / i * (len(todo) - i)
      log(
        f"[{len(cells)}/{total} cells, {len(cells) * seeds}/{total * seeds} runs] "
        f"{method}@{lag_name}: {elapsed:.0f}s elapsed, ETA {math.ceil(eta / 60)} min"
      )
  return cells
