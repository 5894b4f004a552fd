"""Run metrics: an append-only JSONL log, TensorBoard, optional W&B, a progress bar.

One JSON object per optimizer step goes to `workdir/metrics.jsonl` (evaluation
rows carry `eval/` keys and the step they were taken at). Every row is flushed
as soon as it is written, so a run killed at any moment loses at most the row
being written. On resume the writer first drops every row whose step is beyond
the restored checkpoint (and a torn last line), so the resumed run rewrites
them and the file never holds duplicates or gaps.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


def to_python(value: Any) -> Any:
  """Converts a jax/numpy scalar (or a small array) to a JSON-friendly value."""
  if isinstance(value, (bool, int, float, str)) or value is None:
    return value
  arr = np.asarray(value)
  if arr.ndim == 0:
    item = arr.item()
    return float(item) if isinstance(item, (float, np.floating)) else item
  return arr.tolist()


def read_metrics(path: str) -> list[dict[str, Any]]:
  """Reads a metrics file (or the one inside a workdir), skipping a torn last line.

  Args:
    path: a `metrics.jsonl` file or a directory holding one.

  Returns:
    The rows in file order.
  """
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  rows: list[dict] = []
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        break  # A line torn by a kill; everything after it is untrusted.
  return rows


def split_rows(rows: Iterable[Mapping[str, Any]]) -> tuple[list[dict], list[dict]]:
  """Splits rows into (train rows, eval rows); eval rows hold any `eval/` key."""
  train: list[dict] = []
  evals: list[dict] = []
  for row in rows:
    (evals if any(k.startswith("eval/") for k in row) else train).append(dict(row))
  return train, evals


def truncate_metrics(path: str, last_step: int) -> int:
  """Keeps only complete rows with `step <= last_step`, rewriting the file atomically.

  Args:
    path: the metrics file.
    last_step: the step of the checkpoint the run resumes from.

  Returns:
    The number of rows kept.
  """
  rows = [r for r in read_metrics(path) if int(r.get("step", 0)) <= last_step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return len(rows)


def save_config(workdir: str, config: Any) -> str:
  """Writes the run's config beside its metrics as `config.json` (and returns the path)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILE)
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  with open(path, "w") as f:
    json.dump(config, f, indent=2, sort_keys=True, default=str)
  return path


