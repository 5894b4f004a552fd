"""Statistics of a seeded study: run summaries, intervals, tests with a known error rate.

A study's runs are paired: runs with the same seed share the warm start and
the prompt stream, so the seed-to-seed spread of the warm start cancels in
per-seed differences d_i = method_i - baseline_i. Three instruments read them:

- a **Student t interval** (`t_interval`) of a mean or of the mean paired
  difference, the interval the tables print (`interval`). Its coverage is
  exact for normal values and close for the skewed and heavy-tailed ones
  simulated in `benchmarks/study_coverage.py` (docs/results/lag_study.md);
  the percentile bootstrap (`bootstrap`) it replaced under-covers with few
  seeds (about 0.91 at 12 seeds where 0.95 is nominal);
- a **paired sign-flip permutation test** (`sign_flip_pvalue`): under "no
  difference" every d_i is as likely to be -d_i, so the two-sided p-value is
  the fraction of the 2^n sign patterns whose |mean| reaches the observed one
  (exact up to `EXACT_MAX_SEEDS` seeds, Monte Carlo with a fixed key above).
  Its false-positive rate is at most alpha when the signs of d are exchangeable
  under the null (as for an A/A pair); strong skew breaks that
  (docs/results/lag_study.md, the coverage simulation);
- an **equivalence test** against a margin declared in advance
  (`equivalence_pvalue`, two one-sided t tests, Schuirmann 1987): a small p
  says the mean difference lies within (-margin, +margin). "No evidence of a
  difference" (a large p of the first test) is not evidence of equivalence.

A grid makes many comparisons at once; **Holm's step-down correction**
(`holm`) keeps the probability of any false `better`/`worse` among them at
most alpha, and separately of any false `equivalent`. Verdicts (`verdicts`)
come from the Holm-adjusted p-values. With n
seeds the smallest two-sided p-value is 2 / 2^n (n = 5: 0.0625, never below
0.05), and Holm needs the smallest of m p-values below alpha / m: a grid of m
comparisons can only give a `better`/`worse` verdict when 2 / 2^n <= alpha / m
(`smallest_p`); the equivalence verdicts come from t tests, which have no
such floor. The study's A/A calibration (`study.grid`) measures the
false-verdict rate these tests give when nothing differs.

Learning speed per run (`run_summary`): the first evaluated step at which
held-out accuracy reaches the warm start + `LEARNING_GAIN` (censored at the
budget), the area under the accuracy curve divided by the steps, the final
accuracy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import scipy.stats

# Resamples of every bootstrap (fixed generator: the tables are reproducible).
BOOTSTRAP_RESAMPLES = 10_000
# The sign-flip test enumerates all 2^n sign patterns up to this many seeds, else samples.
EXACT_MAX_SEEDS = 16
# Sign patterns the Monte Carlo sign-flip test draws (with the fixed generator `seed`).
PERMUTATION_RESAMPLES = 100_000
# A run has collapsed when its last evaluations all sit this far below its warm start.
COLLAPSE_MARGIN = 0.05
# A run has "learned" at the first evaluation at least this far above its warm start.
LEARNING_GAIN = 0.10
# Slack of float comparisons of accuracies (fractions of a few hundred prompts).
_EPS = 1e-9

K = TypeVar("K", bound=Hashable)
_Floats = Sequence[float] | np.ndarray

WORSE, SAME, BETTER = "worse", "indistinguishable", "better"
EQUIVALENT = "equivalent"
# Every per-seed difference exactly 0 (e.g. two methods whose updates coincide on-policy):
# no test is informative, and such a comparison does not count in Holm's m.
IDENTICAL = "identical"


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean and its interval over seeds (95% unless asked otherwise)."""

  mean: float
  low: float
  high: float
  n: int

  def contains(self, x: float) -> bool:
    return self.low <= x <= self.high

  def __str__(self) -> str:
    return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _sample(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
  x = np.asarray(values, np.float64)
  if x.ndim != 1 or x.size == 0:
    raise ValueError(f"{what} needs a non-empty 1-D sample, got shape {x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"{what}: non-finite values in {x.tolist()}")
  return x


def bootstrap(
  values: Sequence[float] | np.ndarray, *, seed: int = 0, level: float = 0.95
) -> Interval:
  """Mean of `values` with a percentile bootstrap interval (resampling the values)."""
  x = _sample(values, "bootstrap")
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, x.size, size=(BOOTSTRAP_RESAMPLES, x.size))].mean(axis=1)
  tail = 100 * (1 - level) / 2
  low, high = np.percentile(means, [tail, 100 - tail])
  # The percentile interval of a mean always contains it unless every resample
  # rounds away from it; clamp the float noise so `contains(mean)` holds.
  mean = float(x.mean())
  return Interval(mean, min(float(low), mean), max(float(high), mean), int(x.size))


