"""Tests for the study's statistics: permutation test, Holm, learning speed, the report's verdicts.

Golden values are hand calculations; the report tests use synthetic rows (no runs).
"""

import itertools
import math
import os
import sys

import numpy as np
import pytest
import scipy.stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax.study import (
  report_tables,  # noqa: E402
  stats,  # noqa: E402
)


def test_sign_flip_pvalue_on_hand_computed_cases():
  # n = 5 differences of one sign: only the identity and the all-flipped pattern reach |sum|.
  assert stats.sign_flip_pvalue([0.1, 0.2, 0.05, 0.3, 0.01]) == pytest.approx(2 / 32)
  assert stats.sign_flip_pvalue([-0.1, -0.2, -0.05, -0.3, -0.01]) == pytest.approx(2 / 32)
  # d = (3, 1, 1): |sum| = 5; patterns with |sum| >= 5 are +++ and --- only: p = 2/8.
  assert stats.sign_flip_pvalue([3, 1, 1]) == pytest.approx(2 / 8)
  # d = (3, -1, 1), sum 3: with s1 = +1 the sums are 3 (+++), 1 (++-), 5 (+-+), 3 (+--):
  # three reach |3|, and their mirror images: p = 6/8. Also against an independent loop.
  d = np.array([3.0, -1.0, 1.0])
  want = np.mean([abs(np.dot(s, d)) >= abs(d.sum()) for s in itertools.product((-1, 1), repeat=3)])
  assert stats.sign_flip_pvalue(d) == pytest.approx(want) == pytest.approx(6 / 8)
  assert stats.sign_flip_pvalue([0.0, 0.0, 0.0]) == 1.0
  assert stats.smallest_p(5) == 2 / 32 and stats.needed_seeds(79, 0.05) == 12


def test_sign_flip_monte_carlo_is_fixed_and_agrees_with_the_exact_test():
  rng = np.random.default_rng(1)
  d = rng.normal(0.3, 1.0, 14)
  exact = stats.sign_flip_pvalue(d)
  mc = stats.sign_flip_pvalue(d, exact_max=10, resamples=40_000)
  assert mc == stats.sign_flip_pvalue(d, exact_max=10, resamples=40_000)  # the fixed key
  assert abs(mc - exact) < 4 * math.sqrt(exact * (1 - exact) / 40_000) + 1e-4
  # 30 positive differences: p = 1 / (1 + resamples) (no random pattern reaches the identity).
  assert stats.sign_flip_pvalue(np.ones(30), resamples=999) == pytest.approx(1 / 1000)
  with pytest.raises(ValueError, match="non-finite"):
    stats.sign_flip_pvalue([0.1, math.nan])


def test_sign_flip_test_keeps_its_level_under_the_null():
  """Symmetric noise, 8 seeds, 2000 studies: the rejection rate at 0.05 is at most 0.05 + noise."""
  rng = np.random.default_rng(0)
  p = np.array([stats.sign_flip_pvalue(rng.standard_t(3, 8)) for _ in range(2000)])
  assert np.mean(p <= 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)
  assert np.mean(p <= 0.5) > 0.4  # and it does reject when alpha allows


def test_holm_on_a_known_set():
  # sorted 0.005, 0.01, 0.03, 0.04 -> 4*0.005, 3*0.01, 2*0.03, 1*0.04 = .02, .03, .06, .04,
  # made monotone: .02, .03, .06, .06; returned in the input order.
  got = stats.holm([0.01, 0.04, 0.03, 0.005])
  np.testing.assert_allclose(got, [0.03, 0.06, 0.06, 0.02])
  np.testing.assert_allclose(stats.holm([0.5, 0.9]), [1.0, 1.0])
  assert stats.holm([]).size == 0
  with pytest.raises(ValueError, match="p-values"):
    stats.holm([0.1, 1.5])


