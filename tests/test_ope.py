"""Tests for offpolicy_jax.ope: a known discrete problem, float64 references, invariances.

The tiny problem: responses of T = 3 binary tokens drawn from a known behaviour
policy mu; the target policy pi's expected reward is exact by enumeration of
the 8 sequences. `_all` (one jitted program per shape) runs every estimator at
once; `test_jit_equals_no_jit` covers the eager path.
"""

import functools
import itertools

import jax
import numpy as np
import pytest

from offpolicy_jax import ope

T = 3
SEQS = np.array(list(itertools.product((0, 1), repeat=T)))  # [8, 3]
REWARD = np.random.default_rng(1).random(8) * 0.5 + SEQS.sum(1) / 3  # deterministic r(y)


def _p_one(table: np.ndarray, prefix: np.ndarray) -> np.ndarray:
  """P(next token = 1 | prefix): `table[t, previous token]` (1 = no previous)."""
  t = prefix.shape[-1]
  prev = prefix[..., -1] if t else np.ones(prefix.shape[:-1], int)
  return table[t, prev]


MU = np.array([[0.4, 0.5], [0.5, 0.6], [0.3, 0.5]])  # rows: t; columns: previous token
PI = np.array([[0.7, 0.6], [0.8, 0.7], [0.6, 0.7]])


def _token_logp(table: np.ndarray, y: np.ndarray) -> np.ndarray:
  """[..., T] log-probs of the tokens `y` under a policy table."""
  out = np.zeros(y.shape)
  for t in range(T):
    p1 = _p_one(table, y[..., :t])
    out[..., t] = np.log(np.where(y[..., t] == 1, p1, 1 - p1))
  return out


def _seq_index(y: np.ndarray) -> np.ndarray:
  return (y * 2 ** np.arange(T - 1, -1, -1)).sum(-1)


TRUE_VALUE = float((np.exp(_token_logp(PI, SEQS).sum(1)) * REWARD).sum())


def _true_values(y: np.ndarray) -> np.ndarray:
  """[..., T] exact V_pi(s_t) = E_pi[r | y_<t]: the perfect critic."""
  p_seq = np.exp(_token_logp(PI, SEQS))  # [8, T] token probabilities
  out = np.zeros(y.shape)
  for t in range(T):
    match = (SEQS[None, :, :t] == y.reshape(-1, T)[:, None, :t]).all(-1)  # [N, 8]
    w = match * p_seq[:, t:].prod(1)
    out.reshape(-1, T)[:, t] = (w * REWARD).sum(1)
  return out


def _sample(shape: tuple[int, ...], seed: int):
  """Tokens drawn from mu: (logp under pi, logp under mu, rewards), float32."""
  rng = np.random.default_rng(seed)
  y = np.zeros((*shape, T), int)
  for t in range(T):
    y[..., t] = rng.random(shape) < _p_one(MU, y[..., :t])
  f32 = lambda x: np.asarray(x, np.float32)
  return y, f32(_token_logp(PI, y)), f32(_token_logp(MU, y)), f32(REWARD[_seq_index(y)])


def _run_all(logp, blogp, mask, rewards, values, q):
  out = {}
  for name in ope.names():
    critic = {"values": values, "q": q} if name in ("dr", "wdr") else {}
    out[name] = ope.estimate(name, logp, blogp, mask, rewards, **critic)
  return out


_all = jax.jit(_run_all)


def _np(est: dict) -> dict:
  return {k: jax.tree.map(np.asarray, v) for k, v in est.items()}


