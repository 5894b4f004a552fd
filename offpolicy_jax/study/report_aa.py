"""A study's A/A calibration: the baseline run twice, tested as a method against itself."""

from __future__ import annotations

from offpolicy_jax.study import grid as study_grid
from offpolicy_jax.study import stats as study_stats
from offpolicy_jax.study.report_md import MARK
from offpolicy_jax.study.report_md import by_seed as _by_seed
from offpolicy_jax.study.report_md import md as _md
from offpolicy_jax.study.report_md import signed as _signed

# The metrics an A/A pair is tested on (a false-verdict rate per metric).
AA_METRICS = ("final_accuracy", "accuracy_auc", "steps_to_threshold")


def aa_tests(
  values, aa_methods, lags, seeds, alpha
) -> list[tuple[str, str, str, study_stats.Comparison, str]]:
  """(A/A method, lag, metric, Comparison, permutation verdict at alpha) of every A/A pair."""
  out = []
  for a in aa_methods:
    base = a[len(study_grid.AA_PREFIX) :]
    for g in lags:
      for metric in AA_METRICS:
        x, y = values.get((a, g, metric)), values.get((base, g, metric))
        if not x or not y:
          continue
        c = study_stats.compare(_by_seed(x, seeds), _by_seed(y, seeds))
        out.append((a, g, metric, c, c.verdict(c.p, alpha)))
  return out


def not_findings(tests, alpha) -> dict[str, str]:
  """{metric: its A/A false-verdict rate} of the metrics whose rate exceeds alpha.

  The rate is the permutation test's, over the informative pairs (not all
  ties); a metric whose A/A pairs call chance a difference more often than
  alpha cannot support a `better`/`worse` (or `faster`/`slower`) verdict, so
  the tables mark its verdicts as not findings (`NOT_A_FINDING`).
  """
  out = {}
  for metric in AA_METRICS:
    of = [t for t in tests if t[2] == metric and not t[3].diff.low == t[3].diff.high == 0]
    k = sum(t[4] != study_stats.SAME for t in of)
    if of and k / len(of) > alpha:
      out[metric] = study_stats.rate(k, len(of))
  return out


# The mark beside a verdict on a metric of `not_findings`.
NOT_A_FINDING = "†"


def marked(mark: str, verdict: str, metric: str, unfounded: dict[str, str]) -> str:
  """`mark`, flagged `NOT_A_FINDING` when it is a difference on a metric of `unfounded`."""
  differs = verdict in (study_stats.BETTER, study_stats.WORSE)
  return mark + NOT_A_FINDING if differs and metric in unfounded else mark


def unfounded_note(unfounded: dict[str, str], metrics, alpha) -> list[str]:
  """The sentence under a table whose `metrics` include ones of `unfounded`."""
  named = [m for m in metrics if m in unfounded]
  if not named:
    return []
  rates = "; ".join(f"{m}: {unfounded[m]}" for m in named)
  return [
    "",
    f"{NOT_A_FINDING} not reported as a finding: the A/A calibration's false-verdict rate of "
    f"this metric exceeds alpha = {alpha:g} ({rates}), so its verdicts may be chance.",
  ]


def aa_section(tests, alpha) -> tuple[list[str], str]:
  """(the A/A section, its one-line false-verdict rate of final accuracy).

  Rates are per metric, never pooled (a pair's metrics are correlated, and
  one of them, the steps to the threshold, is often all ties). They leave out
  pairs whose differences are all 0 (e.g. steps to the threshold when no run
  reached it): no test can call those different.
  """
  skipped = sum(t[3].diff.low == t[3].diff.high == 0 for t in tests)
  shown, tests = tests, [t for t in tests if not t[3].diff.low == t[3].diff.high == 0]

  def rate(k, n):
    return study_stats.rate(k, n) if n else "no informative pair"

  def rates(metric):
    of = [t for t in tests if t[2] == metric]
    perm = sum(t[4] != study_stats.SAME for t in of)
    rule = sum(t[3].interval_verdict != study_stats.SAME for t in of)
    return rate(perm, len(of)), rate(rule, len(of))

  headline = (
    f"A/A false-verdict rate (final accuracy, permutation test at alpha = {alpha:g}): "
    f"{rates('final_accuracy')[0]}; nominal {alpha:g}."
  )
  lines = [
    "",
    "## A/A calibration",
    "",
    "The baseline method run twice on the same warm starts and prompts with independent "
    "random streams (sampling, advantages, replay, training; `study.grid.AA_STREAM_OFFSET`): "
    "nothing differs but chance, so every `better`/`worse` here is a false verdict. Each pair "
    f"is tested alone (no Holm correction, which only lowers the rate) at alpha = {alpha:g} "
    "with the sign-flip permutation test, and by the interval rule (the 95% paired t "
    "interval excludes 0). Rates per metric: false verdicts / comparisons with a 95% "
    "Clopper-Pearson interval.",
    "",
  ]
  rows = []
  for a, g, metric, c, verdict in shown:
    fmt = "+.1f" if metric == "steps_to_threshold" else "+.3f"
    rows.append(
      [a, g, metric, _signed(c.diff, fmt), f"{c.p:.3g}", MARK[verdict], MARK[c.interval_verdict]]
    )
  lines += _md(["A/A", "lag", "metric", "difference [95%]", "p", "verdict", "interval rule"], rows)
  lines += [""]
  for metric in AA_METRICS:
    perm, rule = rates(metric)
    lines += [
      f"- {metric}: permutation test {perm} (nominal {alpha:g}); interval rule {rule} "
      "(nominal 0.05)"
    ]
  lines += [f"- left out of the rates: {skipped} comparisons whose per-seed differences are all 0"]
  unfounded = not_findings(tests, alpha)
  if unfounded:
    lines += [
      f"- above alpha, so their verdicts are not reported as findings ({NOT_A_FINDING} in the "
      f"tables): {', '.join(unfounded)}"
    ]
  return lines, headline