def test_verdicts_reject_by_the_adjusted_p_and_the_sign():
  up, down, flat = np.arange(1, 7) * 0.01, -np.arange(1, 7) * 0.01, np.array([1, -1] * 3) * 0.01
  zeros = np.zeros(6)
  comps = {k: stats.compare(x, zeros) for k, x in {"up": up, "down": down, "flat": flat}.items()}
  # p = 2/64 each for up and down; Holm over 3: 3 * 2/64 = 0.094 -> nothing at 0.05, both at 0.1.
  at05, at10 = stats.verdicts(comps, 0.05), stats.verdicts(comps, 0.10)
  assert at05["up"] == (pytest.approx(6 / 64), stats.SAME)
  assert at10["up"][1] == stats.BETTER and at10["down"][1] == stats.WORSE
  assert at10["flat"][1] == stats.SAME
  assert comps["up"].interval_verdict == stats.BETTER  # one t test alone has no such brake
  with pytest.raises(ValueError, match="alpha"):
    stats.verdicts(comps, 1.0)


def test_clopper_pearson_known_values():
  assert stats.clopper_pearson(0, 5) == (0.0, pytest.approx(1 - 0.025 ** (1 / 5)))
  low, high = stats.clopper_pearson(5, 5)
  assert high == 1.0 and low == pytest.approx(0.025 ** (1 / 5))
  low, high = stats.clopper_pearson(1, 10)
  assert low == pytest.approx(0.00253, abs=1e-5) and high == pytest.approx(0.4450, abs=1e-4)
  assert stats.rate(1, 10) == "1/10 = 0.100 [0.003, 0.445]"
  with pytest.raises(ValueError, match="k <= n"):
    stats.clopper_pearson(3, 2)


def test_steps_to_threshold_and_auc_on_hand_made_curves():
  steps = [0, 50, 100, 150, 200]
  assert stats.steps_to_threshold(steps, [0.3, 0.35, 0.40, 0.5, 0.6]) == (100, True)
  assert stats.steps_to_threshold(steps, [0.3, 0.45, 0.1, 0.1, 0.1]) == (50, True)
  # Never reached: censored at the budget.
  assert stats.steps_to_threshold(steps, [0.3, 0.39, 0.35, 0.3, 0.2]) == (200, False)
  assert stats.steps_to_threshold(steps, [0.3, 0.3, 0.3, 0.3, 0.4]) == (200, True)
  # What was spent when the threshold was first reached (censored runs: the whole budget).
  tokens = [0, 1000, 2500, 3000, 4200]
  assert stats.spent_to_threshold(steps, [0.3, 0.35, 0.40, 0.5, 0.6], tokens) == 2500
  assert stats.spent_to_threshold(steps, [0.3, 0.39, 0.35, 0.3, 0.2], tokens) == 4200
  # AUC / steps: a flat curve gives its level; a ramp 0 -> 1 gives 0.5; trapezoids.
  assert stats.accuracy_auc(steps, [0.4] * 5) == pytest.approx(0.4)
  assert stats.accuracy_auc([0, 100], [0.0, 1.0]) == pytest.approx(0.5)
  # (0.2+0.4)/2*50 + (0.4+0.4)/2*150 = 15 + 60 = 75 over 200 steps.
  assert stats.accuracy_auc([0, 50, 200], [0.2, 0.4, 0.4]) == pytest.approx(75 / 200)
  with pytest.raises(ValueError, match="increasing"):
    stats.accuracy_auc([0, 0], [0.1, 0.2])
  s = stats.run_summary(steps, [0.3, 0.35, 0.40, 0.5, 0.6], [0.5] * 200, last=2)
  assert (s["steps_to_threshold"], s["threshold_reached"]) == (100.0, 1.0)
  assert s["accuracy_auc"] == pytest.approx((0.65 + 0.75 + 0.9 + 1.1) / 2 * 50 / 200)


def _rows(cells: dict, seeds: int) -> list[dict]:
  """Synthetic study rows: {(method, lag): [final accuracy per seed]}, curves from them."""
  rows = []
  for (m, g), finals in cells.items():
    for seed in range(seeds):
      start, final = 0.3, finals[seed]
      curve = [start, (start + final) / 2, final]
      summary = stats.run_summary([0, 10, 20], curve, [0.5], last=1)
      for metric, value in summary.items():
        rows.append(dict(method=m, lag=g, seed=seed, metric=metric, step=None, value=value))
  return rows


