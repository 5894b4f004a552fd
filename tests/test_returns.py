"""Tests for offpolicy_jax.returns: rlax, a float64 reference, invariances, bad arguments.

`rlax` works per sequence of shape [T]: it checks full-length rows (vmapped,
one jitted program per estimator, the hyper-parameters traced). The float64
reference is written per row with plain loops over the valid tokens, from the
papers' direct sums rather than the recursions, on ragged rows with holes and
NaN on masked positions. The estimators run eagerly (their scans are traced
once per shape); `test_jit_equals_eager` covers the jitted path.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import returns

INF = math.inf
GAMMAS = (0.9, 1.0)
LAMS = (0.0, 0.5, 0.95, 1.0)
B, T = 6, 12


def _mask() -> np.ndarray:
  """Ragged rows: full, empty, short, holes, a masked start (multi-turn), one token."""
  m = np.zeros((B, T), np.float32)
  m[0] = 1
  m[2, :5] = 1
  m[3, [0, 1, 4, 5, 6, 9]] = 1
  m[4, 2:5], m[4, 7:10], m[4, 11] = 1, 1, 1
  m[5, 6] = 1
  return m


def _data(seed: int, mask: np.ndarray) -> dict[str, np.ndarray]:
  """Random float32 inputs of the mask's shape, NaN on masked positions."""
  rng = np.random.default_rng(seed)
  shape = mask.shape
  r = rng.normal(size=shape) * (rng.random(shape) < 0.4)
  x = {
    "rewards": r,
    "values": rng.normal(size=shape),
    "q_values": rng.normal(size=shape),
    "log_rhos": rng.normal(scale=0.8, size=shape),
  }
  x = {k: np.where(mask > 0, v, np.nan).astype(np.float32) for k, v in x.items()}
  x["bootstrap_value"] = rng.normal(size=shape[:1]).astype(np.float32)
  return x


# --- float64 reference: one row at a time, over its valid tokens ---------------


def _ref_gae(r, v, boot, gamma, lam):
  n, ve = len(r), np.append(v, boot)
  delta = [r[k] + gamma * ve[k + 1] - v[k] for k in range(n)]
  adv = np.array([sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n)) for t in range(n)])
  return adv, adv + v


def _ref_lambda_returns(r, v, boot, gamma, lam):
  """The lambda-weighted mix of n-step returns; the full return takes the remaining weight."""
  n, ve = len(r), np.append(v, boot)
  out = []
  for t in range(n):

    def n_step(m, t=t):
      return sum(gamma**i * r[t + i] for i in range(m)) + gamma**m * ve[t + m]

    last = n - t
    g = sum((1 - lam) * lam ** (m - 1) * n_step(m) for m in range(1, last))
    out.append(g + lam ** (last - 1) * n_step(last))
  return (np.array(out),)


def _ref_vtrace(r, v, log_rho, boot, gamma, lam, rho_bar, c_bar, pg_rho_bar):
  n, ve, rho = len(r), np.append(v, boot), np.exp(log_rho)
  c = lam * np.minimum(c_bar, rho)
  delta = [np.minimum(rho_bar, rho[k]) * (r[k] + gamma * ve[k + 1] - v[k]) for k in range(n)]
  vs = np.array(
    [
      v[s] + sum(gamma ** (t - s) * np.prod(c[s:t]) * delta[t] for t in range(s, n))
      for s in range(n)
    ]
  )
  vse = np.append(vs, boot)
  pg = np.array(
    [np.minimum(pg_rho_bar, rho[s]) * (r[s] + gamma * vse[s + 1] - v[s]) for s in range(n)]
  )
  return vs, pg


def _ref_retrace(r, q, v, log_rho, boot, gamma, lam):
  n, ve = len(r), np.append(v, boot)
  c = lam * np.minimum(1.0, np.exp(log_rho))
  err = [r[t] + gamma * ve[t + 1] - q[t] for t in range(n)]
  g = [
    q[s] + sum(gamma ** (t - s) * np.prod(c[s + 1 : t + 1]) * err[t] for t in range(s, n))
    for s in range(n)
  ]
  return (np.array(g),)


