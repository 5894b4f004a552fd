"""`study.md`: a study's tables, read from its CSV rows (`study.report`) with `study.stats`.

Accuracy with t intervals, Holm-corrected permutation verdicts and
equivalence verdicts (against a margin declared in the config) against a
baseline cell, learning speed within a lag, the A/A calibration's measured
false-verdict rate per metric, pass@k, training reward, collapsed runs and
the off-policy diagnostics.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from offpolicy_jax import metric_names
from offpolicy_jax.study import grid as study_grid
from offpolicy_jax.study import report_aa
from offpolicy_jax.study import stats as study_stats
from offpolicy_jax.study.report_md import FASTER, MARK
from offpolicy_jax.study.report_md import by_seed as _by_seed
from offpolicy_jax.study.report_md import md as _md
from offpolicy_jax.study.report_md import signed as _signed

# Per-run counts of sandboxed rewards scored 0 after a timeout, error or crash (`study.cell`).
REWARD_FAILURES = ("eval_reward_failures", "train_reward_failures")
# What a run spent (`study.cell._costs`; to the threshold: `study.report.cell_rows`).
COST_TABLES = ("sampled_tokens", "trained_tokens", "train_wall_s", "tokens_to_threshold")


def summary_table(rows: list[dict]) -> tuple[list[str], list[str], dict]:
  """(methods, lags in order of appearance, {(method, lag, metric): {seed: value}}) of summaries."""
  methods, lags = [], []
  values: dict = collections.defaultdict(dict)
  for r in rows:
    methods += [r["method"]] if r["method"] not in methods else []
    lags += [r["lag"]] if r["lag"] not in lags else []
    if r["step"] in (None, ""):  # summaries (rows from `read_csv` or `cell_rows`)
      values[r["method"], r["lag"], r["metric"]][r["seed"]] = r["value"]
  return methods, lags, values


def _metric_tables(
  title: str, intro: str, metrics: Sequence[str], table: Callable[[str], list[str]]
) -> list[str]:
  """A section of one table per metric (`table(metric)`), or nothing without metrics."""
  if not metrics:
    return []
  lines = ["", f"## {title}", "", intro]
  for metric in metrics:
    lines += ["", f"`{metric}`", "", *table(metric)]
  return lines


# What a run spent until it first reached the threshold (fewer is faster). Not seconds: the
# seeds of a vmapped program share one timing (and its compilation), so a paired test of
# them would count one measurement S times.
_TO_THRESHOLD = ("steps_to_threshold", "tokens_to_threshold")
# Learning-speed summaries of a run (`study_stats.run_summary`), compared within a lag.
SPEED_METRICS = (
  ("steps_to_threshold", f"Steps to reach the warm start + {study_stats.LEARNING_GAIN:.2f}"),
  ("tokens_to_threshold", "Sampled tokens to reach it (censored like the steps)"),
  ("accuracy_auc", "Area under the held-out accuracy curve, divided by the steps"),
  ("final_accuracy", "Final greedy accuracy"),
)


def _final_accuracy_tests(values, main, lags, baseline, seeds, alpha, margin):
  """{(method, lag): (Comparison, Holm-adjusted p, verdict)} against the baseline cell."""
  ref = _by_seed(values[baseline[0], baseline[1], "final_accuracy"], seeds)
  comps = {
    (m, g): study_stats.compare(_by_seed(values[m, g, "final_accuracy"], seeds), ref, margin=margin)
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
      f" **No `better`/`worse` verdict is attainable here**: that needs >= "
      f"{study_stats.needed_seeds(m, alpha)} seeds (`--config.study.seeds`)."
    )
  return note


def _speed_section(
  values, main, lags, baseline_method, seeds, alpha, margin, unfounded=None
) -> list[str]:
  unfounded = unfounded or {}
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
    "cell: mean over seeds [95% t interval]. The differences compare with "
    f"**{baseline_method}** in the same lag on the same seeds: mean [95% paired t interval], "
    "the sign-flip permutation p-value, and the verdict from the Holm-adjusted p-values over "
    f"the table's comparisons at alpha = {alpha:g} (`faster` / `slower` for the steps)"
    + (
      f"; for the accuracy metrics `≈` marks a difference shown to lie within +-{margin:g} "
      "(two one-sided t tests, Holm-adjusted)."
      if margin
      else "."
    ),
  ]
  for metric, title in SPEED_METRICS:
    if not any(values.get((m, g, metric)) for m in main for g in lags):
      continue
    steps = metric in _TO_THRESHOLD  # fewer is faster
    fmt = "+.4g" if metric == "tokens_to_threshold" else "+.1f" if steps else "+.3f"

    def cell(m, g, metric=metric, steps=steps):
      got = values.get((m, g, metric))
      if not got:
        return "-"
      iv = study_stats.interval(_by_seed(got, seeds))
      if not steps:
        return str(iv)
      reached = values.get((m, g, "threshold_reached"), {})
      k = int(sum(_by_seed(reached, seeds))) if reached else "?"
      f = ".4g" if metric == "tokens_to_threshold" else ".1f"
      return f"{iv.mean:{f}} [{iv.low:{f}}, {iv.high:{f}}] ({k}/{len(seeds)})"

    comps = {
      (m, g): study_stats.compare(
        _by_seed(values[m, g, metric], seeds),
        _by_seed(values[baseline_method, g, metric], seeds),
        margin=None if steps else margin,
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

    def diff(m, g, comps=comps, tested=tested, fmt=fmt, marks=marks, metric=metric):
      if (m, g) not in comps:
        return "-"
      c, v = comps[m, g], tested[m, g][1]
      return (
        f"{_signed(c.diff, fmt)} p={c.p:.2g} {report_aa.marked(marks[v], v, metric, unfounded)}"
      )

    body = [[m, *(diff(m, g) for g in lags)] for m in main if m != baseline_method]
    lines += _md(["method", *lags], body)
    lines += report_aa.unfounded_note(unfounded, [metric], alpha)
  return lines


def write_tables(
  rows: list[dict],
  path: str,
  *,
  baseline: tuple[str, str],
  title: str,
  extra: Sequence[str] = (),
  alpha: float = 0.05,
  margin: float = 0.0,
) -> str:
  """Writes `tables(...)`, then the `extra` lines, to `path` (`study.md`); returns `path`."""
  lines = tables(rows, baseline=baseline, title=title, alpha=alpha, margin=margin)
  lines += ["", *extra] if extra else []
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


def tables(
  rows: list[dict],
  *,
  baseline: tuple[str, str],
  title: str,
  alpha: float = 0.05,
  margin: float = 0.0,
) -> list[str]:
  """`study.md`'s lines: accuracy with intervals and verdicts, learning speed, the A/A rate, ...

  Everything here is computed from the CSV rows alone (a committed study's
  tables are rebuilt from its `study.csv`). Rows of methods named
  `study.grid.AA_PREFIX + method` are A/A twins: they are left out of the
  grid's tables and tested against their method instead. `margin` > 0 adds
  equivalence verdicts (`≈`) for differences in accuracy.
  """
  methods, lags, values = summary_table(rows)
  main = [m for m in methods if not m.startswith(study_grid.AA_PREFIX)]
  aa_methods = [m for m in methods if m.startswith(study_grid.AA_PREFIX)]
  ref = values[baseline[0], baseline[1], "final_accuracy"]
  if not ref:
    raise ValueError(f"the baseline {baseline[0]}@{baseline[1]} has no finished runs")
  seeds = sorted(ref)
  margin_or_none = margin if margin > 0 else None
  tests = _final_accuracy_tests(values, main, lags, baseline, seeds, alpha, margin_or_none)
  aa = report_aa.aa_tests(values, aa_methods, lags, seeds, alpha)
  aa_lines, aa_headline = report_aa.aa_section(aa, alpha) if aa else ([], "")
  unfounded = report_aa.not_findings(aa, alpha)  # metrics whose A/A rate exceeds alpha
  levels = (alpha, margin_or_none)
  lines = _accuracy_sections(
    values, main, lags, baseline, seeds, tests, levels, title, aa_headline, unfounded
  )
  lines += _speed_section(values, main, lags, baseline[0], seeds, alpha, margin_or_none, unfounded)
  lines += aa_lines
  lines += _run_sections(values, main, lags, seeds)
  return lines


def _grid(main, lags, fn) -> list[list[str]]:
  """Table rows: one per method, `fn(method, lag)` per lag."""
  return [[m, *(fn(m, g) for g in lags)] for m in main]


def _summary(values, seeds, metric, fmt):
  """The cell function of a summary metric: `fmt(per-seed values)`, "-" where none."""

  def cell(m, g):
    got = values.get((m, g, metric))
    return fmt(_by_seed(got, seeds)) if got else "-"

  return cell


def _accuracy_sections(
  values, main, lags, baseline, seeds, tests, levels, title, aa_headline, unfounded
):
  """The title, final accuracy, its paired differences and the tests against the baseline;
  `unfounded`: the metrics that report no findings (`report_aa.not_findings`)."""
  alpha, margin = levels
  mark = lambda v: report_aa.marked(MARK[v], v, "final_accuracy", unfounded)
  note = report_aa.unfounded_note(unfounded, ["final_accuracy"], alpha)
  acc_cells, diff_cells = {}, {}
  for m in main:
    for g in lags:
      got = values.get((m, g, "final_accuracy"))
      if not got:
        continue
      cell_mark = mark(tests[m, g][2]) if (m, g) in tests else "(baseline)"
      acc_cells[m, g] = f"{study_stats.interval(_by_seed(got, seeds))} {cell_mark}"
      if (m, g) in tests:
        diff_cells[m, g] = _signed(tests[m, g][0].diff)
  start = study_stats.interval(_by_seed(values[baseline[0], baseline[1], "start_accuracy"], seeds))
  start_sd = float(np.std(_by_seed(values[baseline[0], baseline[1], "start_accuracy"], seeds)))
  same = sum(v[2] == study_stats.IDENTICAL for v in tests.values())
  tested = len(tests) - same  # identical runs are left out of Holm's count
  identical = (
    f"`=` when every per-seed difference is exactly 0 ({same} of the {len(tests)}: no test, "
    "left out of the count); "
    if same
    else ""
  )
  lines = [f"# {title}", ""]
  lines += [
    f"{len(seeds)} seeds per cell (seeds {seeds[0]}..{seeds[-1]}); the warm start's greedy "
    f"accuracy is {start} (standard deviation over seeds {start_sd:.3f}).",
    *(["", aa_headline] if aa_headline else []),
    "",
    "## Final greedy accuracy",
    "",
    "Mean over seeds of each run's final accuracy (the mean of its last evaluations), with a "
    "95% t interval over seeds. The mark compares with the baseline "
    f"**{baseline[0]}@{baseline[1]}** on the same seeds: a paired sign-flip permutation test "
    f"of the mean per-seed difference, Holm-corrected over the {tested} comparisons of "
    f"the grid, at alpha = {alpha:g}: `worse` / `better` when the adjusted p-value is <= "
    "alpha; "
    + identical
    + (
      f"otherwise `≈` (equivalent within +-{margin:g}, the margin declared in the config) "
      "when two one-sided t tests, Holm-corrected over the grid, show the mean difference "
      f"inside (-{margin:g}, +{margin:g}) at alpha; `~` when neither is shown "
      "(not shown either way). "
      if margin
      else "`~` otherwise (read `~` as 'no evidence of a difference', not as equality). "
    )
    + _power_note(len(seeds), tested, alpha),
    "",
  ]
  lines += _md(["method", *lags], _grid(main, lags, lambda m, g: acc_cells.get((m, g), "-")))
  lines += note
  lines += ["", f"## Paired difference to {baseline[0]}@{baseline[1]}", ""]
  lines += _md(["method", *lags], _grid(main, lags, lambda m, g: diff_cells.get((m, g), "-")))
  lines += [
    "",
    "## Tests against the baseline",
    "",
    "Each comparison of the final accuracy: the mean per-seed difference with its 95% paired "
    "t interval and the interval rule's verdict (interval excludes 0: a paired t test), the "
    "two-sided sign-flip permutation p-value, its Holm-adjusted value over the grid, the "
    "equivalence test's p-value (two one-sided t tests against the margin, before Holm) and "
    f"the verdict at alpha = {alpha:g} (the mark of the tables above).",
    "",
  ]
  body = [
    [
      m,
      g,
      _signed(c.diff),
      MARK[c.interval_verdict],
      f"{c.p:.3g}",
      f"{adj:.3g}",
      "-" if c.p_equivalent is None else f"{c.p_equivalent:.3g}",
      mark(v),
    ]
    for (m, g), (c, adj, v) in tests.items()
  ]
  header = ["method", "lag", "difference [95%]", "interval rule", "p", "Holm p", "TOST p"]
  lines += _md([*header, "verdict"], body)
  return lines + note


def _run_sections(values, main, lags, seeds) -> list[str]:
  """pass@k, the training reward, collapsed runs and the off-policy diagnostics."""
  grid = lambda metric, fmt: _grid(main, lags, _summary(values, seeds, metric, fmt))
  interval = lambda x: str(study_stats.interval(x))
  lines: list[str] = []
  pass_metric = next((m for (_, _, m) in values if m.startswith("pass@")), None)
  if pass_metric:
    lines += ["", f"## {pass_metric} at the end (sampled at the training temperature)", ""]
    lines += _md(["method", *lags], grid(pass_metric, interval))
  lines += ["", "## Mean training reward over the run (area under the training curve)", ""]
  lines += _md(["method", *lags], grid("auc", interval))
  lines += [
    "",
    "## Collapsed runs",
    "",
    "Runs whose last evaluations all fall more than "
    f"{study_stats.COLLAPSE_MARGIN} below their warm start, or with an update skipped as "
    "non-finite.",
    "",
  ]
  lines += _md(["method", *lags], grid("collapsed", lambda x: f"{int(sum(x))}/{len(x)}"))
  present = lambda k: any(key[2] == k and any(v.values()) for key, v in values.items())
  lines += _metric_tables(
    "Reward failures",
    "Sandboxed rewards that timed out, raised or crashed and were scored 0, summed over the "
    "seeds (evaluations: every held-out answer of every evaluation; training: every "
    "response). On a loaded machine a timeout turns a correct answer into 0: a cell with "
    "failures measured the machine too; rerun it (delete its cell file) on an idle one.",
    [k for k in REWARD_FAILURES if present(k)],
    lambda metric: _md(["method", *lags], grid(metric, lambda x: f"{int(sum(x))}")),
  )
  diagnostics = [k for k in metric_names.study_metrics(True) if any(key[2] == k for key in values)]
  routing = (
    " With experts and the sampler's routing recorded: the share of tokens whose experts "
    "under the learner's own router are the recorded ones (docs/models.md)."
    if "moe/router_agreement" in diagnostics
    else ""
  )
  lines += _metric_tables(
    "Off-policy diagnostics",
    "Per-step means over the run, then the mean over seeds (docs/off_policyness.md): the "
    "KL(mu || pi) estimate k3 of the staleness factor pi / pi_old and of the engine mismatch "
    "pi_old / mu (0 where pi_old is not scored), and the fraction of tokens the loss clipped "
    "or a rollout correction masked." + routing,
    diagnostics,
    lambda metric: _md(["method", *lags], grid(metric, lambda x: f"{float(np.mean(x)):.3g}")),
  )
  lines += _critic_section(values, main, lags, seeds)
  lines += _ope_section(values, main, lags, seeds)
  lines += _metric_tables(
    "Cost per run",
    "Mean over seeds of a run's sampled and trained tokens, training seconds (a vmapped "
    "program's / S), and sampled tokens when it first reached the threshold of steps to "
    "threshold (censored at the budget: a lower bound); docs/lag_and_study.md.",
    [k for k in COST_TABLES if any(key[2] == k for key in values)],
    lambda metric: _md(["method", *lags], grid(metric, lambda x: f"{float(np.mean(x)):.4g}")),
  )
  return lines


def _critic_section(values, main, lags, seeds) -> list[str]:
  """A critic's explained variance per cell (`learn.critic`), when the runs have one."""
  var = lambda m, g, k: values.get((m, g, f"critic/{k}")) or {}

  def cell(m, g):
    returns, errors = var(m, g, "return_var"), var(m, g, "error_var")
    if not returns:
      return "-"
    ev = [1.0 - errors[s] / returns[s] for s in seeds if s in returns and returns[s] > 0]
    return str(study_stats.interval(ev)) if ev else "-"

  if not any(key[2] == "critic/return_var" for key in values):
    return []
  return [
    "",
    "## Critic: explained variance",
    "",
    "Per run, 1 - mean Var(R - V) / mean Var(R) over its steps (the value targets R and the "
    "critic's values V on each step's valid tokens, `learn.critic`), then the mean over seeds "
    "with its 95% t interval; '-': no critic (or returns that never varied).",
    "",
    *_md(["method", *lags], _grid(main, lags, cell)),
  ]