def test_report_verdicts_holm_power_note_and_aa_rate(tmp_path):
  n = 12
  rng = np.random.default_rng(0)
  base = 0.3 + rng.uniform(0, 0.1, n)
  cells = {
    ("grpo", "on"): base,
    ("grpo", "lag"): base - 0.05 - rng.uniform(0, 0.01, n),  # worse on every seed
    ("ok", "on"): base + rng.normal(0, 0.02, n),
    ("ok", "lag"): base + 0.2,  # reaches the threshold at step 10 on every seed
    ("aa-grpo", "on"): base + 0.2,  # a "false" A/A difference on purpose
    ("aa-grpo", "lag"): base - 0.05 - rng.uniform(0, 0.01, n) + rng.normal(0, 0.001, n),
  }
  path = report_tables.write_tables(
    _rows(cells, n), str(tmp_path / "s.md"), baseline=("grpo", "on"), title="t", alpha=0.05
  )
  text = open(path).read()
  tests = text.split("## Tests against the baseline")[1].split("\n## ")[0]
  row = next(x for x in tests.splitlines() if x.startswith("| grpo | lag |"))
  # 12 negative differences: p = 2/4096; Holm over 3 comparisons: 3 * 2/4096. The A/A
  # pairs below call chance a difference on every metric (rates above alpha), so every
  # `worse` / `faster` is flagged as no finding (†).
  assert f"| {2 / 4096:.3g} | {6 / 4096:.3g} | - | worse† |" in row  # no margin: no TOST
  assert "verdict is attainable" not in text
  speed_steps = text.split("### Steps to reach")[1].split("### ")[0]
  assert "| -10.0 [-10.0, -10.0] p=0.00049 faster† |" in speed_steps
  # Learning speed: differences within the lag; grpo reaches +0.10 nowhere (censored, 0/12).
  speed = text.split("### Steps to reach the warm start + 0.10")[1]
  assert "| grpo | 20.0 [20.0, 20.0] (0/12) |" in speed
  assert "| ok | +0.0 [+0.0, +0.0] p=1 = |" in speed.split("### ")[0]  # identical: no test
  # A/A: 1 of the 2 final-accuracy pairs is called different: 1/2 [0.013, 0.987].
  assert "permutation test at alpha = 0.05): 1/2 = 0.500 [0.013, 0.987]; nominal 0.05." in text
  assert "aa-grpo" not in text.split("## Final greedy accuracy")[1].split("## Paired")[0]
  # Per metric, never pooled: the shifted pair is false on all 3 metrics (its twin reaches
  # the threshold at step 10); at `lag` no run reaches it, those differences are all 0 and
  # left out of the steps' rate.
  assert "- final_accuracy: permutation test 1/2 = 0.500 [0.013, 0.987] (nominal 0.05)" in text
  assert "- accuracy_auc: permutation test 1/2 = 0.500 [0.013, 0.987] (nominal 0.05)" in text
  assert "- steps_to_threshold: permutation test 1/1 = 1.000 [0.025, 1.000]" in text
  assert "pooled" not in text
  flagged = "not reported as findings († in the tables): final_accuracy, accuracy_auc, "
  assert flagged + "steps_to_threshold" in text
  assert "left out of the rates: 1 comparisons whose per-seed differences are all 0" in text
  few = {k: v[:5] for k, v in cells.items() if not k[0].startswith("aa-")}
  path = report_tables.write_tables(
    _rows(few, 5), str(tmp_path / "few.md"), baseline=("grpo", "on"), title="t"
  )
  text = open(path).read()
  assert "No `better`/`worse` verdict is attainable here**: that needs >= 7 seeds" in text
  assert "## A/A calibration" not in text


def test_t_interval_known_values_and_edges():
  x = [0.1, 0.4, 0.2, 0.5, 0.3]  # mean 0.3, sd sqrt(0.025); t_{4, 0.975} = 2.7764
  iv = stats.t_interval(x)
  half = 2.7764451 * np.sqrt(0.025) / np.sqrt(5)
  assert iv.mean == pytest.approx(0.3)
  assert (iv.low, iv.high) == (pytest.approx(0.3 - half), pytest.approx(0.3 + half))
  assert stats.t_interval(x, level=0.9).high < iv.high
  same = stats.t_interval([0.25] * 4)
  assert same.low == same.high == pytest.approx(0.25)
  one = stats.t_interval([0.7])
  assert one.mean == 0.7 and np.isnan(one.low) and np.isnan(one.high)
  assert stats.interval is stats.t_interval  # what the tables print