def _per_row(ref, mask, boot, *arrays, **kw):
  """Runs `ref(*compact rows, boot, **kw)` on each row's valid tokens; 0 elsewhere."""
  outs = None
  for b in range(mask.shape[0]):
    idx = np.flatnonzero(mask[b])
    row = ref(*(np.float64(a[b, idx]) for a in arrays), float(boot[b]), **kw)
    if outs is None:
      outs = [np.zeros(mask.shape) for _ in row]
    for o, x in zip(outs, row, strict=True):
      o[b, idx] = x
  return outs


def _close(got, want, what=""):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5, err_msg=what)


# --- (b) the float64 reference on ragged rows, every setting -------------------


@pytest.mark.parametrize("with_boot", [False, True])
def test_gae_and_lambda_returns_match_float64_reference(with_boot):
  mask = _mask()
  x = _data(0, mask)
  r, v = x["rewards"], x["values"]
  boot = x["bootstrap_value"] if with_boot else np.zeros(B)
  kw = {"bootstrap_value": x["bootstrap_value"]} if with_boot else {}
  for gamma, lam in itertools.product(GAMMAS, LAMS):
    what = f"gamma={gamma} lam={lam}"
    adv, ret = returns.gae(r, v, mask, gamma=gamma, lam=lam, **kw)
    want = _per_row(_ref_gae, mask, boot, r, v, gamma=gamma, lam=lam)
    _close(adv, want[0], what)
    _close(ret, want[1], what)
    g = returns.lambda_returns(r, v, mask, gamma=gamma, lam=lam, **kw)
    _close(g, _per_row(_ref_lambda_returns, mask, boot, r, v, gamma=gamma, lam=lam)[0], what)


