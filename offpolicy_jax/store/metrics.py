"""Run metrics: an append-only JSONL log, TensorBoard, optional W&B, a progress bar.

One JSON object per optimizer step goes to `workdir/metrics.jsonl` (evaluation
rows carry `eval/` keys and the step they were taken at); TensorBoard shows
each key under a group (`tb_tag`: `train/`, `offpolicy/`, `speed/`, `health/`,
or the key's own prefix). The file is written so that no event loses rows
that could be kept:

- every row is flushed as soon as it is written, and `MetricsWriter.sync`
  (called at each checkpoint) fsyncs the file, so a kill loses at most the row
  being written and a power cut at most the rows after the last checkpoint;
- readers skip an unreadable line (torn by a kill, or corrupted) with a
  warning naming the file and line, and keep every valid row around it;
- on resume the writer drops only the rows whose step is after the restored
  checkpoint (the resumed run rewrites them, so there are no duplicates or
  gaps); unreadable lines go to `metrics.jsonl.bad`, never destroyed;
- a file deleted or replaced while the run goes on is noticed before the next
  write, re-created with a warning, and written on;
- a fresh start never deletes an earlier run's files: `metrics.jsonl`, `tb/`
  and `config.json` are moved to `workdir/previous/<timestamp>/`.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from offpolicy_jax import metric_names
from offpolicy_jax.store.metrics_files import (
  BAD_SUFFIX,
  METRICS_FILE,
  fsync_dir,
  truncate_metrics,
)
from offpolicy_jax.store.progress import Progress

CONFIG_FILE = "config.json"
# Written by `workdir.check_config`; it belongs to the run, so it moves with it.
CONFIG_HISTORY_FILE = "config_history.jsonl"
TB_DIR = "tb"
# Where a fresh start moves an earlier run's files: workdir/previous/<timestamp>/.
PREVIOUS_DIR = "previous"


def tb_tag(key: str) -> str:
  """The TensorBoard tag of a row key: `<group>/<key>` (`metric_names.group_of`), or the key
  itself when it has a "/" (its prefix is its group). Only the TensorBoard tag has the group:
  metrics.jsonl and W&B keep the row's keys."""
  return key if "/" in key else f"{metric_names.group_of(key)}/{key}"


def to_python(value: Any) -> Any:
  """Converts a jax/numpy scalar (or a small array) to a JSON-friendly value."""
  if isinstance(value, (bool, int, float, str)) or value is None:
    return value
  arr = np.asarray(value)
  if arr.ndim == 0:
    item = arr.item()
    return float(item) if isinstance(item, (float, np.floating)) else item
  return arr.tolist()


def save_config(workdir: str, config: Any) -> str:
  """Writes the run's config beside its metrics as `config.json` (and returns the path)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILE)
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  with open(path, "w") as f:
    json.dump(config, f, indent=2, sort_keys=True, default=str)
  return path


def _timestamp() -> str:
  return time.strftime("%Y%m%d-%H%M%S")


def _move_previous_run(workdir: str) -> str | None:
  """Moves an earlier run's files out of the way of a fresh start, deleting nothing.

  `metrics.jsonl` (and its `.bad` companion), `tb/`, `config.json` and
  `config_history.jsonl` go to
  `workdir/previous/<YYYYmmdd-HHMMSS>/` (a `-1`, `-2`... suffix keeps two moves
  in the same second apart).

  Args:
    workdir: the run directory.

  Returns:
    The directory the files went to, or None if there was nothing to move.
  """
  names = [METRICS_FILE, METRICS_FILE + BAD_SUFFIX, TB_DIR, CONFIG_FILE, CONFIG_HISTORY_FILE]
  present = [n for n in names if os.path.lexists(os.path.join(workdir, n))]
  if not present:
    return None
  base = os.path.join(workdir, PREVIOUS_DIR, _timestamp())
  dest, n = base, 0
  os.makedirs(os.path.dirname(base), exist_ok=True)
  while True:
    try:
      os.mkdir(dest)  # Atomic: a concurrent fresh start cannot claim the same directory.
      break
    except FileExistsError:
      n += 1
      dest = f"{base}-{n}"
  for name in present:
    os.rename(os.path.join(workdir, name), os.path.join(dest, name))
  fsync_dir(workdir)
  return dest


def _open_for_append(path: str) -> IO[str]:
  """Opens `path` for appending (creating it and its directory), starting on a new line."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  f = open(path, "a", encoding="utf-8")
  with open(path, "rb") as r:
    r.seek(0, os.SEEK_END)
    if r.tell() > 0:
      r.seek(-1, os.SEEK_END)
      if r.read(1) != b"\n":
        f.write("\n")  # A torn last line must not swallow the next row.
  return f


