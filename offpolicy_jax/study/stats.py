"""Statistics of a seeded study: per-run summaries, bootstrap intervals, paired verdicts.

A study's runs are paired: runs with the same seed share the warm start and
the prompt stream, so the seed-to-seed spread of the warm start cancels in
per-seed differences. The verdict of a method against the baseline is a
**paired percentile bootstrap** of the mean per-seed difference: "worse" when
the whole 95% interval lies below 0, "better" when it lies above 0, and
"indistinguishable" otherwise. With few seeds the bootstrap interval is
narrower than a t interval would be; the tables say so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Resamples of every bootstrap (fixed generator: the tables are reproducible).
BOOTSTRAP_RESAMPLES = 10_000
# A run has collapsed when its last evaluations all sit this far below its warm start.
COLLAPSE_MARGIN = 0.05

WORSE, SAME, BETTER = "worse", "indistinguishable", "better"


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean and its 95% bootstrap interval over seeds."""

  mean: float
  low: float
  high: float
  n: int

  def contains(self, x: float) -> bool:
    return self.low <= x <= self.high

  def __str__(self) -> str:
    return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap(
  values: Sequence[float] | np.ndarray, *, seed: int = 0, level: float = 0.95
) -> Interval:
  """Mean of `values` with a percentile bootstrap interval (resampling the values)."""
  x = np.asarray(values, np.float64)
  if x.ndim != 1 or x.size == 0:
    raise ValueError(f"bootstrap needs a non-empty 1-D sample, got shape {x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"bootstrap: non-finite values in {x.tolist()}")
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, x.size, size=(BOOTSTRAP_RESAMPLES, x.size))].mean(axis=1)
  tail = 100 * (1 - level) / 2
  low, high = np.percentile(means, [tail, 100 - tail])
  # The percentile interval of a mean always contains it unless every resample
  # rounds away from it; clamp the float noise so `contains(mean)` holds.
  mean = float(x.mean())
  return Interval(mean, min(float(low), mean), max(float(high), mean), int(x.size))


def paired_verdict(method: Sequence[float], baseline: Sequence[float]) -> tuple[Interval, str]:
  """(interval of the mean per-seed difference method - baseline, verdict)."""
  a, b = np.asarray(method, np.float64), np.asarray(baseline, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"paired comparison needs the same seeds: {a.shape} vs {b.shape}")
  diff = bootstrap(a - b)
  if diff.high < 0:
    return diff, WORSE
  if diff.low > 0:
    return diff, BETTER
  return diff, SAME


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
    training curve), `collapsed` (1.0 when each of the last `last`
    evaluations is more than `COLLAPSE_MARGIN` below the warm start, or any
    update was skipped as non-finite).
  """
  acc = np.asarray(eval_accuracy, np.float64)
  if len(eval_steps) != acc.size or eval_steps[0] != 0 or acc.size < last + 1:
    raise ValueError(
      f"run_summary needs the warm-start evaluation (step 0) and >= {last} more, "
      f"got steps {list(eval_steps)}"
    )
  tail = acc[-last:]
  collapsed = bool(np.all(tail < acc[0] - COLLAPSE_MARGIN)) or skipped > 0
  return {
    "final_accuracy": float(tail.mean()),
    "start_accuracy": float(acc[0]),
    "auc": float(np.mean(train_reward)),
    "collapsed": float(collapsed),
  }