def test_vtrace_matches_float64_reference():
  mask = _mask()
  x = _data(1, mask)
  r, v, lr, boot = x["rewards"], x["values"], x["log_rhos"], x["bootstrap_value"]
  truncations = [(rb, cb) for rb in (0.5, 1.0, 2.0, INF) for cb in (0.5, 1.0, 2.0, INF) if rb >= cb]
  for (rho_bar, c_bar), pg_rho_bar, gamma, lam in itertools.product(
    truncations, (None, 1.0), GAMMAS, LAMS
  ):
    kw = dict(gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
    out = returns.vtrace(r, v, mask, lr, pg_rho_bar=pg_rho_bar, bootstrap_value=boot, **kw)
    pg_bar = rho_bar if pg_rho_bar is None else pg_rho_bar
    want = _per_row(_ref_vtrace, mask, boot, r, v, lr, pg_rho_bar=pg_bar, **kw)
    _close(out.vs, want[0], f"vs {kw} pg_rho_bar={pg_rho_bar}")
    _close(out.pg_advantages, want[1], f"pg {kw} pg_rho_bar={pg_rho_bar}")


def test_retrace_matches_float64_reference():
  mask = _mask()
  x = _data(2, mask)
  r, q, v, lr, boot = (
    x[k] for k in ("rewards", "q_values", "values", "log_rhos", "bootstrap_value")
  )
  for gamma, lam in itertools.product(GAMMAS, LAMS):
    g = returns.retrace(r, q, v, mask, lr, gamma=gamma, lam=lam, bootstrap_value=boot)
    want = _per_row(_ref_retrace, mask, boot, r, q, v, lr, gamma=gamma, lam=lam)
    _close(g, want[0], f"gamma={gamma} lam={lam}")


# --- (a) rlax on full-length rows, every truncation setting --------------------


def _rlax():
  return pytest.importorskip("rlax", reason="rlax (the test extra) checks the estimators")


def _full(seed: int, rows: int = 3) -> dict[str, np.ndarray]:
  return _data(seed, np.ones((rows, T), np.float32))


def _rows_jit(fn):
  """Jitted over rows; the hyper-parameters (trailing arguments) are traced scalars."""
  return jax.jit(jax.vmap(fn, in_axes=(0, 0, 0, 0, 0) + (None,) * 5))


def test_gae_and_lambda_returns_match_rlax():
  rlax = _rlax()

  def both(r, v, q, log_rho, boot, gamma, lam, *_):
    disc = jnp.full_like(r, gamma)
    v_next = jnp.append(v[1:], boot)
    adv = rlax.truncated_generalized_advantage_estimation(r, disc, lam, jnp.append(v, boot))
    return adv, rlax.lambda_returns(r, disc, v_next, lam)

  x = _full(3)
  args = [x[k] for k in ("rewards", "values", "q_values", "log_rhos", "bootstrap_value")]
  ref = _rows_jit(both)
  mask = np.ones_like(x["rewards"])
  for gamma, lam in itertools.product(GAMMAS, LAMS):
    want_adv, want_g = ref(*args, gamma, lam, 0.0, 0.0, 0.0)
    kw = dict(gamma=gamma, lam=lam, bootstrap_value=x["bootstrap_value"])
    adv, _ = returns.gae(x["rewards"], x["values"], mask, **kw)
    _close(adv, want_adv, f"gae gamma={gamma} lam={lam}")
    _close(returns.lambda_returns(x["rewards"], x["values"], mask, **kw), want_g, f"{kw}")


def test_vtrace_matches_rlax():
  """rlax's traces are `lam min(1, rho)`: c_bar = 1; rho_bar and the pg truncation vary.

  For `lam < 1` rlax bootstraps the pg advantage on `lam vs' + (1 - lam) V'`, the
  paper (and `returns.vtrace`) on `vs'`: the two differ by
  `min(pg_rho_bar, rho) gamma (1 - lam) (vs' - V')`, and equal at `lam = 1`.
  """
  rlax = _rlax()

  def vt(r, v, q, log_rho, boot, gamma, lam, rho_bar, pg_rho_bar, _):
    v_t, disc, rho = jnp.append(v[1:], boot), jnp.full_like(r, gamma), jnp.exp(log_rho)
    bars = {"clip_rho_threshold": rho_bar, "clip_pg_rho_threshold": pg_rho_bar}
    out = rlax.vtrace_td_error_and_advantage(v, v_t, r, disc, rho, lam, **bars)
    return out.errors + v, out.pg_advantage

  x = _full(4)
  args = [x[k] for k in ("rewards", "values", "q_values", "log_rhos", "bootstrap_value")]
  ref = _rows_jit(vt)
  mask = np.ones_like(x["rewards"])
  bars = (1.0, 2.0, INF)
  for rho_bar, pg_rho_bar, gamma, lam in itertools.product(bars, bars, GAMMAS, LAMS):
    want_vs, want_pg = ref(*args, gamma, lam, rho_bar, pg_rho_bar, 0.0)
    kw = dict(gamma=gamma, lam=lam, rho_bar=rho_bar, pg_rho_bar=pg_rho_bar)
    out = returns.vtrace(*args[:2], mask, args[3], bootstrap_value=args[4], **kw)
    what = f"gamma={gamma} lam={lam} rho_bar={rho_bar} pg_rho_bar={pg_rho_bar}"
    _close(out.vs, want_vs, what)
    gap = np.append(out.vs - x["values"], np.zeros((3, 1)), axis=1)[:, 1:]
    weight = np.minimum(pg_rho_bar, np.exp(x["log_rhos"]))
    _close(out.pg_advantages - weight * gamma * (1 - lam) * gap, want_pg, what)


def test_retrace_matches_rlax():
  rlax = _rlax()

  def rt(r, v, q, log_rho, boot, gamma, lam, *_):
    v_t = jnp.append(v[1:], boot)
    disc = jnp.full_like(r, gamma)
    return rlax.retrace_continuous(q, q[1:], v_t, r, disc, log_rho[1:], lam) + q

  x = _full(5)
  args = [x[k] for k in ("rewards", "values", "q_values", "log_rhos", "bootstrap_value")]
  ref = _rows_jit(rt)
  mask = np.ones_like(x["rewards"])
  for gamma, lam in itertools.product(GAMMAS, LAMS):
    r, v, q, lr, boot = args
    g = returns.retrace(r, q, v, mask, lr, gamma=gamma, lam=lam, bootstrap_value=boot)
    _close(g, ref(*args, gamma, lam, 0.0, 0.0, 0.0), f"gamma={gamma} lam={lam}")


# --- (c) invariances and identities ---------------------------------------------


def _all(x, mask):
  """Every estimator's outputs, stacked: [7, B, T]."""
  boot = {"bootstrap_value": x["bootstrap_value"]}
  r, v, q, lr = x["rewards"], x["values"], x["q_values"], x["log_rhos"]
  return jnp.stack(
    [
      *returns.gae(r, v, mask, gamma=0.9, lam=0.8, **boot),
      returns.lambda_returns(r, v, mask, gamma=0.9, lam=0.8, **boot),
      *returns.vtrace(r, v, mask, lr, gamma=0.9, lam=0.8, rho_bar=2.0, c_bar=1.0, **boot),
      returns.retrace(r, q, v, mask, lr, gamma=0.9, lam=0.8, **boot),
      returns.token_rewards(x["bootstrap_value"], mask),
    ]
  )


def test_inserting_masked_tokens_changes_no_valid_output():
  rng = np.random.default_rng(6)
  length, width = 7, 12
  x = _full(6, rows=4)
  x = {k: (v[:, :length] if v.ndim == 2 else v) for k, v in x.items()}
  want = _all(x, np.ones((4, length), np.float32))
  mask = np.zeros((4, width), np.float32)
  spread = {k: np.full((4, width), np.nan, np.float32) for k in x if k != "bootstrap_value"}
  for b in range(4):
    pos = np.sort(rng.choice(width, length, replace=False))
    mask[b, pos] = 1
    for k, v in spread.items():
      v[b, pos] = x[k][b]
  got = np.asarray(_all({**spread, "bootstrap_value": x["bootstrap_value"]}, mask))
  assert not np.isnan(got).any()
  np.testing.assert_array_equal(got[:, mask == 0], 0.0)
  for b in range(4):
    np.testing.assert_allclose(got[:, b, mask[b] > 0], want[:, b], rtol=1e-6, atol=1e-6)


def test_gae_returns_are_lambda_returns_and_lam_one_zero_values_is_return_to_go():
  mask = _mask()
  x = _data(7, mask)
  for gamma, lam in itertools.product(GAMMAS, LAMS):
    _, ret = returns.gae(x["rewards"], x["values"], mask, gamma=gamma, lam=lam)
    _close(ret, returns.lambda_returns(x["rewards"], x["values"], mask, gamma=gamma, lam=lam))
  zeros = np.zeros_like(mask)
  adv, _ = returns.gae(x["rewards"], zeros, mask, gamma=0.9, lam=1.0)
  want = np.zeros(mask.shape)
  for b in range(B):
    idx = np.flatnonzero(mask[b])
    r = np.float64(x["rewards"][b, idx])
    want[b, idx] = [sum(0.9**k * rr for k, rr in enumerate(r[t:])) for t in range(len(idx))]
  _close(adv, want)


def test_on_policy_vtrace_is_lambda_returns():
  """log_rhos = 0 and rho_bar, c_bar >= 1: every weight is 1 and every trace lam."""
  mask = _mask()
  x = _data(8, mask)
  zeros = np.zeros_like(mask)
  boot = {"bootstrap_value": x["bootstrap_value"]}
  for lam, (rho_bar, c_bar) in itertools.product(LAMS, [(1.0, 1.0), (2.0, 1.0), (INF, INF)]):
    kw = dict(gamma=0.9, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
    out = returns.vtrace(x["rewards"], x["values"], mask, zeros, **kw, **boot)
    g = returns.lambda_returns(x["rewards"], x["values"], mask, gamma=0.9, lam=lam, **boot)
    _close(out.vs, g, f"lam={lam} rho_bar={rho_bar} c_bar={c_bar}")
    if lam == 1.0:
      adv, _ = returns.gae(x["rewards"], x["values"], mask, gamma=0.9, lam=1.0, **boot)
      _close(out.pg_advantages, adv)


def test_retrace_special_cases():
  """Q = V with rho >= 1: lambda-returns; lam = 0: the expected-SARSA target r + gamma V'."""
  mask = _mask()
  x = _data(9, mask)
  r, v, q = x["rewards"], x["values"], x["q_values"]
  boot = {"bootstrap_value": x["bootstrap_value"]}
  up = np.abs(x["log_rhos"])
  for lam in LAMS:
    g = returns.retrace(r, v, v, mask, up, gamma=0.9, lam=lam, **boot)
    _close(g, returns.lambda_returns(r, v, mask, gamma=0.9, lam=lam, **boot), f"lam={lam}")
  g0 = returns.retrace(r, q, v, mask, x["log_rhos"], gamma=0.9, lam=0.0, **boot)
  _close(g0, returns.lambda_returns(r, v, mask, gamma=0.9, lam=0.0, **boot))


def test_jit_equals_eager():
  mask = _mask()
  x = _data(10, mask)
  np.testing.assert_allclose(jax.jit(_all)(x, mask), _all(x, mask), rtol=1e-6, atol=1e-6)


# --- rewards per token --------------------------------------------------------


def test_token_rewards_terminal_and_per_turn():
  mask = np.array([[1, 1, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], np.float32)
  terminal = returns.token_rewards(np.array([2.0, 3.0, 4.0]), mask)
  np.testing.assert_array_equal(terminal, [[0, 0, 0, 0, 2, 0], [0, 3, 0, 0, 0, 0], [0] * 6])
  turns = np.array([[1.0, 5.0], [7.0, np.nan], [1.0, 1.0]])
  np.testing.assert_array_equal(
    returns.token_rewards(turns, mask), [[0, 1, 0, 0, 5, 0], [0, 7, 0, 0, 0, 0], [0] * 6]
  )
  one_turn = returns.token_rewards(np.array([[9.0], [8.0], [0.0]]), mask)
  np.testing.assert_array_equal(one_turn[0], [0, 9, 0, 0, 0, 0])  # turn 1 beyond J pays 0


def test_kl_penalized_rewards():
  mask = _mask()
  x = _data(11, mask)
  logp, ref = x["log_rhos"], x["values"]
  got = returns.kl_penalized_rewards(x["rewards"], logp, ref, mask, 0.1)
  want = np.where(mask > 0, np.float64(x["rewards"]) - 0.1 * (np.float64(logp) - ref), 0.0)
  _close(got, want)
  grad = jax.grad(lambda lp: returns.kl_penalized_rewards(x["rewards"], lp, ref, mask, 0.1).sum())
  np.testing.assert_array_equal(grad(jnp.nan_to_num(logp)), 0.0)


# --- (d) bad arguments ----------------------------------------------------------


def _bad_calls():
  mask = np.ones((2, 4), np.float32)
  z = np.zeros((2, 4), np.float32)
  gae = functools.partial(returns.gae, z, z, mask, gamma=0.9, lam=0.9)
  vt = functools.partial(returns.vtrace, z, z, mask, z, gamma=0.9)
  rt = functools.partial(returns.retrace, z, z, z, mask, z, gamma=0.9, lam=0.9)
  calls = [
    ("gamma", lambda: returns.gae(z, z, mask, gamma=1.5, lam=0.9)),
    ("gamma", lambda: returns.lambda_returns(z, z, mask, gamma=-0.1, lam=0.9)),
    ("gamma", lambda: returns.vtrace(z, z, mask, z, gamma=math.nan)),
    ("lam", lambda: returns.gae(z, z, mask, gamma=0.9, lam=1.01)),
    ("lam", lambda: returns.retrace(z, z, z, mask, z, gamma=0.9, lam=-1.0)),
    ("lam", lambda: vt(lam=2.0)),
    ("rho_bar", lambda: vt(rho_bar=0.5, c_bar=1.0)),
    ("c_bar", lambda: vt(rho_bar=1.0, c_bar=0.0)),
    ("pg_rho_bar", lambda: vt(pg_rho_bar=0.0)),
    ("rewards", lambda: returns.gae(z[0], z, mask, gamma=0.9, lam=0.9)),
    ("values", lambda: returns.gae(z, z[:, :3], mask, gamma=0.9, lam=0.9)),
    ("mask", lambda: returns.gae(z, z, mask[:1], gamma=0.9, lam=0.9)),
    ("mask", lambda: returns.gae(z, z, mask * 0.5, gamma=0.9, lam=0.9)),
    ("log_rhos", lambda: returns.vtrace(z, z, mask, z.T, gamma=0.9)),
    ("q_values", lambda: returns.retrace(z, z[:1], z, mask, z, gamma=0.9, lam=0.9)),
    ("bootstrap_value", lambda: gae(bootstrap_value=np.zeros(3))),
    ("bootstrap_value", lambda: rt(bootstrap_value=np.zeros((2, 1)))),
    ("rewards", lambda: returns.token_rewards(np.zeros(3), mask)),
    ("coef", lambda: returns.kl_penalized_rewards(z, z, z, mask, -0.1)),
    ("gamma", lambda: jax.jit(lambda g: returns.gae(z, z, mask, gamma=g, lam=0.9))(0.9)),
  ]
  return [pytest.param(name, call, id=f"{name}-{i}") for i, (name, call) in enumerate(calls)]


@pytest.mark.parametrize("name,call", _bad_calls())
def test_bad_arguments_raise_naming_the_argument(name, call):
  with pytest.raises(ValueError, match=f"^{name}: "):
    call()
