"""A study's files: `study.csv` (one row per run and metric), `study.md` (tables), plots.

`study.md` reads the per-seed summaries with `study.stats`: intervals,
verdicts from Holm-corrected permutation tests, learning speed within a lag,
and the A/A calibration's measured false-verdict rate.

The CSV is the source of everything else: `write_tables` and `plot_study`
read rows, so `experiments.plot --study_csv=...` redraws the figures from it.
Rows are `method, lag, seed, metric, step, value`; summaries have an empty
`step`, curves (`eval_accuracy`, `train_reward`) one row per step.
"""

from __future__ import annotations

import collections
import csv
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from offpolicy_jax.study import bandit
from offpolicy_jax.study import runner as study
from offpolicy_jax.study import stats as study_stats

FIELDS = ("method", "lag", "seed", "metric", "step", "value")
CURVES = ("eval_accuracy", "train_reward")
MARK = {study_stats.WORSE: "worse", study_stats.BETTER: "better", study_stats.SAME: "~"}
# Marks of a difference in steps to the threshold (more steps: slower).
FASTER = {study_stats.WORSE: "faster", study_stats.BETTER: "slower", study_stats.SAME: "~"}


# Off-policy diagnostics tabulated when the runs recorded them (`study.runner.OFF_POLICY_METRICS`).
OFF_POLICY_TABLES = (
  "staleness_kl_k3",
  "mismatch_kl_k3",
  "clip_frac",
  "corr_token_masked_frac",
  "corr_seq_masked_frac",
)


def cell_rows(cell: Mapping[str, Any], eval_last: int) -> list[dict[str, Any]]:
  """The CSV rows of one cell record (`study.run_cell`)."""
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
    for metric, value in summary.items():
      rows.append({**base, "seed": run["seed"], "metric": metric, "step": "", "value": value})
    curves = {
      "eval_accuracy": zip(run["eval_steps"], run["eval_accuracy"], strict=True),
      "train_reward": enumerate(run["train_reward"], start=1),
    }
    for metric, points in curves.items():
      for step, value in points:
        rows.append({**base, "seed": run["seed"], "metric": metric, "step": step, "value": value})
  return rows


def write_csv(path: str, rows: Iterable[Mapping[str, Any]]) -> str:
  tmp = path + ".tmp"
  with open(tmp, "w", newline="") as f:
    w = csv.DictWriter(f, FIELDS)
    w.writeheader()
    w.writerows(rows)
  os.replace(tmp, path)
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


def _table(rows: list[dict]) -> tuple[list[str], list[str], dict]:
  """(methods, lags in order of appearance, {(method, lag, metric): {seed: value}}) of summaries."""
  methods, lags = [], []
  values: dict = collections.defaultdict(dict)
  for r in rows:
    methods += [r["method"]] if r["method"] not in methods else []
    lags += [r["lag"]] if r["lag"] not in lags else []
    if r["step"] in (None, ""):  # summaries (rows from `read_csv` or `cell_rows`)
      values[r["method"], r["lag"], r["metric"]][r["seed"]] = r["value"]
  return methods, lags, values


def _by_seed(d: Mapping[int, float], seeds: Sequence[int]) -> list[float]:
  return [d[s] for s in seeds]


