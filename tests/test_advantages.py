"""Tests for offpolicy_jax.advantages against independent numpy references.

Most tests call `_adv`, a cached `jax.jit` of `advantages.compute` (one compiled
program per estimator and shape keeps the file fast); `test_jit_equals_no_jit`
covers the eager path.
"""

import functools

import jax
import numpy as np
import pytest

from offpolicy_jax import advantages

RNG = np.random.default_rng(0)
# Binary groups (including all-0 / all-1), a continuous group, a tie group.
REWARDS = np.array(
  [
    [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 1.0, 0.0, 1.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    [0.3, -1.2, 2.5, 0.7, 0.7, 0.1],
    [0.5, 0.9, 0.9, 0.2, 0.0, 0.4],
  ],
  np.float32,
)


@functools.cache
def _jitted(name, kw_items):
  kw = dict(kw_items)
  return jax.jit(lambda r, k, v: advantages.compute(name, r, key=k, valid=v, **kw))


def _adv(name, rewards, key=None, valid=None, **kw):
  key = jax.random.key(0) if key is None else key
  valid = np.ones(np.shape(rewards), bool) if valid is None else valid
  return np.asarray(_jitted(name, tuple(sorted(kw.items())))(rewards, key, valid))


def _ref_group(name, row, **kw):
  """Independent numpy reference for one group (python loops on purpose)."""
  k = len(row)
  if k == 0:
    return row
  if name == "asymre":
    return row - row.mean() - kw.get("baseline_shift", -0.1)
  if k <= 1 or row.max() == row.min():
    return np.zeros(k)
  m = row.mean()
  if name == "group_mean":
    return row - m
  if name == "grpo":
    return (row - m) / (np.std(row, ddof=1) + 1e-6)
  if name == "rloo":
    return np.array([row[i] - np.mean(np.delete(row, i)) for i in range(k)])
  if name == "median":
    out = row - np.median(row)
    if kw.get("normalize"):
      mad = np.median(np.abs(row - np.median(row)))
      out /= (mad if mad > 0 else np.std(row)) + 1e-6
    return out
  if name == "opmd":
    tau = kw.get("tau", 1.0)
    return row - tau * np.log(np.mean(np.exp(row / tau)))
  if name == "pass_at_k":
    return np.array([row.max() - np.max(np.delete(row, i)) for i in range(k)])
  if name == "batch_whiten":  # group part only; whitened in _ref
    return row - m
  raise AssertionError(name)


def _ref(name, r, valid=None, **kw):
  """Applies the group reference to the valid subset of every group."""
  valid = np.ones(r.shape, bool) if valid is None else valid
  out = np.zeros(r.shape)
  for g in range(r.shape[0]):
    out[g, valid[g]] = _ref_group(name, r[g, valid[g]].astype(np.float64), **kw)
  if name == "batch_whiten":
    a = out[valid]
    out[valid] = (a - a.mean()) / (a.std() + 1e-6)
    for g in range(r.shape[0]):
      row = r[g, valid[g]]
      if len(row) <= 1 or row.max() == row.min():
        out[g] = 0.0
  return out


CASES = [
  ("group_mean", {}),
  ("grpo", {}),
  ("rloo", {}),
  ("asymre", {}),
  ("asymre", {"baseline_shift": -0.3}),
  ("median", {}),
  ("median", {"normalize": True}),
  ("opmd", {}),
  ("opmd", {"tau": 0.3}),
  ("pass_at_k", {}),
  ("batch_whiten", {}),
]


@pytest.mark.parametrize("name,kw", CASES)
def test_golden_against_numpy(name, kw):
  got = _adv(name, REWARDS, **kw)
  np.testing.assert_allclose(got, _ref(name, REWARDS, **kw), rtol=1e-5, atol=1e-5)
  assert got.dtype == np.float32 and got.shape == REWARDS.shape


VALID = np.array(
  [
    [1, 1, 1, 0, 0, 1],
    [1, 1, 1, 1, 1, 1],
    [1, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0],
    [1, 1, 0, 1, 1, 1],
    [1, 0, 1, 1, 0, 1],
  ],
  bool,
)


@pytest.mark.parametrize("name,kw", CASES)
def test_valid_mask_equals_reference_on_subsets(name, kw):
  got = _adv(name, REWARDS, valid=VALID, **kw)
  np.testing.assert_allclose(got, _ref(name, REWARDS, VALID, **kw), rtol=1e-5, atol=1e-5)
  assert np.all(got[~VALID] == 0.0)
  # Changing an invalid reward changes nothing.
  poked = np.where(VALID, REWARDS, 123.0).astype(np.float32)
  np.testing.assert_array_equal(_adv(name, poked, valid=VALID, **kw), got)


def test_hand_values():
  r = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
  np.testing.assert_allclose(_adv("group_mean", r), [[0.75, -0.25, -0.25, -0.25]])
  np.testing.assert_allclose(_adv("rloo", r), [[1.0, -1 / 3, -1 / 3, -1 / 3]])
  np.testing.assert_allclose(_adv("pass_at_k", r), [[1.0, 0.0, 0.0, 0.0]])
  np.testing.assert_allclose(_adv("median", r), [[1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("name", advantages.names())
def test_degenerate_groups_never_nan(name):
  key = jax.random.key(0)
  for r in (np.full((3, 4), 0.7, np.float32), np.array([[1.0], [0.0]], np.float32)):
    got = _adv(name, r, key=key)
    assert np.all(np.isfinite(got))
    expected = 0.1 if name == "asymre" else 0.0
    np.testing.assert_allclose(got, expected, atol=1e-6)


def _red_drop_ref(row, u):
  """Reference RED-Drop with explicit sets: keep all positives, the n_pos negatives
  with the smallest u."""
  m = row.mean()
  pos = [i for i in range(len(row)) if row[i] >= m]
  neg = [i for i in range(len(row)) if row[i] < m]
  if len(neg) > len(pos):
    neg = sorted(neg, key=lambda i: u[i])[: len(pos)]
  kept = pos + neg
  mk = np.mean(row[kept])
  out = np.zeros(len(row))
  if row.max() > row.min():
    out[kept] = row[kept] - mk
  return out


def test_red_drop_golden_and_balance():
  key = jax.random.key(3)
  got = _adv("red_drop", REWARDS, key=key)
  u = np.asarray(jax.random.uniform(key, REWARDS.shape))
  for g in range(REWARDS.shape[0]):
    np.testing.assert_allclose(got[g], _red_drop_ref(REWARDS[g], u[g]), atol=1e-6)
  masked = _adv("red_drop", REWARDS, key=key, valid=VALID)
  for g in range(REWARDS.shape[0]):
    want = np.zeros(REWARDS.shape[1])
    v = VALID[g]
    if v.any():
      want[v] = _red_drop_ref(REWARDS[g, v], u[g, v])
    np.testing.assert_allclose(masked[g], want, atol=1e-6)
  # Group 0: one positive, five negatives -> exactly one negative kept.
  assert np.sum(got[0] != 0) == 2
  np.testing.assert_allclose(got[0][0], 0.5)
  # Group 1: positives outnumber negatives -> nothing dropped, plain group mean.
  np.testing.assert_allclose(got[1], REWARDS[1] - REWARDS[1].mean(), atol=1e-6)


def test_red_drop_random_choice_is_uniform_and_key_dependent():
  r = np.array([[1.0, 0.0, 0.0, 0.0]] * 400, np.float32)
  got = _adv("red_drop", r, key=jax.random.key(1))
  kept_neg = got[:, 1:] != 0
  assert np.all(kept_neg.sum(1) == 1)
  assert np.all(np.abs(kept_neg.mean(0) - 1 / 3) < 0.1)
  other = _adv("red_drop", r, key=jax.random.key(2))
  assert not np.array_equal(got, other)


@pytest.mark.parametrize("name", advantages.names())
def test_jit_equals_no_jit(name):
  key = jax.random.key(0)
  fn = jax.jit(lambda r, k, v: advantages.compute(name, r, key=k, valid=v))
  for v in (np.ones_like(VALID), VALID):
    np.testing.assert_allclose(
      fn(REWARDS, key, v),
      advantages.compute(name, REWARDS, key=key, valid=v),
      rtol=1e-6,
      atol=1e-6,
    )


def test_rloo_equals_leave_one_out_on_random_rewards():
  r = RNG.normal(size=(5, 7)).astype(np.float32)
  np.testing.assert_allclose(_adv("rloo", r), _ref("rloo", r), atol=1e-5)


def test_errors():
  with pytest.raises(ValueError, match="bogus"):
    advantages.compute("bogus", REWARDS)
  with pytest.raises(ValueError, match="tau"):
    advantages.compute("grpo", REWARDS, tau=1.0)
  with pytest.raises(ValueError, match="key"):
    advantages.compute("red_drop", REWARDS)
  with pytest.raises(ValueError, match="rewards"):
    advantages.compute("grpo", REWARDS[0])
  with pytest.raises(ValueError, match="valid"):
    advantages.compute("grpo", REWARDS, valid=VALID[:, :2])


def test_names_match_design_contract():
  expected = "group_mean grpo rloo asymre red_drop median opmd pass_at_k batch_whiten remax".split()
  assert sorted(advantages.names()) == sorted(expected)
  assert len(advantages.names()) == len(expected)
