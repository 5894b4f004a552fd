"""Reports over run workdirs: curves of several runs, one-line summaries, summary tables."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from offpolicy_jax import errors
from offpolicy_jax.learn import critic
from offpolicy_jax.store.metrics_files import read_metrics, split_rows

# The run's wall time so far, every command's (written by the loop in each train row).
RUN_WALL_KEY = "time/run_wall_s"
# A run's cost totals (`step.costs`) its summary keeps: summary name -> row key.
COST_KEYS = {
  "sampled_tokens": "cost/sampled_tokens",
  "sampled_prompt_tokens": "cost/sampled_prompt_tokens",
  "trained_tokens": "cost/trained_tokens",
  "sampler_busy_s": "time/run_sampler_busy_s",
  "sampler_idle_s": "time/run_sampler_idle_s",
  "learner_busy_s": "time/run_learner_busy_s",
  "learner_idle_s": "time/run_learner_idle_s",
  "device_busy_s": "time/run_device_busy_s",
}

# Longest text a markdown summary cell shows (the CSV keeps it whole).
_MD_CELL_CHARS = 300


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


def _sawtooth_period(values: list[float]) -> int:
  """The period of a sawtooth series: the steps between its drops, when they are regular.

  Staleness under `lag.sync_interval` m cycles 0, 1, ..., m-1 and drops back every
  m steps. A series whose drops are not at least 3/4 the same distance apart (noisy,
  constant, on-policy, too short) has period 1.
  """
  gaps = np.diff(np.flatnonzero(np.diff(values) < 0))
  if len(gaps) == 0:
    return 1
  counts = np.bincount(gaps)
  period = int(np.argmax(counts))
  return period if counts[period] >= 0.75 * len(gaps) else 1


def rolling_staleness(
  steps: list[int], values: list[float], smooth: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
  """Rolling mean, min and max of per-step staleness over whole sync cycles.

  The window is `smooth` steps rounded up to a multiple of the series' sawtooth
  period (at most the series' length), so the mean of a regular sawtooth is flat:
  0, 1, 2, 3, 0, ... averages to 1.5 at every step instead of a band.

  Args:
    steps: [S] step of each value.
    values: [S] staleness of each step's batch (S >= 1).
    smooth: the smallest window, in steps.

  Returns:
    (steps_w, mean_w, min_w, max_w, width): [S - width + 1] each, a window's
    statistics at its last step, and the window's width.
  """
  period = _sawtooth_period(values)
  width = min(len(values), -(-max(1, smooth) // period) * period)
  windows = np.lib.stride_tricks.sliding_window_view(np.asarray(values, float), width)
  steps_w = np.asarray(steps)[width - 1 :]
  return steps_w, windows.mean(axis=1), windows.min(axis=1), windows.max(axis=1), width


def _draw_staleness(ax: Any, steps: list[int], values: list[float], smooth: int, **line) -> None:
  """A run's rolling-mean staleness (labelled with its window) over a light min-max band."""
  steps_w, mean, lo, hi, width = rolling_staleness(steps, values, smooth)
  line["label"] = f"{line['label']} ({width}-step mean)"
  ax.plot(steps_w, mean, **line)
  ax.fill_between(steps_w, lo, hi, color=line["color"], alpha=0.15, linewidth=0)


def plot_runs(runs: Mapping[str, str], out_path: str, *, smooth: int = 5) -> str:
  """Draws reward, accuracy, staleness, clip fraction, entropy and KL curves of runs.

  Staleness cycles with the sync interval (0, 1, 2, 3, 0, ... under a sawtooth
  lag of 4), so its panel shows a rolling mean over whole cycles with the
  window's min-max range shaded (`rolling_staleness`).

  Args:
    runs: label -> workdir (or metrics.jsonl path).
    out_path: PNG file to write.
    smooth: moving-average window over steps for train curves (1 = raw); the
      staleness window is this rounded up to whole sync cycles.

  Returns:
    `out_path`.

  Raises:
    errors.WorkdirError: a run without metrics rows (nothing is drawn).
  """
  data = {label: read_metrics(path) for label, path in runs.items()}
  for label, rows in data.items():
    if not rows:
      raise errors.WorkdirError(
        f"{runs[label]}: no metrics rows to plot (a missing or empty metrics.jsonl)",
        "give a workdir a train run wrote",
      )
  import matplotlib  # after the checks: a wrong workdir fails without its 2 s import

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  cmap = plt.get_cmap("tab10" if len(data) <= 10 else "tab20")
  colors = {label: cmap(i % cmap.N) for i, label in enumerate(data)}
  for ax, (title, keys) in zip(axes.flat, PLOT_PANELS, strict=True):
    for label, rows in data.items():
      for key in keys:
        steps, values = _series(rows, key)
        if not steps:
          continue
        if title == "staleness":
          _draw_staleness(ax, steps, values, smooth, label=label, color=colors[label])
          break
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
  staleness_ax = axes.flat[[t for t, _ in PLOT_PANELS].index("staleness")]
  staleness_ax.set_ylabel("steps behind (line: mean, shaded: min-max)")
  staleness_ax.legend(fontsize=7)
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
    clip_frac, critic_ev_first_fifth / critic_ev_last_fifth (a critic's
    explained variance pooled over the fifth), run_wall_s (the run's wall
    time, every command's, when its rows record it), the cost totals of
    `COST_KEYS` (when recorded), start_accuracy
    (the evaluation at step 0: after the warm start), and every `eval/` metric
    of the last evaluation.
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
    if "critic/error_var" in train[-1]:  # pooled over each fifth (`critic.pooled_...`)
      out["critic_ev_first_fifth"] = critic.pooled_explained_variance(train[:fifth])
      out["critic_ev_last_fifth"] = critic.pooled_explained_variance(train[-fifth:])
    if "v0/predicted_all_equal" in train[-1]:  # prompts chosen by their values, last fifth
      for key in ("groups_all_equal", "v0/predicted_all_equal", "v0/predicted_all_equal_pool"):
        out[f"{key.removeprefix('v0/')}_last_fifth"] = float(
          np.mean([r[key] for r in train[-fifth:]])
        )
    if isinstance(train[-1].get(RUN_WALL_KEY), (int, float)):
      out["run_wall_s"] = float(train[-1][RUN_WALL_KEY])
    for name, key in COST_KEYS.items():
      if isinstance(train[-1].get(key), (int, float)):
        out[name] = float(train[-1][key])
  if evals and evals[0]["step"] == 0 and "eval/accuracy" in evals[0]:
    out["start_accuracy"] = evals[0]["eval/accuracy"]
  if evals:
    out.update({k: v for k, v in evals[-1].items() if k.startswith("eval/")})
  return out


def _prompt_values_text(s: dict[str, Any]) -> str:
  return (
    f"groups all equal {s['groups_all_equal_last_fifth']:.3f} (last fifth); predicted "
    f"{s['predicted_all_equal_last_fifth']:.3f} for the prompts chosen, "
    f"{s['predicted_all_equal_pool_last_fifth']:.3f} for all candidates"
  )


def format_run_summary(path: str, *, wall_s: float | None = None, lora: bool = False) -> str:
  """The table a finished run prints: what it did, and the commands that come next.

  Args:
    path: the run's workdir.
    wall_s: this command's wall time, when known.
    lora: the run trains adapters (its export is a PEFT adapter).
  """
  s = summarize_run(path)
  rows = [("workdir", path), ("steps", str(s["steps"]))]
  wall = _wall_text(s.get("run_wall_s"), wall_s)
  if wall:
    rows.append(("wall time", wall))
  if "reward_first_fifth" in s:
    first, last = s["reward_first_fifth"], s["reward_last_fifth"]
    rows.append(("reward", f"{first:.3f} (first fifth of steps) -> {last:.3f} (last fifth)"))
    rows.append(("staleness", f"{s['staleness_mean']:.3g} steps behind (mean)"))
  if "critic_ev_last_fifth" in s:
    ev = lambda v: "undefined (the returns did not vary)" if np.isnan(v) else f"{v:.3f}"
    first, last = ev(s["critic_ev_first_fifth"]), ev(s["critic_ev_last_fifth"])
    rows.append(("critic", f"explained variance {first} (first fifth) -> {last} (last)"))
  if "predicted_all_equal_last_fifth" in s:
    rows.append(("prompt values", _prompt_values_text(s)))
  if "sampled_tokens" in s:
    rows.append(("tokens", f"{s['sampled_tokens']:.0f} sampled, {s['trained_tokens']:.0f} trained"))
  if "sampler_idle_s" in s:
    rows.append(("busy / idle", _sides_text(s)))
  if "start_accuracy" in s and "eval/accuracy" in s:
    start, end = s["start_accuracy"], s["eval/accuracy"]
    rows.append(("accuracy", f"{start:.3f} at step 0 (after the warm start, if any) -> {end:.3f}"))
  rows += [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in s.items() if "/" in k]
  if s.get("eval/reward_mean") == s.get("eval/accuracy"):  # a 0/1 reward: the same number
    rows = [r for r in rows if r[0] != "eval/reward_mean"]
  export = "" if lora else " --merged"
  rows += [
    ("go on", "the same command with a larger --config.total_steps"),
    ("plot", f"python -m experiments.plot --workdirs={path} --out={path}/curves.png"),
    ("evaluate", f"python -m experiments.eval --workdir={path}"),
    ("export", f"python -m experiments.export --workdir={path} --out={path}/export{export}"),
  ]
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _wall_text(run_s: float | None, command_s: float | None) -> str:
  """The summary's wall time: the run's to its last step (every command's), and this command's."""
  this = "" if command_s is None else f"this command: {command_s:.0f} s"
  if run_s is None:
    return this
  whole = f"{run_s:.0f} s to the last step, every command counted"
  return f"{whole} ({this})" if this else whole


def _sides_text(s: Mapping[str, float]) -> str:
  """Each side's busy and idle seconds (a fused step's device time is busy time of both)."""
  fused = s.get("device_busy_s", 0.0)
  sides = [
    f"{side} {s[f'{side}_busy_s'] + fused:.0f} s / {s[f'{side}_idle_s']:.0f} s"
    for side in ("sampler", "learner")
  ]
  note = " (sampling and learning in one program)" if fused else ""
  return ", ".join(sides) + note


def _md_cell(text: str) -> str:
  if len(text) > _MD_CELL_CHARS:
    text = text[: _MD_CELL_CHARS - 3] + "..."
  return text.replace("|", "\\|")


def write_summary_table(
  runs: Mapping[str, str], out_dir: str, extra: Mapping[str, Mapping[str, str]] | None = None
) -> str:
  """Writes `summary.csv` and `summary.md` (one row per run) and returns the markdown path.

  Args:
    runs: run label -> workdir.
    out_dir: where the two files go.
    extra: run label -> {column: text} appended after the metric columns (e.g. a
      sweep's `status` and `error`); the CSV keeps the text whole, the markdown
      escapes `|` and cuts it at 300 characters.
  """
  extra = extra or {}
  rows = {label: summarize_run(path) for label, path in runs.items()}
  cols = ["steps", "reward_first_fifth", "reward_last_fifth", "staleness_mean", "clip_frac"]
  cols += sorted({k for r in rows.values() for k in r if k.startswith("eval/")})
  extra_cols = list(dict.fromkeys(k for e in extra.values() for k in e))
  for label, r in rows.items():
    r.update({k: extra.get(label, {}).get(k, "") for k in extra_cols})
  cols += extra_cols

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
      cells = (_md_cell(fmt(r.get(c, ""))) for c in cols)
      f.write(f"| {label} | " + " | ".join(cells) + " |\n")
  return md_path