def _md(header: Sequence[str], body: Iterable[Sequence[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(row) + " |" for row in body]


# Learning-speed summaries of a run (`study_stats.run_summary`), compared within a lag.
SPEED_METRICS = (
  ("steps_to_threshold", f"Steps to reach the warm start + {study_stats.LEARNING_GAIN:.2f}"),
  ("accuracy_auc", "Area under the held-out accuracy curve, divided by the steps"),
  ("final_accuracy", "Final greedy accuracy"),
)
# The metrics an A/A pair is tested on (the false-verdict rate counts all of them).
AA_METRICS = ("final_accuracy", "accuracy_auc", "steps_to_threshold")


def _signed(iv: study_stats.Interval, fmt: str = "+.3f") -> str:
  return f"{iv.mean:{fmt}} [{iv.low:{fmt}}, {iv.high:{fmt}}]"


def _final_accuracy_tests(values, main, lags, baseline, seeds, alpha):
  """{(method, lag): (Comparison, Holm-adjusted p, verdict)} against the baseline cell."""
  ref = _by_seed(values[baseline[0], baseline[1], "final_accuracy"], seeds)
  comps = {
    (m, g): study_stats.compare(_by_seed(values[m, g, "final_accuracy"], seeds), ref)
    for m in main
    for g in lags
    if values.get((m, g, "final_accuracy")) and (m, g) != tuple(baseline)
  }
  return {k: (comps[k], *v) for k, v in study_stats.verdicts(comps, alpha).items()}


def _power_note(n: int, m: int, alpha: float) -> str:
  """What n seeds allow among m Holm-corrected comparisons."""
  if not m:
    return "The grid has no comparison to test."
  floor = study_stats.smallest_p(n)
  note = (
    f"With {n} seeds the smallest attainable p-value is {floor:.2g}; Holm's first step over "
    f"{m} comparisons needs p <= {alpha / max(m, 1):.2g}."
  )
  if floor > alpha / max(m, 1):
    note += (
      f" **No verdict is attainable here**: that needs >= "
      f"{study_stats.needed_seeds(m, alpha)} seeds (`--config.study.seeds`)."
    )
  return note


def _speed_section(values, main, lags, baseline_method, seeds, alpha) -> list[str]:
  """Learning speed per cell and paired differences to the baseline method in the same lag."""
  lines = [
    "",
    "## Learning speed",
    "",
    "Per run: the first evaluated step at which held-out greedy accuracy reaches its warm "
    f"start + {study_stats.LEARNING_GAIN:.2f} (a run that never does is censored at the "
    "budget: it counts as the last evaluated step, so a mean with unreached runs is a lower "
    "bound; `k/n` counts the runs that reached it); the area under the held-out accuracy "
    "curve divided by the steps (the run's time-averaged accuracy); the final accuracy. Each "
    "cell: mean over seeds [95% bootstrap interval]. The differences compare with "
    f"**{baseline_method}** in the same lag on the same seeds: mean [95% paired bootstrap], "
    "the sign-flip permutation p-value, and the verdict from the Holm-adjusted p-values over "
    f"the table's comparisons at alpha = {alpha:g} (`faster` / `slower` for the steps).",
  ]
  for metric, title in SPEED_METRICS:
    if not any(values.get((m, g, metric)) for m in main for g in lags):
      continue
    steps = metric == "steps_to_threshold"
    fmt = "+.1f" if steps else "+.3f"

    def cell(m, g, metric=metric, steps=steps):
      got = values.get((m, g, metric))
      if not got:
        return "-"
      iv = study_stats.bootstrap(_by_seed(got, seeds))
      if not steps:
        return str(iv)
      reached = values.get((m, g, "threshold_reached"), {})
      k = int(sum(_by_seed(reached, seeds))) if reached else "?"
      return f"{iv.mean:.1f} [{iv.low:.1f}, {iv.high:.1f}] ({k}/{len(seeds)})"

    comps = {
      (m, g): study_stats.compare(
        _by_seed(values[m, g, metric], seeds), _by_seed(values[baseline_method, g, metric], seeds)
      )
      for m in main
      for g in lags
      if m != baseline_method
      and values.get((m, g, metric))
      and values.get((baseline_method, g, metric))
    }
    tested = study_stats.verdicts(comps, alpha)
    lines += ["", f"### {title}", ""]
    lines += _md(["method", *lags], [[m, *(cell(m, g) for g in lags)] for m in main])
    lines += ["", f"Paired difference to {baseline_method} in the same lag:", ""]

    marks = FASTER if steps else MARK  # fewer steps to the threshold is better

    def diff(m, g, comps=comps, tested=tested, fmt=fmt, marks=marks):
      if (m, g) not in comps:
        return "-"
      c = comps[m, g]
      return f"{_signed(c.diff, fmt)} p={c.p:.2g} {marks[tested[m, g][1]]}"

    body = [[m, *(diff(m, g) for g in lags)] for m in main if m != baseline_method]
    lines += _md(["method", *lags], body)
  return lines


def aa_tests(
  values, aa_methods, lags, seeds, alpha
) -> list[tuple[str, str, str, study_stats.Comparison, str]]:
  """(A/A method, lag, metric, Comparison, permutation verdict at alpha) of every A/A pair."""
  out = []
  for a in aa_methods:
    base = a[len(study.AA_PREFIX) :]
    for g in lags:
      for metric in AA_METRICS:
        x, y = values.get((a, g, metric)), values.get((base, g, metric))
        if not x or not y:
          continue
        c = study_stats.compare(_by_seed(x, seeds), _by_seed(y, seeds))
        out.append((a, g, metric, c, c.verdict(c.p, alpha)))
  return out


def _aa_section(tests, alpha) -> tuple[list[str], str]:
  """(the A/A section, its one-line false-verdict rate of final accuracy).

  The rates leave out pairs whose differences are all 0 (e.g. steps to the
  threshold when no run reached it): no test can call those different.
  """
  skipped = sum(t[3].diff.low == t[3].diff.high == 0 for t in tests)
  shown, tests = tests, [t for t in tests if not t[3].diff.low == t[3].diff.high == 0]
  final = [t for t in tests if t[2] == "final_accuracy"]
  perm = sum(t[4] != study_stats.SAME for t in final)
  boot = sum(t[3].bootstrap_verdict != study_stats.SAME for t in final)
  perm_all = sum(t[4] != study_stats.SAME for t in tests)
  boot_all = sum(t[3].bootstrap_verdict != study_stats.SAME for t in tests)

  def rate(k, n):
    return study_stats.rate(k, n) if n else "no informative pair"

  headline = (
    f"A/A false-verdict rate (final accuracy, permutation test at alpha = {alpha:g}): "
    f"{rate(perm, len(final))}; nominal {alpha:g}."
  )
  lines = [
    "",
    "## A/A calibration",
    "",
    "The baseline method run twice on the same warm starts and prompts with independent "
    "random streams (sampling, advantages, replay, training; `study.runner.AA_STREAM_OFFSET`): "
    "nothing differs but chance, so every `better`/`worse` here is a false verdict. Each pair "
    f"is tested alone (no Holm correction, which only lowers the rate) at alpha = {alpha:g} "
    "with the sign-flip permutation test, and by the bootstrap rule (95% interval excludes 0). "
    "Rates: false verdicts / comparisons with a 95% Clopper-Pearson interval.",
    "",
  ]
  rows = []
  for a, g, metric, c, verdict in shown:
    fmt = "+.1f" if metric == "steps_to_threshold" else "+.3f"
    rows.append(
      [a, g, metric, _signed(c.diff, fmt), f"{c.p:.3g}", MARK[verdict], MARK[c.bootstrap_verdict]]
    )
  lines += _md(
    ["A/A", "lag", "metric", "difference [95%]", "p", "verdict", "bootstrap verdict"], rows
  )
  lines += [
    "",
    f"- final accuracy, permutation test: {rate(perm, len(final))} (nominal {alpha:g})",
    f"- final accuracy, bootstrap rule: {rate(boot, len(final))} (nominal 0.05)",
    f"- all {len(AA_METRICS)} metrics pooled (correlated within a pair), permutation test: "
    f"{rate(perm_all, len(tests))}; bootstrap rule: {rate(boot_all, len(tests))}",
    f"- left out of the rates: {skipped} comparisons whose per-seed differences are all 0",
  ]
  return lines, headline


def write_tables(
  rows: list[dict],
  path: str,
  *,
  baseline: tuple[str, str],
  title: str,
  extra: Sequence[str] = (),
  alpha: float = 0.05,
) -> str:
  """`study.md`: accuracy with intervals and tested verdicts, learning speed, the A/A rate, ...

  Rows of methods named `study.runner.AA_PREFIX + method` are A/A twins: they
  are left out of the grid's tables and tested against their method instead.
  """
  methods, lags, values = _table(rows)
  main = [m for m in methods if not m.startswith(study.AA_PREFIX)]
  aa_methods = [m for m in methods if m.startswith(study.AA_PREFIX)]
  ref = values[baseline[0], baseline[1], "final_accuracy"]
  if not ref:
    raise ValueError(f"the baseline {baseline[0]}@{baseline[1]} has no finished runs")
  seeds = sorted(ref)
  pass_metric = next((m for (_, _, m) in values if m.startswith("pass@")), None)
  tests = _final_accuracy_tests(values, main, lags, baseline, seeds, alpha)
  acc_cells, diff_cells = {}, {}
  for m in main:
    for g in lags:
      got = values.get((m, g, "final_accuracy"))
      if not got:
        continue
      mark = MARK[tests[m, g][2]] if (m, g) in tests else "(baseline)"
      acc_cells[m, g] = f"{study_stats.bootstrap(_by_seed(got, seeds))} {mark}"
      if (m, g) in tests:
        diff_cells[m, g] = _signed(tests[m, g][0].diff)

  def grid_rows(fn):
    return [[m, *(fn(m, g) for g in lags)] for m in main]

  def summary(metric, fmt):
    def cell(m, g):
      got = values.get((m, g, metric))
      return fmt(_by_seed(got, seeds)) if got else "-"

    return cell

  start = study_stats.bootstrap(_by_seed(values[baseline[0], baseline[1], "start_accuracy"], seeds))
  start_sd = float(np.std(_by_seed(values[baseline[0], baseline[1], "start_accuracy"], seeds)))
  aa = aa_tests(values, aa_methods, lags, seeds, alpha)
  aa_lines, aa_headline = _aa_section(aa, alpha) if aa else ([], "")
  lines = [f"# {title}", ""]
  lines += [
    f"{len(seeds)} seeds per cell (seeds {seeds[0]}..{seeds[-1]}); the warm start's greedy "
    f"accuracy is {start} (standard deviation over seeds {start_sd:.3f}).",
    *(["", aa_headline] if aa_headline else []),
    "",
    "## Final greedy accuracy",
    "",
    "Mean over seeds of each run's final accuracy (the mean of its last evaluations), with a "
    "95% percentile bootstrap interval over seeds. The mark compares with the baseline "
    f"**{baseline[0]}@{baseline[1]}** on the same seeds: a paired sign-flip permutation test "
    f"of the mean per-seed difference, Holm-corrected over the {len(tests)} comparisons of "
    f"the grid, at alpha = {alpha:g}: `worse` / `better` when the adjusted p-value is <= "
    "alpha, `~` otherwise (read `~` as 'no evidence of a difference', not as equality). "
    + _power_note(len(seeds), len(tests), alpha),
    "",
  ]
  lines += _md(["method", *lags], grid_rows(lambda m, g: acc_cells.get((m, g), "-")))
  lines += ["", f"## Paired difference to {baseline[0]}@{baseline[1]}", ""]
  lines += _md(["method", *lags], grid_rows(lambda m, g: diff_cells.get((m, g), "-")))
  lines += [
    "",
    "## Tests against the baseline",
    "",
    "Each comparison of the final accuracy: the mean per-seed difference with its 95% paired "
    "bootstrap interval and the bootstrap rule's verdict (interval excludes 0; no known "
    "error rate), the two-sided sign-flip permutation p-value, its Holm-adjusted value over "
    f"the grid and the verdict at alpha = {alpha:g} (the mark of the tables above).",
    "",
  ]
  body = [
    [m, g, _signed(c.diff), MARK[c.bootstrap_verdict], f"{c.p:.3g}", f"{adj:.3g}", MARK[v]]
    for (m, g), (c, adj, v) in tests.items()
  ]
  lines += _md(["method", "lag", "difference [95%]", "bootstrap", "p", "Holm p", "verdict"], body)
  lines += _speed_section(values, main, lags, baseline[0], seeds, alpha)
  lines += aa_lines
  if pass_metric:
    lines += ["", f"## {pass_metric} at the end (sampled at the training temperature)", ""]
    lines += _md(
      ["method", *lags], grid_rows(summary(pass_metric, lambda x: str(study_stats.bootstrap(x))))
    )
  lines += ["", "## Mean training reward over the run (area under the training curve)", ""]
  lines += _md(
    ["method", *lags], grid_rows(summary("auc", lambda x: str(study_stats.bootstrap(x))))
  )
  lines += [
    "",
    "## Collapsed runs",
    "",
    "Runs whose last evaluations all fall more than "
    f"{study_stats.COLLAPSE_MARGIN} below their warm start, or with an update skipped as "
    "non-finite.",
    "",
  ]
  lines += _md(
    ["method", *lags], grid_rows(summary("collapsed", lambda x: f"{int(sum(x))}/{len(x)}"))
  )
  diagnostics = [k for k in OFF_POLICY_TABLES if any(key[2] == k for key in values)]
  if diagnostics:
    lines += [
      "",
      "## Off-policy diagnostics",
      "",
      "Per-step means over the run, then the mean over seeds (docs/off_policyness.md): the "
      "KL(mu || pi) estimate k3 of the staleness factor pi / pi_old and of the engine mismatch "
      "pi_old / mu (0 where pi_old is not scored), and the fraction of tokens the loss clipped "
      "or a rollout correction masked.",
    ]
    for metric in diagnostics:
      lines += ["", f"`{metric}`", ""]
      lines += _md(
        ["method", *lags], grid_rows(summary(metric, lambda x: f"{float(np.mean(x)):.3g}"))
      )
  lines += ["", *extra] if extra else []
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


def _curve(rows: list[dict], metric: str) -> dict[tuple[str, str], dict[int, dict[int, float]]]:
  """{(method, lag): {step: {seed: value}}} of one curve metric."""
  out: dict = collections.defaultdict(lambda: collections.defaultdict(dict))
  for r in rows:
    if r["metric"] == metric and r["step"] not in (None, ""):
      out[r["method"], r["lag"]][r["step"]][r["seed"]] = r["value"]
  return out


def plot_study(rows: list[dict], out_dir: str, *, baseline: tuple[str, str]) -> list[str]:
  """`curves_<lag>.png` (mean eval accuracy, 95% band, per method) and `final.png`."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods, lags, values = _table(rows)
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
      ivs = [study_stats.bootstrap(list(points[s].values())) for s in steps]
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
        iv = study_stats.bootstrap(list(got.values()))
        ax.errorbar(iv.mean, y, xerr=[[iv.mean - iv.low], [iv.high - iv.mean]], fmt="o", ms=3)
    if ref:
      ax.axvline(float(np.mean(list(ref.values()))), color="grey", ls="--", lw=0.8)
    ax.set(title=g, xlabel="final accuracy", yticks=range(len(methods)))
    ax.set_yticklabels(methods if ax is axes[0] else [], fontsize=7)
    ax.invert_yaxis()
  paths.append(os.path.join(out_dir, "final.png"))
  fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
  plt.close(fig)
  return paths


def write_report(config, path: str, cells: Mapping) -> list[str]:
  """study.csv, study.md (with the bandit) and the plots of the finished `cells`."""
  _, grid = study.grid_from_config(config)
  rows = [r for c in cells.values() for r in cell_rows(c, grid.eval_last)]
  csv_path = write_csv(os.path.join(path, "study.csv"), rows)
  st = config.study
  kw = dict(steps=st.bandit_steps, group_size=st.bandit_group_size)
  results = bandit.run_bandit(grid.methods, grid.seeds, lr=st.bandit_lr, **kw)
  extra = bandit.table(results, seeds=len(grid.seeds), **kw)
  rows = read_csv(csv_path)  # what `experiments.plot --study_csv` redraws from
  md = write_tables(
    rows,
    os.path.join(path, "study.md"),
    baseline=grid.baseline,
    title=f"Lag study: {len(grid.methods)} methods x {len(grid.lags)} lags x "
    f"{len(grid.seeds)} seeds, {config.task}, {config.total_steps} steps",
    extra=extra,
    alpha=st.alpha,
  )
  plots = plot_study(rows, path, baseline=grid.baseline)
  return [csv_path, md, *plots]
