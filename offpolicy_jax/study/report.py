"""A study's files: `study.csv` (one row per run and metric), `study.md` (tables), plots.

`study.md` (`study.report_tables`) reads the per-seed summaries with
`study.stats`: intervals, verdicts from Holm-corrected permutation tests,
learning speed within a lag, and the A/A calibration's measured false-verdict rate.

The CSV is the source of everything else: `tables` and `plot_study`
read rows, so `experiments.plot --study_csv=...` redraws the figures from it.
Rows are `method, lag, seed, metric, step, value`; summaries have an empty
`step`, curves (`eval_accuracy`, `train_reward`) one row per step.
"""

from __future__ import annotations

import collections
import csv
import io
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from offpolicy_jax import files
from offpolicy_jax.config_spec import RunSpec, StudySpec
from offpolicy_jax.study import bandit, paired_runs, report_tables
from offpolicy_jax.study import grid as study_grid
from offpolicy_jax.study import stats as study_stats
from offpolicy_jax.study.report_tables import summary_table

FIELDS = ("method", "lag", "seed", "metric", "step", "value")
# Curves and summaries of the off-policy estimates (`config.study.ope`): `ope_<key>`.
OPE_PREFIX = "ope_"


def ope_summary(ope: Mapping[str, list[float]]) -> dict[str, float]:
  """A run's off-policy evaluation against the truth, over its evaluations.

  For each estimator `n` (and for `behavior`, the stored rows' own mean reward:
  what the stale data says with no correction): `ope_<n>_abs_error`, the mean
  |estimate - truth|, and for the estimators `ope_<n>_coverage`, the share of
  evaluations whose 95% interval holds the truth (the samples' mean reward).
  """
  if not ope:
    return {}
  truth = np.asarray(ope["truth"], np.float64)
  out = {}
  names = [k.removeprefix("ope/") for k in ope if k.startswith("ope/") and f"{k}_low" in ope]
  for name in [*names, "behavior_reward"]:
    est = np.asarray(ope[f"ope/{name}"], np.float64)
    tag = name.removesuffix("_reward")
    out[f"{OPE_PREFIX}{tag}_abs_error"] = float(np.mean(np.abs(est - truth)))
    if name in names:
      low, high = (np.asarray(ope[f"ope/{name}_{e}"], np.float64) for e in ("low", "high"))
      out[f"{OPE_PREFIX}{tag}_coverage"] = float(np.mean((low <= truth) & (truth <= high)))
  return out


CURVES = ("eval_accuracy", "train_reward")


def cell_rows(cell: Mapping[str, Any], eval_last: int) -> list[dict[str, Any]]:
  """The CSV rows of one cell record (`study.cell.run_cell`)."""
  rows = []
  base = {"method": cell["method"], "lag": cell["lag"]}
  for run in cell["runs"]:
    summary = study_stats.run_summary(
      run["eval_steps"],
      run["eval_accuracy"],
      run["train_reward"],
      last=eval_last,
      skipped=run["skipped"],
    )
    summary |= {k: v for k, v in run.items() if k.startswith("pass@") and v is not None}
    summary |= run.get("off_policy", {})
    summary |= run.get("reward_failures", {})
    summary |= run.get("costs", {})
    steps, acc = run["eval_steps"], run["eval_accuracy"]
    for name, key in (("tokens", "eval_sampled_tokens"), ("train_wall_s", "eval_train_wall_s")):
      if key in run:
        summary[f"{name}_to_threshold"] = study_stats.spent_to_threshold(steps, acc, run[key])
    summary |= ope_summary(run.get("ope", {}))
    for metric, value in summary.items():
      rows.append({**base, "seed": run["seed"], "metric": metric, "step": "", "value": value})
    curves = {
      "eval_accuracy": zip(run["eval_steps"], run["eval_accuracy"], strict=True),
      "train_reward": enumerate(run["train_reward"], start=1),
    }
    for key, values in run.get("ope", {}).items():  # evaluations 1, 2, ... (not step 0)
      curves[OPE_PREFIX + key.removeprefix("ope/")] = zip(
        run["eval_steps"][1:], values, strict=True
      )
    for metric, points in curves.items():
      for step, value in points:
        rows.append({**base, "seed": run["seed"], "metric": metric, "step": step, "value": value})
  return rows


def write_csv(path: str, rows: Iterable[Mapping[str, Any]]) -> str:
  text = io.StringIO(newline="")
  w = csv.DictWriter(text, FIELDS)
  w.writeheader()
  w.writerows(rows)
  files.write_text_atomic(path, text.getvalue())
  return path