class MetricsWriter:
  """Writes metric rows to JSONL (+ TensorBoard, + W&B) and drives a progress bar.

  Args:
    workdir: run directory; created if missing.
    resume_step: the step of the checkpoint the run resumes from: rows of
      later steps already in the file are dropped. None for a fresh run: any
      existing file is emptied.
    total_steps: total optimizer steps, for the progress bar's ETA.
    config: optional config, saved as `config.json` and passed to W&B.
    tensorboard: write TensorBoard event files under `workdir/tb`.
    wandb_project: a W&B project name; W&B is used only when this is set and
      the `wandb` package is installed.
    progress: show a tqdm progress bar with the ETA and the current reward.
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
    self._file = self._tb = self._wandb = self._bar = None
    if not primary:
      return
    os.makedirs(workdir, exist_ok=True)
    start_step = resume_step or 0
    if os.path.exists(self.path):
      truncate_metrics(self.path, -1 if resume_step is None else resume_step)
    if config is not None:
      save_config(workdir, config)
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      # purge_step hides events a killed run wrote past the checkpoint (all of
      # them on a fresh start, matching the emptied metrics.jsonl).
      purge = 0 if resume_step is None else start_step + 1
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=purge)
    self._wandb = None
    if wandb_project:
      try:
        import wandb
      except ImportError:
        wandb = None
      if wandb is not None:
        cfg = config.to_dict() if hasattr(config, "to_dict") else config
        self._wandb = wandb.init(
          project=wandb_project,
          dir=workdir,
          config=cfg,
          id=os.path.basename(os.path.abspath(workdir)),
          resume="allow",
        )
    self._bar = None
    if progress and total_steps:
      from tqdm.auto import tqdm

      self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

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
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, global_step=step)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=int(step))
    return row

  def progress(self, step: int, **postfix: Any) -> None:
    """Moves the progress bar to `step` and shows `postfix` (e.g. reward=0.4)."""
    if self._bar is None:
      return
    self._bar.update(step - self._bar.n)
    shown = {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in postfix.items()}
    self._bar.set_postfix(shown, refresh=False)

  def log_text(self, message: str) -> None:
    """Prints a message without breaking the progress bar."""
    if self._bar is not None:
      self._bar.write(message)
    elif self.primary:
      print(message, flush=True)

  def close(self) -> None:
    """Flushes and closes every sink."""
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()
    if self._bar is not None:
      self._bar.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# Curves plot.py draws: (title, candidate keys; the first present in a run is used).
PLOT_PANELS = (
  ("reward", ("reward_mean",)),
  ("accuracy", ("eval/accuracy", "accuracy")),
  ("staleness", ("staleness_mean",)),
  ("clip / mask fraction", ("clip_frac",)),
  ("entropy", ("entropy",)),
  ("KL(mu || theta) k3", ("kl_k3", "kl_k1")),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
  return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_runs(runs: Mapping[str, str], out_path: str, *, smooth: int = 5) -> str:
  """Draws reward, accuracy, staleness, clip fraction, entropy and KL curves of runs.

  Args:
    runs: label -> workdir (or metrics.jsonl path).
    out_path: PNG file to write.
    smooth: moving-average window over steps for train curves (1 = raw).

  Returns:
    `out_path`.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  data = {label: read_metrics(path) for label, path in runs.items()}
  cmap = plt.get_cmap("tab10" if len(data) <= 10 else "tab20")
  colors = {label: cmap(i % cmap.N) for i, label in enumerate(data)}
  for ax, (title, keys) in zip(axes.flat, PLOT_PANELS, strict=True):
    for label, rows in data.items():
      for key in keys:
        steps, values = _series(rows, key)
        if not steps:
          continue
        if smooth > 1 and not key.startswith("eval/") and len(values) >= smooth:
          kernel = np.ones(smooth) / smooth
          values = list(np.convolve(values, kernel, mode="valid"))
          steps = steps[smooth - 1 :]
        marker = "o" if key.startswith("eval/") else None
        ax.plot(steps, values, label=label, color=colors[label], marker=marker)
        break
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes.flat[0].legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  fig.savefig(out_path, dpi=100)
  plt.close(fig)
  return out_path


def summarize_run(path: str) -> dict[str, Any]:
  """One summary row of a run: rewards of the first and last fifth of steps, final eval.

  Args:
    path: a workdir (or metrics.jsonl).

  Returns:
    dict with steps, reward_first_fifth, reward_last_fifth, staleness_mean,
    clip_frac, and every `eval/` metric of the last evaluation.
  """
  train, evals = split_rows(read_metrics(path))
  out: dict[str, Any] = {"steps": len(train)}
  if train:
    fifth = max(1, len(train) // 5)
    rewards = [r.get("reward_mean", float("nan")) for r in train]
    out["reward_first_fifth"] = float(np.mean(rewards[:fifth]))
    out["reward_last_fifth"] = float(np.mean(rewards[-fifth:]))
    for key in ("staleness_mean", "clip_frac"):
      vals = [r[key] for r in train if isinstance(r.get(key), (int, float))]
      out[key] = float(np.mean(vals)) if vals else float("nan")
  if evals:
    out.update({k: v for k, v in evals[-1].items() if k.startswith("eval/")})
  return out


def write_summary_table(runs: Mapping[str, str], out_dir: str) -> str:
  """Writes `summary.csv` and `summary.md` (one row per run) and returns the markdown path."""
  rows = {label: summarize_run(path) for label, path in runs.items()}
  cols = ["steps", "reward_first_fifth", "reward_last_fifth", "staleness_mean", "clip_frac"]
  cols += sorted({k for r in rows.values() for k in r if k.startswith("eval/")})

  def fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)

  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "summary.csv"), "w") as f:
    writer = csv.writer(f, lineterminator="\n")
    writer.writerow(["run", *cols])
    for label, r in rows.items():
      writer.writerow([label, *(fmt(r.get(c, "")) for c in cols)])
  md_path = os.path.join(out_dir, "summary.md")
  with open(md_path, "w") as f:
    f.write("| run | " + " | ".join(cols) + " |\n")
    f.write("|---" * (len(cols) + 1) + "|\n")
    for label, r in rows.items():
      f.write(f"| {label} | " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |\n")
  return md_path
