"""Paired comparisons of independent runs over seeds: what one setting buys over another.

A study (`study.runner`) vmaps its seeds through one program, so it cannot
hold settings whose runs differ in how they run: `lag.mode=async`, sampler
threads, a disaggregated sampler. Those run as a sweep of single runs
(`experiments.sweep`, e.g. `configs/what_lag_buys.py`) named
`<group>-s<seed>`; `compare(sweep_dir, baseline=...)` reads them back. Runs
with the same seed share the warm start and the prompt stream, so each group
is compared with the baseline group seed by seed, as in a study
(`study.stats`). Per run, from its metrics rows:

  final_accuracy         greedy held-out accuracy at the last evaluation
  steps_to_threshold     the first evaluated step at which accuracy reaches the warm
                         start (the evaluation at step 0) + `stats.LEARNING_GAIN`;
                         a run that never does is censored at its last evaluation
  wall_s_to_threshold    wall-clock seconds by then, from the end of the first step
                         (`time/run_wall_s`: evaluations and checkpoints included,
                         since an async sampler goes on sampling through them; the
                         start-up, warm start and first step's compilation are not)
  tokens_to_threshold    sampled tokens by then (`cost/sampled_tokens`)
  wall_s, sampled_tokens   the run's totals (wall_s: from the end of the first step to
                         the end of the last)

Per group and metric: mean [95% t interval] over seeds (`k/n` reached for the
threshold metrics, whose means are lower bounds when some run did not reach
it). Against the baseline on the seeds both ran: the paired difference
[95% t interval], the sign-flip p-value and the verdict from Holm-adjusted
p-values over the table (for final accuracy with `margin`, `≈` for a
difference shown to lie within +-margin; a censored run enters them at its
last evaluation, so a difference involving one is a bound), and for seconds
and tokens the ratio to the baseline: the geometric mean of the per-seed
ratios [95% t interval of the mean log ratio].

`write` puts `compare.md`, `compare.csv` (every run's values: the per-seed
data) and `pareto.png` (final accuracy against wall-clock seconds and against
sampled tokens, one point per group with its intervals, seeds faint; the
groups no other beats on both axes joined) in the sweep's directory.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from offpolicy_jax import errors
from offpolicy_jax.store import metrics_files
from offpolicy_jax.study import stats

# `<group>-s<seed>`: the name of a seeded run in a sweep's directory.
RUN_NAME = re.compile(r"^(?P<group>.+)-s(?P<seed>\d+)$")
METRICS = (
  "final_accuracy",
  "steps_to_threshold",
  "wall_s_to_threshold",
  "tokens_to_threshold",
  "wall_s",
  "sampled_tokens",
)
# Costs whose ratio to the baseline is tabulated (lower is better).
COSTS = ("wall_s_to_threshold", "tokens_to_threshold", "wall_s", "sampled_tokens")
_THRESHOLD = ("steps_to_threshold", "wall_s_to_threshold", "tokens_to_threshold")


def run_values(path: str) -> dict[str, float]:
  """One run's `METRICS` and `threshold_reached` from its metrics rows (module docstring).

  Raises:
    errors.WorkdirError: no evaluation at step 0 (the warm start) and after it,
      or a training row without its step time or sampled tokens.
  """
  rows = metrics_files.read_metrics(os.path.join(path, "metrics.jsonl"))
  train, evals = metrics_files.split_rows(rows)
  evals = [r for r in evals if "eval/accuracy" in r]
  steps = [int(r["step"]) for r in evals]
  if len(steps) < 2 or steps[0] != 0:
    raise errors.WorkdirError(
      f"{path}: evaluations at steps {steps}; a paired comparison needs the warm start's "
      "(step 0) and at least one after it",
      "set config.eval_every to a divisor of total_steps",
    )
  keys = ("time/run_wall_s", "cost/sampled_tokens")
  missing = [r.get("step") for r in train if any(k not in r for k in keys)]
  if missing or not train:
    raise errors.WorkdirError(
      f"{path}: training rows of steps {missing[:5]} lack time/run_wall_s or "
      "cost/sampled_tokens (or there is none)",
      "rerun with this version of the trainer",
    )
  by_step = {int(r["step"]): r for r in train}
  first = float(by_step[min(by_step)]["time/run_wall_s"])
  wall = lambda s: float(by_step[s]["time/run_wall_s"]) - first
  spent_s = [0.0 if s == 0 else wall(s) for s in steps]
  spent_tokens = [0.0 if s == 0 else float(by_step[s]["cost/sampled_tokens"]) for s in steps]
  accuracy = [float(r["eval/accuracy"]) for r in evals]
  to_step, reached = stats.steps_to_threshold(steps, accuracy)
  return {
    "final_accuracy": accuracy[-1],
    "steps_to_threshold": float(to_step),
    "threshold_reached": float(reached),
    "wall_s_to_threshold": stats.spent_to_threshold(steps, accuracy, spent_s),
    "tokens_to_threshold": stats.spent_to_threshold(steps, accuracy, spent_tokens),
    "wall_s": wall(max(by_step)),
    "sampled_tokens": float(by_step[max(by_step)]["cost/sampled_tokens"]),
  }


def read_runs(sweep_dir: str) -> dict[str, dict[int, dict[str, float]]]:
  """{group: {seed: run_values}} of the finished `<group>-s<seed>` runs under `sweep_dir`.

  Raises:
    errors.WorkdirError: no such run there.
  """
  out: dict[str, dict[int, dict[str, float]]] = {}
  names = sorted(os.listdir(sweep_dir)) if os.path.isdir(sweep_dir) else []
  for name in names:
    m = RUN_NAME.match(name)
    if m and os.path.exists(os.path.join(sweep_dir, name, "metrics.jsonl")):
      values = run_values(os.path.join(sweep_dir, name))
      out.setdefault(m["group"], {})[int(m["seed"])] = values
  if not out:
    raise errors.WorkdirError(
      f"{sweep_dir}: no run named <group>-s<seed> with a metrics.jsonl",
      "give the directory of a sweep whose run names end in -s<seed>",
    )
  return out


def read_csv(path: str) -> dict[str, dict[int, dict[str, float]]]:
  """The `{group: {seed: values}}` a `compare.csv` holds (what `read_runs` read from the runs)."""
  out: dict[str, dict[int, dict[str, float]]] = {}
  with open(path, newline="") as f:
    for row in csv.DictReader(f):
      seed = out.setdefault(row["group"], {}).setdefault(int(row["seed"]), {})
      seed[row["metric"]] = float(row["value"])
  return out


def log_ratio(values: Sequence[float], baseline: Sequence[float]) -> stats.Interval:
  """Geometric mean of values_i / baseline_i [95% t interval], over seeds with both > 0."""
  pairs = [(a, b) for a, b in zip(values, baseline, strict=True) if a > 0 and b > 0]
  if not pairs:
    return stats.Interval(math.nan, math.nan, math.nan, 0)
  iv = stats.interval([math.log(a / b) for a, b in pairs])
  return stats.Interval(math.exp(iv.mean), math.exp(iv.low), math.exp(iv.high), iv.n)


def compare(
  runs: Mapping[str, Mapping[int, Mapping[str, float]]],
  baseline: str,
  *,
  margin: float | None = None,
  alpha: float = 0.05,
) -> list[dict[str, Any]]:
  """One record per (group, metric): the group's interval and, but for the baseline, its
  paired comparison with the baseline (module docstring).

  Raises:
    ValueError: `baseline` is not a group of `runs`, or shares no seed with a group.
  """
  if baseline not in runs:
    raise ValueError(f"baseline: no group {baseline!r} among {sorted(runs)}")
  records, comps = [], {}
  for group, by_seed in runs.items():
    seeds = sorted(set(by_seed) & set(runs[baseline]))
    if not seeds:
      raise ValueError(f"group {group!r} shares no seed with the baseline {baseline!r}")
    for metric in METRICS:
      mine = [by_seed[s][metric] for s in sorted(by_seed)]
      rec: dict[str, Any] = {"group": group, "metric": metric, "interval": stats.interval(mine)}
      if metric in _THRESHOLD:
        rec["reached"] = (int(sum(by_seed[s]["threshold_reached"] for s in by_seed)), len(by_seed))
      if group != baseline:
        x = [by_seed[s][metric] for s in seeds]
        ref = [runs[baseline][s][metric] for s in seeds]
        m = margin if metric == "final_accuracy" else None
        comps[group, metric] = stats.compare(x, ref, margin=m)
        rec["comparison"] = comps[group, metric]
        if metric in COSTS:
          rec["ratio"] = log_ratio(x, ref)
      records.append(rec)
  for metric in METRICS:  # Holm over each metric's comparisons
    tested = stats.verdicts({k: c for k, c in comps.items() if k[1] == metric}, alpha)
    for rec in records:
      if (rec["group"], metric) in tested and rec["metric"] == metric:
        rec["p_adjusted"], rec["verdict"] = tested[rec["group"], metric]
  return records


_MARK = {
  stats.WORSE: "lower",
  stats.BETTER: "higher",
  stats.SAME: "~",
  stats.EQUIVALENT: "≈",
  stats.IDENTICAL: "=",
}


def report(records: Sequence[Mapping[str, Any]], baseline: str, margin, alpha: float) -> str:
  """`compare.md`: one table per metric."""
  lines = [
    "# Paired comparison of runs over seeds",
    "",
    f"Each group against **{baseline}** on the seeds both ran (`study.paired_runs`): mean "
    "[95% t interval]; the paired difference [95% t interval], its sign-flip p-value and "
    f"the verdict from Holm-adjusted p-values at alpha = {alpha:g} (`higher`/`lower`"
    + (f"; `≈`: final accuracy within +-{margin:g}, two one-sided t tests" if margin else "")
    + "); for seconds and tokens, the ratio to the baseline (geometric mean of the per-seed "
    "ratios [95% t interval]). `k/n`: runs that reached the warm start + "
    f"{stats.LEARNING_GAIN:.2f} (the others are censored at their last evaluation, so "
    "their means, and differences involving them, are bounds). Seconds are wall clock "
    "from the end of each run's first step, evaluations included.",
  ]
  for metric in METRICS:
    lines += ["", f"## {metric}", ""]
    lines += ["| group | mean [95%] | difference [95%] | p (Holm) | verdict | ratio [95%] |"]
    lines += ["|---|---|---|---|---|---|"]
    for rec in (r for r in records if r["metric"] == metric):
      iv = rec["interval"]
      cell = f"{iv.mean:.4g} [{iv.low:.4g}, {iv.high:.4g}]"
      if "reached" in rec:
        cell += f" ({rec['reached'][0]}/{rec['reached'][1]})"
      diff = p = verdict = ratio = "-"
      if "comparison" in rec:
        d = rec["comparison"].diff
        diff = f"{d.mean:+.4g} [{d.low:+.4g}, {d.high:+.4g}]"
        p = f"{rec['comparison'].p:.2g} ({rec['p_adjusted']:.2g})"
        verdict = _MARK[rec["verdict"]]
      if "ratio" in rec:
        r = rec["ratio"]
        ratio = f"{r.mean:.3f} [{r.low:.3f}, {r.high:.3f}]"
      lines.append(f"| {rec['group']} | {cell} | {diff} | {p} | {verdict} | {ratio} |")
  return "\n".join(lines) + "\n"


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
  """The groups no other is at least as cheap and at least as accurate as (and better in
  one), by cost.

  `points`: {group: (cost, accuracy)}; ties on both axes keep every tied group.
  """
  front = [
    g
    for g, (c, a) in points.items()
    if not any((c2 <= c and a2 >= a) and (c2, a2) != (c, a) for c2, a2 in points.values())
  ]
  return sorted(front, key=lambda g: points[g][0])


def plot(
  runs: Mapping[str, Mapping[int, Mapping[str, float]]],
  out_path: str,
  wall_label: str = "wall-clock seconds",
) -> str:
  """`pareto.png`: final accuracy against wall-clock seconds and against sampled tokens."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  colors = max(len(runs), 10)
  cmap = plt.get_cmap("tab10" if colors == 10 else "tab20" if colors <= 20 else "turbo", colors)
  for ax, cost, label in zip(
    axes, ("wall_s", "sampled_tokens"), (wall_label, "sampled tokens"), strict=True
  ):
    means = {}
    for i, (group, by_seed) in enumerate(runs.items()):
      xs = [v[cost] for v in by_seed.values()]
      ys = [v["final_accuracy"] for v in by_seed.values()]
      ax.scatter(xs, ys, color=cmap(i % colors), alpha=0.25, s=12)
      x, y = stats.interval(xs), stats.interval(ys)
      ax.errorbar(
        x.mean,
        y.mean,
        xerr=None if math.isnan(x.low) else [[x.mean - x.low], [x.high - x.mean]],
        yerr=None if math.isnan(y.low) else [[y.mean - y.low], [y.high - y.mean]],
        fmt="o",
        color=cmap(i % colors),
        label=group,
        capsize=3,
      )
      means[group] = (x.mean, y.mean)
    front = pareto_front(means)
    ax.plot([means[g][0] for g in front], [means[g][1] for g in front], "k--", lw=0.8)
    ax.set_xlabel(label)
    ax.set_ylabel("final greedy accuracy")
    ax.grid(alpha=0.3)
  # Below both panels: a study's grid has tens of method x lag cells.
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=7)
  fig.suptitle("mean over seeds [95% t intervals]; dashed: the Pareto front")
  fig.tight_layout()
  fig.savefig(out_path, dpi=100, bbox_inches="tight")
  plt.close(fig)
  return out_path


def write(
  sweep_dir: str, baseline: str, *, margin: float | None = None, alpha: float = 0.05
) -> dict[str, str]:
  """Writes `compare.md`, `compare.csv` and `pareto.png` into `sweep_dir`; returns their paths."""
  runs = read_runs(sweep_dir)
  records = compare(runs, baseline, margin=margin, alpha=alpha)
  paths = {name: os.path.join(sweep_dir, name) for name in ("compare.md", "compare.csv")}
  with open(paths["compare.md"], "w") as f:
    f.write(report(records, baseline, margin, alpha))
  with open(paths["compare.csv"], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["group", "seed", "metric", "value"])
    for group, by_seed in runs.items():
      for seed in sorted(by_seed):
        for metric, value in by_seed[seed].items():
          w.writerow([group, seed, metric, repr(value)])
  paths["pareto.png"] = plot(runs, os.path.join(sweep_dir, "pareto.png"))
  return paths