def read_csv(path: str) -> list[dict[str, Any]]:
  """Rows of a `study.csv` with numeric `seed`, `step` (None for summaries) and `value`."""
  try:
    return _read_csv(path)
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not a study CSV ({e})") from None


def _read_csv(path: str) -> list[dict[str, Any]]:
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    if reader.fieldnames is None or tuple(reader.fieldnames) != FIELDS:
      raise ValueError(f"{path}: not a study CSV (columns {reader.fieldnames}, want {FIELDS})")
    rows = []
    for i, r in enumerate(reader, start=2):
      try:
        step = int(r["step"]) if r["step"] else None
        rows.append({**r, "seed": int(r["seed"]), "step": step, "value": float(r["value"])})
      except (TypeError, ValueError) as e:
        raise ValueError(f"{path}, row {i}: {e}") from None
  return rows


def _curve(rows: list[dict], metric: str) -> dict[tuple[str, str], dict[int, dict[int, float]]]:
  """{(method, lag): {step: {seed: value}}} of one curve metric."""
  out: dict = collections.defaultdict(lambda: collections.defaultdict(dict))
  for r in rows:
    if r["metric"] == metric and r["step"] not in (None, ""):
      out[r["method"], r["lag"]][r["step"]][r["seed"]] = r["value"]
  return out


# The Pareto plot's costs (`paired_runs.plot`'s names) and the study's summaries they read.
PARETO_COSTS = {"wall_s": "train_wall_s", "sampled_tokens": "sampled_tokens"}


PARETO_WALL = "training seconds per run (program's / seeds)"


def pareto_lines(runs: Mapping[str, Mapping[int, Mapping[str, float]]]) -> list[str]:
  """study.md's section on `pareto.png`: the cells on each Pareto front, by cost."""
  if not runs:
    return []
  lines = [
    "## Accuracy against cost",
    "",
    "`pareto.png`: final accuracy against training seconds and against sampled tokens, one",
    "point per method x lag (mean over seeds, 95% t intervals). Seconds are one measurement",
    "per vmapped program, shared by its seeds (`train_wall_s`: its training seconds / its",
    "seeds; all seeds in one program give an interval of no width), and include compiling",
    "the method's program, which falls in its first cell (its first lag); the cells ran one",
    "after another on one machine, so seconds compare within this study only, and no test",
    "is made on them. On the Pareto front (no other cell is at least as cheap and at least",
    "as accurate, and better in one), cheapest first:",
    "",
  ]
  for cost, label in (("wall_s", "seconds"), ("sampled_tokens", "sampled tokens")):
    means = {
      g: (
        float(np.mean([r[cost] for r in by_seed.values()])),
        float(np.mean([r["final_accuracy"] for r in by_seed.values()])),
      )
      for g, by_seed in runs.items()
    }
    front = paired_runs.pareto_front(means)
    cells = ", ".join(f"{g} ({means[g][0]:.4g}, {means[g][1]:.3f})" for g in front)
    lines.append(f"- {label}: {cells}")
  return lines


def pareto_runs(rows: list[dict]) -> dict[str, dict[int, dict[str, float]]]:
  """`{"method@lag": {seed: {final_accuracy, wall_s, sampled_tokens}}}` of every cell of the
  grid (A/A twins left out) whose runs record their costs: `paired_runs.plot`'s input.

  `wall_s` is a run's `train_wall_s`: its vmapped program's training seconds
  shared by the seeds that ran in it (`seeds_per_program`).
  """
  methods, lags, values = summary_table(rows)
  runs: dict[str, dict[int, dict[str, float]]] = {}
  for m in methods:
    if m.startswith(study_grid.AA_PREFIX):
      continue
    for g in lags:
      acc = values.get((m, g, "final_accuracy"), {})
      costs = {k: values.get((m, g, name), {}) for k, name in PARETO_COSTS.items()}
      seeds = [s for s in sorted(acc) if all(s in c for c in costs.values())]
      if seeds:
        runs[f"{m}@{g}"] = {
          s: {"final_accuracy": acc[s], **{k: c[s] for k, c in costs.items()}} for s in seeds
        }
  return runs