def test_on_policy_is_the_sample_mean():
  rng = np.random.default_rng(0)
  logp = rng.normal(size=(6, 4)).astype(np.float32)
  mask = np.ones((6, 4), np.float32)
  mask[2, 1:] = 0.0  # ragged, but the same number of rows
  mask[4, 3] = 0.0
  rewards = rng.random(6).astype(np.float32)
  est = _np(_all(logp, logp, mask, rewards, np.zeros_like(logp), None))
  for name in ope.names():
    e = est[name]
    np.testing.assert_allclose(e.value, rewards.mean(), rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(e.stderr, rewards.std(ddof=1) / np.sqrt(6), rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(e.ess, 6.0, rtol=1e-6)
    np.testing.assert_allclose(e.ci_high - e.value, 1.959964 * e.stderr, rtol=1e-5)
    assert (e.n, e.num_excluded) == (6, 0)


def _noisy_critic(y, seed):
  rng = np.random.default_rng(seed)
  values = _true_values(y) + rng.normal(0.0, 0.1, y.shape)
  q = REWARD[_seq_index(y)] + rng.normal(0.0, 0.1, y.shape[:-1])
  return values.astype(np.float32), q.astype(np.float32)


def test_intervals_cover_the_exact_value_and_the_wrong_sign_does_not():
  y, logp, blogp, rewards = _sample((4000,), seed=3)
  mask = np.ones_like(logp)
  values, q = _noisy_critic(y, seed=4)
  est = _np(_all(logp, blogp, mask, rewards, values, q))
  # The log-ratio of the wrong sign; a constant critic, since a good one would rescue DR.
  c_bt, c_b = np.full_like(values, 0.5), np.full_like(q, 0.5)
  wrong = _np(_all(blogp, logp, mask, rewards, c_bt, c_b))
  for name in ope.names():
    e, w = est[name], wrong[name]
    assert e.ci_low <= TRUE_VALUE <= e.ci_high, (name, e)
    assert not w.ci_low <= TRUE_VALUE <= w.ci_high, (name, w)
    assert 0 < e.ess < 4000


def test_is_is_unbiased_and_the_stderrs_are_calibrated():
  """Over 200 independent batches of 256: IS, PDIS and DR average to the truth;
  every estimator's mean reported stderr matches the spread of its estimates."""
  y, logp, blogp, rewards = _sample((200, 256), seed=5)
  values, q = _noisy_critic(y, seed=6)
  est = _np(jax.jit(jax.vmap(_run_all))(logp, blogp, np.ones_like(logp), rewards, values, q))
  for name in ope.names():
    v, se = est[name].value, est[name].stderr
    np.testing.assert_allclose(se.mean(), v.std(ddof=1), rtol=0.2, err_msg=name)
    if name in ("is", "pdis", "dr"):
      assert abs(v.mean() - TRUE_VALUE) < 4 * v.std(ddof=1) / np.sqrt(200), name


# --- float64 references on ragged rows -------------------------------------------------------


def _ref_rows(logp, blogp, mask, rewards, clip):
  """Per valid row: (cumulative weights W_t, per-token rewards, valid token positions)."""
  rows = []
  for i in range(logp.shape[0]):
    pos = np.flatnonzero(mask[i])
    if not len(pos):
      continue
    w, acc = np.ones(logp.shape[1]), 0.0
    for t in range(logp.shape[1]):
      acc += logp[i, t] - blogp[i, t] if mask[i, t] else 0.0
      w[t] = np.exp(acc) if clip is None else min(np.exp(acc), clip)
    r = np.zeros(logp.shape[1])
    if rewards.ndim == 1:
      r[pos[-1]] = rewards[i]
    else:
      r[pos] = rewards[i, pos]
    rows.append((i, w, r, pos))
  return rows


def _ref_mean(f):
  f = np.asarray(f)
  return f.mean(), f.std(ddof=1) / np.sqrt(len(f))


def _ref_weighted(cols_w, cols_g, h):
  """mean h + sum_t sum_i W_it g_it / sum_i W_it, delta-method stderr (explicit loops)."""
  n, num_t = cols_w.shape
  value, psi = np.mean(h), (np.asarray(h) - np.mean(h)) / n
  for t in range(num_t):
    wbar = cols_w[:, t] / cols_w[:, t].sum()
    g_t = (wbar * cols_g[:, t]).sum()
    value += g_t
    psi = psi + wbar * (cols_g[:, t] - g_t)
  return value, np.sqrt(n / (n - 1) * (psi**2).sum())


def _ref_dr_row(w, r, pos, values, q):
  """Jiang and Li's recursion, literally: V_DR = V(s_t) + rho_t (r_t + V_DR' - Q(s_t, y_t))."""
  v_dr = 0.0
  for j in range(len(pos) - 1, -1, -1):
    t = pos[j]
    q_hat = values[pos[j + 1]] if j + 1 < len(pos) else q
    rho = w[t] / (w[pos[j - 1]] if j else 1.0)
    v_dr = values[t] + rho * (r[t] + v_dr - q_hat)
  return v_dr


def _ref_wdr(rows, values, q):
  """Thomas and Brunskill's WDR, not telescoped (right-padded rows)."""
  w = np.stack([x[1] for x in rows])
  n, num_t = w.shape
  wbar = np.concatenate([np.full((n, 1), 1 / n), w / w.sum(0)], axis=1)  # column 0 is t = -1
  total = 0.0
  for k, (i, _, r, pos) in enumerate(rows):
    for j, t in enumerate(pos):
      q_hat = values[i, pos[j + 1]] if j + 1 < len(pos) else q[i]
      total += wbar[k, t + 1] * (r[t] - q_hat) + wbar[k, t] * values[i, t]
  return total


def _reference(name, logp, blogp, mask, rewards, values, q, clip=None):
  rows = _ref_rows(logp, blogp, mask, rewards, clip)
  w_final = np.array([x[1][-1] for x in rows])
  ret = np.array([x[2].sum() for x in rows])
  w_cols = np.stack([x[1] for x in rows])
  r_cols = np.stack([x[2] for x in rows])
  if name == "is":
    return _ref_mean(w_final * ret)
  if name == "wis":
    return _ref_weighted(w_final[:, None], ret[:, None], np.zeros(len(rows)))
  if name == "pdis":
    return _ref_mean((w_cols * r_cols).sum(1))
  if name == "pdwis":
    return _ref_weighted(w_cols, r_cols, np.zeros(len(rows)))
  if name == "dr":
    return _ref_mean([_ref_dr_row(w, r, p, values[i], q[i]) for i, w, r, p in rows])
  g = r_cols.copy()
  for k, (i, _, _, pos) in enumerate(rows):
    g[k, pos[-1]] -= q[i]
  value, stderr = _ref_weighted(w_cols, g, [values[i, p[0]] for i, _, _, p in rows])
  np.testing.assert_allclose(value, _ref_wdr(rows, values, q), rtol=1e-10)  # the telescoping
  return value, stderr


def _ragged(seed=0, per_token=False):
  rng = np.random.default_rng(seed)
  b, t = 7, 5
  logp = (rng.normal(size=(b, t)) * 0.5 - 1.0).astype(np.float32)
  blogp = (logp + rng.normal(size=(b, t)) * 0.4).astype(np.float32)
  lengths = np.array([5, 3, 1, 0, 4, 2, 5])
  mask = (np.arange(t) < lengths[:, None]).astype(np.float32)
  rewards = rng.random((b, t) if per_token else b).astype(np.float32)
  values = rng.random((b, t)).astype(np.float32)
  q = rng.random(b).astype(np.float32)
  return logp, blogp, mask, rewards, values, q


@pytest.mark.parametrize("per_token", [False, True])
def test_matches_the_float64_reference_on_ragged_rows(per_token):
  args = _ragged(per_token=per_token)
  est = _np(_all(*args))
  f64 = [np.asarray(a, np.float64) for a in args]
  for name in ope.names():
    value, stderr = _reference(name, *f64)
    np.testing.assert_allclose(est[name].value, value, rtol=2e-5, err_msg=name)
    np.testing.assert_allclose(est[name].stderr, stderr, rtol=2e-5, err_msg=name)
    assert (est[name].n, est[name].num_excluded) == (6, 1)
    w = np.array([x[1][-1] for x in _ref_rows(*f64[:4], None)])
    np.testing.assert_allclose(est[name].ess, w.sum() ** 2 / (w**2).sum(), rtol=1e-5)


def test_clip_truncates_the_weights():
  logp, blogp, mask, rewards, values, q = (np.asarray(a, np.float64) for a in _ragged())
  for name in ("is", "pdwis"):
    got = ope.estimate(name, logp, blogp, mask, rewards, clip=1.5)
    value, stderr = _reference(name, logp, blogp, mask, rewards, values, q, clip=1.5)
    np.testing.assert_allclose(got.value, value, rtol=2e-5)
    np.testing.assert_allclose(got.stderr, stderr, rtol=2e-5)


def test_padding_changes_nothing():
  logp, blogp, mask, rewards, values, q = _ragged(per_token=True)
  pad = lambda x, fill: np.concatenate([x, np.full((x.shape[0], 2), fill, x.dtype)], axis=1)
  garbage = [np.where(mask > 0, x, np.nan).astype(np.float32) for x in (logp, blogp, values)]
  rewards_g = np.where(mask > 0, rewards, 1e6).astype(np.float32)
  padded = (
    pad(garbage[0], np.nan),
    pad(garbage[1], -np.inf),
    pad(mask, 0.0),
    pad(rewards_g, 7.0),
    pad(garbage[2], np.nan),
    q,
  )
  base, got = _np(_all(logp, blogp, mask, rewards, values, q)), _np(_all(*padded))
  for name in ope.names():
    chex_close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=name)
    jax.tree.map(chex_close, got[name], base[name])


def test_doubly_robust_with_a_perfect_critic_is_exact_and_with_none_is_is():
  y, logp, blogp, rewards = _sample((64,), seed=7)
  mask = np.ones_like(logp)
  perfect = _true_values(y).astype(np.float32)
  est = _np(_all(logp, blogp, mask, rewards, perfect, rewards))  # q = r: deterministic reward
  for name in ("dr", "wdr"):
    np.testing.assert_allclose(est[name].value, TRUE_VALUE, rtol=1e-5)
    assert est[name].stderr < 1e-5
  zero = _np(_all(logp, blogp, mask, rewards, np.zeros_like(logp), None))
  np.testing.assert_allclose(zero["dr"].value, zero["is"].value, rtol=1e-6)
  np.testing.assert_allclose(zero["dr"].stderr, zero["is"].stderr, rtol=1e-5)
  np.testing.assert_allclose(zero["wdr"].value, zero["pdwis"].value, rtol=1e-6)
  np.testing.assert_allclose(zero["wdr"].stderr, zero["pdwis"].stderr, rtol=1e-5)


def test_jit_equals_no_jit():
  args = _ragged(seed=2)
  jitted = _np(_all(*args))
  for name, e in _np(_run_all(*args)).items():
    np.testing.assert_allclose(np.array(e), np.array(jitted[name]), rtol=1e-5, err_msg=name)


@functools.cache
def _ok():
  return _ragged()


@pytest.mark.parametrize(
  ("change", "field"),
  [
    ({"behavior_logp": None}, "behavior_logp"),
    ({"behavior_logp": np.zeros((7, 4), np.float32)}, "behavior_logp"),
    ({"mask": np.full((7, 5), 0.5, np.float32)}, "mask"),
    ({"mask": np.ones((7, 4), np.float32)}, "mask"),
    ({"rewards": np.zeros(6, np.float32)}, "rewards"),
    ({"logp": np.zeros(7, np.float32)}, "logp"),
    ({"values": None, "name": "dr"}, "values"),
    ({"values": np.zeros((7, 5), np.float32), "name": "wis"}, "values"),
    ({"q": np.zeros(3, np.float32), "name": "wdr"}, "q"),
    ({"clip": 0.0}, "clip"),
    ({"level": 1.5}, "level"),
    ({"name": "wsi"}, "name"),
  ],
)
def test_bad_inputs_raise_one_line_naming_the_argument(change, field):
  logp, blogp, mask, rewards, values, _ = _ok()
  kw = {"name": "dr", "logp": logp, "behavior_logp": blogp, "mask": mask, "rewards": rewards}
  kw["values"] = values
  kw.update(change)
  if kw["name"] not in ("dr", "wdr") and "values" not in change:
    kw.pop("values")
  with pytest.raises(ValueError) as info:
    ope.estimate(**kw)
  message = str(info.value)
  assert message.startswith(f"{field}: ") and "\n" not in message, message
  if field == "name":
    assert "did you mean 'wis'?" in message
  if field == "behavior_logp" and change[field] is None:
    assert "off-policy evaluation" in message and "replay buffer" in message