def _ope_section(values, main, lags, seeds) -> list[str]:
  """Off-policy evaluation from the buffers against the truth, by lag (`config.study.ope`)."""
  names = sorted(
    {
      k[2].removeprefix("ope_").removesuffix("_coverage")
      for k in values
      if k[2].startswith("ope_") and k[2].endswith("_coverage")
    }
  )
  if not names:
    return []
  grid = lambda metric, fmt: _grid(main, lags, _summary(values, seeds, metric, fmt))
  lines = [
    "",
    "## Off-policy evaluation from the replay buffer",
    "",
    "At every evaluation each seed's buffer estimates the current policy's expected reward "
    "(docs/ope.md), against the truth: the mean reward of fresh samples at the training "
    "temperature on prompts of the training split, the buffer's own. Mean |estimate - truth| "
    "over a run's evaluations, then the mean over "
    "seeds with its 95% t interval; coverage: the share of evaluations whose 95% interval held "
    "the truth, over every seed. `behavior`: the stored rows' own mean reward, no correction.",
  ]
  interval = lambda x: str(study_stats.interval(x))
  share = lambda x: f"{float(np.mean(x)):.0%}"
  for name in [*names, "behavior"]:
    lines += ["", f"### `{name}`: mean absolute error", ""]
    lines += _md(["method", *lags], grid(f"ope_{name}_abs_error", interval))
    if name != "behavior":
      lines += ["", f"### `{name}`: interval coverage", ""]
      lines += _md(["method", *lags], grid(f"ope_{name}_coverage", share))
  return lines