def test_equivalence_pvalue_is_two_one_sided_t_tests():
  rng = np.random.default_rng(3)
  for _ in range(20):
    d = rng.normal(rng.uniform(-0.05, 0.05), 0.03, size=8)
    margin = 0.03
    p = stats.equivalence_pvalue(d, margin)
    # p <= 0.05 exactly when the 90% t interval lies inside the margin (Schuirmann).
    iv = stats.t_interval(d, level=0.90)
    assert (p <= 0.05) == (-margin < iv.low and iv.high < margin)
    # Independent: the larger of the two one-sided t-test p-values.
    lo = scipy.stats.ttest_1samp(d + margin, 0.0, alternative="greater").pvalue
    hi = scipy.stats.ttest_1samp(d - margin, 0.0, alternative="less").pvalue
    assert p == pytest.approx(max(lo, hi))
  assert stats.equivalence_pvalue([0.01] * 5, 0.03) == 0.0
  assert stats.equivalence_pvalue([0.05] * 5, 0.03) == 1.0
  assert stats.equivalence_pvalue([0.0], 0.03) == 1.0  # one seed shows nothing
  with pytest.raises(ValueError, match="margin"):
    stats.equivalence_pvalue([0.1, 0.2], 0.0)


def test_verdicts_mark_equivalence_only_where_shown_and_differences_first():
  rng = np.random.default_rng(0)
  base = rng.uniform(0.3, 0.6, size=12)
  close = base + rng.normal(0.0, 0.005, size=12)  # within 0.03, tightly
  far = base + 0.2 + rng.normal(0.0, 0.01, size=12)  # clearly better
  noisy = base + rng.normal(0.0, 0.2, size=12)  # neither shown
  comps = {
    k: stats.compare(x, base, margin=0.03)
    for k, x in {"close": close, "far": far, "noisy": noisy}.items()
  }
  got = {k: v[1] for k, v in stats.verdicts(comps, 0.05).items()}
  assert got == {"close": stats.EQUIVALENT, "far": stats.BETTER, "noisy": stats.SAME}
  # Without a margin nothing is called equivalent.
  plain = {k: stats.compare(x, base) for k, x in {"close": close}.items()}
  assert stats.verdicts(plain, 0.05)["close"][1] == stats.SAME
  # Holm over the equivalence p-values: a borderline one alone passes, among many it does not.
  z = np.array([1.0, -1.0] * 6)  # mean 0, sd (ddof 1) sqrt(12 / 11)
  edge = base + 0.0446 * z / z.std(ddof=1)  # se 0.0129: 0.03 / se = 2.33, p about 0.02
  one = stats.compare(edge, base, margin=0.03)
  assert one.p_equivalent is not None and 0.01 < one.p_equivalent < 0.05, one.p_equivalent
  assert stats.verdicts({"edge": one}, 0.05)["edge"][1] == stats.EQUIVALENT
  many = {i: one for i in range(10)}
  assert {v[1] for v in stats.verdicts(many, 0.05).values()} == {stats.SAME}


def test_identical_runs_are_marked_and_left_out_of_holms_count():
  """Differences exactly 0 on every seed (one update, two names): `identical`, p 1, and not
  counted, so the other comparison keeps its own p (Holm over one, not two)."""
  zero = stats.compare([0.5] * 6, [0.5] * 6, margin=0.03)
  real = stats.compare([0.6, 0.7, 0.65, 0.6, 0.7, 0.66], [0.5] * 6)
  out = stats.verdicts({"same": zero, "real": real}, 0.05)
  assert out["same"] == (1.0, stats.IDENTICAL)
  assert out["real"][0] == pytest.approx(real.p)  # m = 1
  assert out["real"][1] == stats.BETTER
  assert stats.verdicts({"same": zero}, 0.05) == {"same": (1.0, stats.IDENTICAL)}