class MetricsWriter:
  """Writes metric rows to JSONL (+ TensorBoard, + W&B) and drives a progress bar.

  Before each write the writer checks that `metrics.jsonl` is still the file
  it opened; a deleted or replaced file is re-opened (re-created) with a
  warning and the run goes on writing to it. Call `sync` after each
  checkpoint to make the rows written so far durable.

  Args:
    workdir: run directory; created if missing.
    resume_step: the step of the checkpoint the run resumes from: rows of
      later steps already in the file are dropped. None for a fresh run: an
      earlier run's `metrics.jsonl`, `tb/` and `config.json` are moved to
      `workdir/previous/<timestamp>/`, never deleted.
    total_steps: total optimizer steps, for the progress bar's ETA.
    config: optional config, saved as `config.json` and passed to W&B.
    tensorboard: write TensorBoard event files under `workdir/tb`, each key
      under its group (`tb_tag`).
    wandb_project: a W&B project name; W&B is used only when this is set and
      the `wandb` package is installed.
    progress: show the progress with the ETA and the current reward: a tqdm
      bar on a terminal, a plain line every tenth of the run elsewhere
      (`progress.Progress`).
    primary: False on every process but the first of a multi-host run: rows
      are formatted and returned but nothing is written, shown or logged.
  """

  def __init__(
    self,
    workdir: str,
    *,
    resume_step: int | None = None,
    total_steps: int | None = None,
    config: Any = None,
    tensorboard: bool = True,
    wandb_project: str | None = None,
    progress: bool = True,
    primary: bool = True,
  ):
    self.workdir = workdir
    self.path = os.path.join(workdir, METRICS_FILE)
    self.primary = primary
    self._file: IO[str] | None = None
    self._dir_synced = False
    self._tb = self._wandb = None
    self._bar: Progress | None = None
    if not primary:
      return
    os.makedirs(workdir, exist_ok=True)
    moved_to = None
    if resume_step is None:
      moved_to = _move_previous_run(workdir)
    elif os.path.exists(self.path):
      truncate_metrics(self.path, resume_step)
    if config is not None:
      save_config(workdir, config)
    self._file = _open_for_append(self.path)
    if tensorboard:
      from tensorboardX import SummaryWriter

      # On resume, purge_step hides events a killed run wrote past the checkpoint.
      purge = None if resume_step is None else resume_step + 1
      self._tb = SummaryWriter(os.path.join(workdir, TB_DIR), purge_step=purge)
    if wandb_project:
      self._wandb = _init_wandb(wandb_project, workdir, config)
    if progress and total_steps:
      self._bar = Progress(total_steps, resume_step or 0)
    if moved_to is not None:
      self.log_text(f"fresh start: moved the earlier run's files in {workdir} to {moved_to}")

  def _reopen_if_gone(self, step: int) -> None:
    """Re-creates `metrics.jsonl` if it was deleted or replaced since it was opened."""
    assert self._file is not None
    try:
      if os.path.samestat(os.stat(self.path), os.fstat(self._file.fileno())):
        return
      what = "replaced by another file; appending to the new file"
    except FileNotFoundError:
      what = "deleted; re-creating it (its earlier rows are lost)"
    warnings.warn(f"{self.path} was {what} from step {step} on", stacklevel=3)
    self._file.close()
    self._file = _open_for_append(self.path)
    self._dir_synced = False

  def write(self, step: int, scalars: Mapping[str, Any]) -> dict[str, Any]:
    """Appends one row `{"step": step, **scalars}` and flushes it.

    Args:
      step: optimizer step the row belongs to.
      scalars: metric name -> scalar (python, numpy or jax).

    Returns:
      The row as written.
    """
    row = {"step": int(step)}
    row.update({k: to_python(v) for k, v in scalars.items()})
    if self._file is None:
      return row
    self._reopen_if_gone(row["step"])
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(tb_tag(k), v, global_step=step)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=int(step))
    return row

  def sync(self) -> None:
    """Makes every row written so far durable: fsyncs `metrics.jsonl`, flushes TensorBoard.

    The loop calls it at each checkpoint, so the rows up to a saved step
    survive a power cut along with the checkpoint.
    """
    if self._file is not None:
      self._file.flush()
      os.fsync(self._file.fileno())
      if not self._dir_synced:  # A newly created file's directory entry.
        fsync_dir(self.workdir)
        self._dir_synced = True
    if self._tb is not None:
      self._tb.flush()

  def progress(self, step: int, **postfix: Any) -> None:
    """Moves the progress bar to `step` and shows `postfix` (e.g. reward=0.4)."""
    if self._bar is not None:
      self._bar.update(step, **postfix)

  def log_text(self, message: str) -> None:
    """Prints a message without breaking the progress bar."""
    if self._bar is not None:
      self._bar.write(message)
    elif self.primary:
      print(message, flush=True)

  def close(self) -> None:
    """Syncs and closes every sink; closing twice is harmless."""
    try:
      self.sync()
    finally:
      if self._file is not None:
        self._file.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.finish()
      if self._bar is not None:
        self._bar.close()
      self._file = self._tb = self._wandb = None
      self._bar = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _init_wandb(project: str, workdir: str, config: Any) -> Any:
  """A W&B run named after the workdir, or None if `wandb` is not installed."""
  try:
    import wandb
  except ImportError:
    return None
  cfg = config.to_dict() if hasattr(config, "to_dict") else config
  return wandb.init(
    project=project,
    dir=workdir,
    config=cfg,
    id=os.path.basename(os.path.abspath(workdir)),
    resume="allow",
  )