def t_interval(values: Sequence[float] | np.ndarray, *, level: float = 0.95) -> Interval:
  """Mean of `values` with its Student t interval: mean +- t_{n-1} * sd / sqrt(n).

  One value has no spread to estimate: its interval is (nan, nan). Equal
  values give the point interval.
  """
  x = _sample(values, "t_interval")
  mean = float(x.mean())
  if x.size < 2:
    return Interval(mean, math.nan, math.nan, 1)
  half = float(scipy.stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
  return Interval(mean, mean - half, mean + half, int(x.size))


# The interval the study's tables and plots print.
interval = t_interval


def equivalence_pvalue(diff: Sequence[float] | np.ndarray, margin: float) -> float:
  """p-value of two one-sided t tests that the mean of `diff` lies in (-margin, +margin).

  p = max(P[T >= (mean + margin) / se], P[T <= (mean - margin) / se]) with T
  Student's t with n - 1 degrees of freedom and se = sd / sqrt(n); p <= alpha
  exactly when the (1 - 2 alpha) t interval lies inside the margin. With no
  spread (every difference equal, n >= 2) p is 0 inside the margin and 1
  outside; one difference shows nothing (p = 1).
  """
  d = _sample(diff, "equivalence_pvalue")
  if not margin > 0:
    raise ValueError(f"equivalence margin must be > 0, got {margin!r}")
  mean, n = float(d.mean()), d.size
  if n < 2:
    return 1.0
  se = float(d.std(ddof=1)) / math.sqrt(n)
  if se < _EPS:
    return 0.0 if abs(mean) < margin else 1.0
  lower = float(scipy.stats.t.sf((mean + margin) / se, n - 1))
  upper = float(scipy.stats.t.cdf((mean - margin) / se, n - 1))
  return max(lower, upper)


def sign_flip_pvalue(
  diff: Sequence[float] | np.ndarray,
  *,
  exact_max: int = EXACT_MAX_SEEDS,
  resamples: int = PERMUTATION_RESAMPLES,
  seed: int = 0,
) -> float:
  """Two-sided p-value of the paired sign-flip permutation test of mean(diff) = 0.

  p = #{s in S : |sum_i s_i d_i| >= |sum_i d_i|} / |S|, where S is every sign
  pattern s in {-1, +1}^n when n <= `exact_max` (the identity included, so
  p >= 2 / 2^n), else `resamples` random patterns plus the identity,
  p = (1 + hits) / (1 + resamples), drawn with the fixed generator `seed`.
  All-zero differences give p = 1. Example: n = 5 differences of one sign
  reach |sum| only with all signs kept or all flipped, p = 2 / 32.
  """
  d = _sample(diff, "sign_flip_pvalue")
  n = d.size
  observed = abs(d.sum())
  tol = _EPS * max(1.0, float(np.abs(d).sum()))
  if n <= exact_max:
    bits = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
    sums = (1 - 2 * bits) @ d
    return float(np.mean(np.abs(sums) >= observed - tol))
  rng = np.random.default_rng(seed)
  hits, left = 0, resamples
  while left:
    chunk = min(left, max(1, 2**22 // n))
    signs = rng.choice(np.array([-1.0, 1.0]), size=(chunk, n))
    hits += int(np.sum(np.abs(signs @ d) >= observed - tol))
    left -= chunk
  return (1 + hits) / (1 + resamples)


def smallest_p(n: int, *, exact_max: int = EXACT_MAX_SEEDS, resamples=PERMUTATION_RESAMPLES):
  """The smallest p-value `sign_flip_pvalue` can return for n seeds."""
  return 2 / 2**n if n <= exact_max else 1 / (1 + resamples)


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
  """Holm's step-down adjusted p-values, in the order given.

  With p_(1) <= ... <= p_(m) sorted, adjusted p_(k) = max_{j <= k} min(1,
  (m - j + 1) p_(j)); rejecting every adjusted p <= alpha keeps the
  family-wise error rate at most alpha (Holm 1979, "A simple sequentially
  rejective multiple test procedure"). Ties keep their order.
  """
  p = np.asarray(pvalues, np.float64)
  if p.ndim != 1 or np.any(~np.isfinite(p)) or np.any((p < 0) | (p > 1)):
    raise ValueError(f"holm needs p-values in [0, 1], got {p.tolist()}")
  m = p.size
  order = np.argsort(p, kind="stable")
  scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
  out = np.empty(m)
  out[order] = np.maximum.accumulate(scaled)
  return out


@dataclasses.dataclass(frozen=True)
class Comparison:
  """A paired comparison: the t interval of the mean difference and the tests.

  `p_equivalent` is the equivalence test's p-value against the margin the
  comparison was made with (None without one).
  """

  diff: Interval
  p: float  # two-sided sign-flip permutation p-value
  interval_verdict: str  # `worse`/`better` when the 95% t interval excludes 0
  p_equivalent: float | None = None

  def verdict(self, p_adjusted: float, alpha: float) -> str:
    """`better`/`worse` (by the sign of the mean difference) when p_adjusted <= alpha."""
    if p_adjusted > alpha or self.diff.mean == 0:
      return SAME
    return BETTER if self.diff.mean > 0 else WORSE


def compare(
  method: Sequence[float], baseline: Sequence[float], *, margin: float | None = None
) -> Comparison:
  """The paired comparison method - baseline over the same seeds (in the same order)."""
  a, b = np.asarray(method, np.float64), np.asarray(baseline, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"paired comparison needs the same seeds: {a.shape} vs {b.shape}")
  diff = interval(a - b)
  rule = WORSE if diff.high < 0 else BETTER if diff.low > 0 else SAME
  p_eq = None if margin is None else equivalence_pvalue(a - b, margin)
  return Comparison(diff, sign_flip_pvalue(a - b), rule, p_eq)


def paired_verdict(method: Sequence[float], baseline: Sequence[float]) -> tuple[Interval, str]:
  """(t interval of the mean per-seed difference method - baseline, its interval verdict)."""
  c = compare(method, baseline)
  return c.diff, c.interval_verdict


def verdicts(comparisons: Mapping[K, Comparison], alpha: float) -> dict[K, tuple[float, str]]:
  """{key: (Holm-adjusted p over the `comparisons` tested, verdict at `alpha`)}.

  The verdict is `better`/`worse` from the Holm-adjusted permutation p-values;
  otherwise, for comparisons made with a margin, `equivalent` when the
  Holm-adjusted (over those comparisons) equivalence p-value is <= alpha;
  otherwise `indistinguishable` (read: not shown either way). A comparison
  whose per-seed differences are all exactly 0 is `identical` (p 1) and left
  out of both Holm families: it is no evidence of anything, and counting it
  would make the other comparisons' corrections stricter.
  """
  if not 0 < alpha < 1:
    raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
  out: dict[K, tuple[float, str]] = {
    k: (1.0, IDENTICAL) for k, c in comparisons.items() if c.diff.low == c.diff.high == 0
  }
  keys = [k for k in comparisons if k not in out]
  if not keys:
    return out
  adjusted = holm([comparisons[k].p for k in keys])
  out |= {
    k: (float(a), comparisons[k].verdict(float(a), alpha))
    for k, a in zip(keys, adjusted, strict=True)
  }
  p_eq: dict[K, float] = {}
  for k in keys:
    p = comparisons[k].p_equivalent
    if p is not None:
      p_eq[k] = p
  if p_eq:
    for k, p in zip(p_eq, holm(list(p_eq.values())), strict=True):
      if out[k][1] == SAME and p <= alpha:
        out[k] = (out[k][0], EQUIVALENT)
  return out


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
  """Exact (Clopper-Pearson) interval of a binomial rate from k successes in n trials."""
  if not (0 <= k <= n and n >= 1):
    raise ValueError(f"clopper_pearson needs 0 <= k <= n, n >= 1, got k={k}, n={n}")
  tail = (1 - level) / 2
  low = 0.0 if k == 0 else float(scipy.stats.beta.ppf(tail, k, n - k + 1))
  high = 1.0 if k == n else float(scipy.stats.beta.ppf(1 - tail, k + 1, n - k))
  return low, high


def steps_to_threshold(
  eval_steps: Sequence[int], eval_accuracy: _Floats, *, gain: float = LEARNING_GAIN
) -> tuple[int, bool]:
  """(first evaluated step with accuracy >= warm start + gain, reached).

  The warm start is the evaluation at step 0. A run that never reaches the
  threshold is censored at the budget: it returns (its last evaluated step,
  False), a lower bound of its true time, so a cell's mean is a lower bound
  too whenever some of its runs did not reach it (the tables count them).
  """
  acc = np.asarray(eval_accuracy, np.float64)
  hit = np.flatnonzero(acc[1:] >= acc[0] + gain - _EPS)
  if hit.size:
    return int(eval_steps[hit[0] + 1]), True
  return int(eval_steps[-1]), False


def spent_to_threshold(
  eval_steps: Sequence[int], eval_accuracy: _Floats, spent: _Floats, *, gain: float = LEARNING_GAIN
) -> float:
  """What a run had spent (`spent`: a running total at each evaluation, e.g. sampled
  tokens) when it first reached the threshold of `steps_to_threshold`.

  Censored like the steps: a run that never reaches it gives its total at the
  last evaluation, a lower bound.
  """
  steps, _ = steps_to_threshold(eval_steps, eval_accuracy, gain=gain)
  return float(np.asarray(spent, np.float64)[list(eval_steps).index(steps)])


def accuracy_auc(eval_steps: Sequence[int], eval_accuracy: _Floats) -> float:
  """Area under the held-out accuracy curve (trapezoids) divided by the steps it spans.

  The time-average of the accuracy over the run, in accuracy units: a run
  that sits at its warm start a scores a; one that jumps to b at once, b.
  """
  t = np.asarray(eval_steps, np.float64)
  acc = np.asarray(eval_accuracy, np.float64)
  if t.size < 2 or np.any(np.diff(t) <= 0):
    raise ValueError(f"accuracy_auc needs >= 2 increasing steps, got {list(eval_steps)}")
  area = float(np.sum((acc[1:] + acc[:-1]) / 2 * np.diff(t)))
  return area / float(t[-1] - t[0])


def run_summary(
  eval_steps: Sequence[int],
  eval_accuracy: Sequence[float],
  train_reward: Sequence[float],
  *,
  last: int,
  skipped: float = 0.0,
) -> dict[str, float]:
  """One run's summary from its evaluation curve (step 0 = the warm start) and reward curve.

  Args:
    eval_steps: steps of the evaluations, the first being 0 (the warm start).
    eval_accuracy: greedy held-out accuracy at those steps.
    train_reward: mean training reward of every step.
    last: how many of the final evaluations `final_accuracy` averages.
    skipped: updates skipped for non-finite values during the run.

  Returns:
    `final_accuracy` (mean of the last `last` evaluations), `start_accuracy`,
    `auc` (mean training reward over the run: the normalised area under the
    training curve), `accuracy_auc` (`accuracy_auc`), `steps_to_threshold`
    and `threshold_reached` (`steps_to_threshold`, 1.0 / 0.0), `collapsed`
    (1.0 when each of the last `last` evaluations is more than
    `COLLAPSE_MARGIN` below the warm start, or any update was skipped as
    non-finite).
  """
  acc = np.asarray(eval_accuracy, np.float64)
  if len(eval_steps) != acc.size or eval_steps[0] != 0 or acc.size < last + 1:
    raise ValueError(
      f"run_summary needs the warm-start evaluation (step 0) and >= {last} more, "
      f"got steps {list(eval_steps)}"
    )
  tail = acc[-last:]
  collapsed = bool(np.all(tail < acc[0] - COLLAPSE_MARGIN)) or skipped > 0
  steps, reached = steps_to_threshold(eval_steps, acc)
  return {
    "final_accuracy": float(tail.mean()),
    "start_accuracy": float(acc[0]),
    "auc": float(np.mean(train_reward)),
    "accuracy_auc": accuracy_auc(eval_steps, acc),
    "steps_to_threshold": float(steps),
    "threshold_reached": float(reached),
    "collapsed": float(collapsed),
  }


def rate(k: int, n: int) -> str:
  """`k/n = r [low, high]` with the 95% Clopper-Pearson interval."""
  low, high = clopper_pearson(k, n)
  return f"{k}/{n} = {k / n:.3f} [{low:.3f}, {high:.3f}]"


def needed_seeds(comparisons: int, alpha: float) -> int:
  """The fewest seeds for which Holm over `comparisons` exact sign-flip tests can reject."""
  return max(1, math.ceil(math.log2(2 * max(comparisons, 1) / alpha)))