def plot_study(rows: list[dict], out_dir: str, *, baseline: tuple[str, str]) -> list[str]:
  """`curves_<lag>.png` (mean eval accuracy, 95% band, per method), `final.png`, and
  `pareto.png` (final accuracy against wall clock and sampled tokens, one point per
  method x lag, `pareto_runs`) when the runs record their costs."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods, lags, values = summary_table(rows)
  if not any(metric == "final_accuracy" for (_, _, metric) in values):
    raise ValueError("no final_accuracy summaries among the rows: nothing to plot in final.png")
  colors = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(methods), 2)))
  curves = _curve(rows, "eval_accuracy")
  paths = []
  for g in lags:
    fig, ax = plt.subplots(figsize=(8, 5))
    for color, m in zip(colors, methods, strict=False):
      points = curves.get((m, g))
      if not points:
        continue
      steps = sorted(points)
      ivs = [study_stats.interval(list(points[s].values())) for s in steps]
      ax.plot(steps, [iv.mean for iv in ivs], color=color, label=m)
      ax.fill_between(
        steps, [iv.low for iv in ivs], [iv.high for iv in ivs], color=color, alpha=0.15
      )
    ax.set(title=f"lag: {g}", xlabel="step", ylabel="greedy held-out accuracy")
    ax.legend(fontsize=7, ncol=2)
    paths.append(os.path.join(out_dir, f"curves_{g}.png"))
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
  fig, axes = plt.subplots(1, len(lags), figsize=(3 * len(lags), 0.3 * len(methods) + 1.5))
  axes = np.atleast_1d(axes)
  ref = values.get((baseline[0], baseline[1], "final_accuracy"), {})
  for ax, g in zip(axes, lags, strict=True):
    for y, m in enumerate(methods):
      got = values.get((m, g, "final_accuracy"))
      if got:
        iv = study_stats.interval(list(got.values()))
        ax.errorbar(iv.mean, y, xerr=[[iv.mean - iv.low], [iv.high - iv.mean]], fmt="o", ms=3)
    if ref:
      ax.axvline(float(np.mean(list(ref.values()))), color="grey", ls="--", lw=0.8)
    ax.set(title=g, xlabel="final accuracy", yticks=range(len(methods)))
    ax.set_yticklabels(methods if ax is axes[0] else [], fontsize=7)
    ax.invert_yaxis()
  paths.append(os.path.join(out_dir, "final.png"))
  fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
  plt.close(fig)
  runs = pareto_runs(rows)
  if runs:
    out = os.path.join(out_dir, "pareto.png")
    paths.append(paired_runs.plot(runs, out, wall_label=PARETO_WALL))
  return paths


def _table_options(config) -> dict:
  """What `report_tables` takes from a study's config: baseline, title, alpha and margin."""
  base, grid = study_grid.grid_from_config(config)
  run, st = RunSpec.from_config(base), StudySpec.from_config(config)
  return dict(
    baseline=grid.baseline,
    title=f"Lag study: {len(grid.methods)} methods x {len(grid.lags)} lags x "
    f"{len(grid.seeds)} seeds, {run.task}, {run.total_steps} steps",
    alpha=st.alpha,
    margin=st.equivalence_margin,
  )


def tables(config, rows: list[dict]) -> list[str]:
  """`study.md`'s tables and its Pareto fronts (without the bandit) from a study's config and
  its CSV rows."""
  pareto = pareto_lines(pareto_runs(rows))
  return report_tables.tables(rows, **_table_options(config)) + (["", *pareto] if pareto else [])


def write_report(config, path: str, cells: Mapping) -> list[str]:
  """study.csv, study.md (the tables, the Pareto fronts, then the bandit) and the plots of
  the finished `cells`."""
  _, grid = study_grid.grid_from_config(config)
  # The grid's order, whatever order the cells finished in (the tables follow the rows).
  ordered = [cells[c] for c in grid.cells() if c in cells]
  ordered += [c for key, c in cells.items() if key not in grid.cells()]
  rows = [r for c in ordered for r in cell_rows(c, grid.eval_last)]
  csv_path = write_csv(os.path.join(path, "study.csv"), rows)
  st = StudySpec.from_config(config)
  kw = dict(steps=st.bandit_steps, group_size=st.bandit_group_size)
  results = bandit.run_bandit(grid.methods, grid.seeds, lr=st.bandit_lr, **kw)
  rows = read_csv(csv_path)  # what `experiments.plot --study_csv` redraws from
  lines = [*tables(config, rows), "", *bandit.table(results, seeds=len(grid.seeds), **kw)]
  md = os.path.join(path, "study.md")
  files.write_text_atomic(md, "\n".join(lines) + "\n")
  plots = plot_study(rows, path, baseline=grid.baseline)
  return [csv_path, md, *plots]
