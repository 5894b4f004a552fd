"""Tests for offpolicy_jax.losses against an independent float64 numpy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import advantages, losses

# ---------------------------------------------------------------------------
# Golden data: every row / token chosen so that each preset sees A > 0 and
# A < 0 tokens (and sequences) below, inside and above its ratio band.
# ---------------------------------------------------------------------------
X = np.nan  # padding position (never read by the reference)
_D = np.array(
  [
    [-1.5, -0.5, -0.1, 0.0, 0.1, 0.6],
    [-1.5, -0.5, -0.1, 0.02, 0.1, 0.6],
    [1e-4, -1e-4, 0.0, 0.0, 2e-4, X],
    [1.2, 0.3, 2.0, X, X, X],
    [-2.2, -1.0, -0.3, 0.25, 1.7, 0.05],
    [1.0, 1.3, 1.6, -0.05, -1.2, 0.15],
    [0.5, 0.8, -0.2, 0.3, X, X],
    [2e-4, -1e-4, 0.0, X, X, X],
    [X, X, X, X, X, X],
  ]
)
ADV = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5, -1.0, 1.0])
MASK = (~np.isnan(_D)).astype(np.float64)
D = np.nan_to_num(_D)
MU = np.random.default_rng(0).uniform(-4.0, -2.5, D.shape)
PROX = MU + np.random.default_rng(1).uniform(-0.3, 0.3, D.shape)
LOGP = MU + D
GARBAGE = 3.0  # value placed at padding positions of every input


def _pad(x):
  return np.where(MASK > 0, x, GARBAGE).astype(np.float32)


INPUTS = dict(
  logp=_pad(LOGP),
  behavior_logp=_pad(MU),
  advantages=ADV.astype(np.float32),
  mask=MASK.astype(np.float32),
)


# ---------------------------------------------------------------------------
# Independent numpy reference: per-token value and d value / d logp.
# ---------------------------------------------------------------------------
A_BT = np.broadcast_to(ADV[:, None], D.shape)


def _ppo(r, a, lo, hi, dual=None):
  clipped = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
  val = np.where(clipped, -a * np.clip(r, lo, hi), -a * r)
  coef = np.where(clipped, 0.0, -a * r)
  if dual is not None:
    d = (a < 0) & (r > dual)
    val, coef = np.where(d, -dual * a, val), np.where(d, 0.0, coef)
  return val, coef


def _rec(r, a, lp, kind, is_weight, lo=0.8, hi=1.2, lo2=0.4, hi2=3.0):
  inner = (r >= lo) & (r <= hi)
  if kind == "one":
    keep = np.where(a > 0, r <= hi, True) & np.where(a < 0, r >= lo, True)
  elif kind == "two":
    keep = inner
  else:
    keep = inner | ((a >= 0) & (r <= lo2)) | ((a <= 0) & (r >= hi2))
  w = (r if is_weight else 1.0) * keep
  return -a * w * lp, -a * w


def _weighted(w, a, lp):
  return -a * w * lp, -a * w


def _m2po_keep(d, m, budget=0.04):
  # Largest threshold (a data value) whose kept set {v <= thr} is within budget.
  v = (d**2)[m > 0]
  if v.mean() <= budget:
    return np.ones_like(d, bool)
  ok = [t for t in np.unique(v) if v[v <= t].mean() <= budget]
  return d**2 <= (max(ok) if ok else -1.0)


def _m2po_capped_tau(d, a, m, budget=0.04):
  # The released M2PO's tau: mean over harmful tokens of min(d^2, tau^2) equal to the budget.
  harm = (m > 0) & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))
  v = np.sort((d**2)[harm])
  if v.size == 0 or v.mean() <= budget:
    return np.inf
  s, target = 0.0, budget * v.size
  for k in range(v.size):  # the values from k on capped at t: s + t (n - k) = target
    t = (target - s) / (v.size - k)
    if t <= v[k]:
      return np.sqrt(t)
    s += v[k]
  raise AssertionError("unreachable: the mean exceeds the budget")


def _bapo_bounds(r, a, m):
  lo, hi = 0.6, 1.2
  while True:
    p = np.sum((a > 0) * (r <= hi) * a * r * m)
    n = np.sum((a < 0) * (r >= lo) * -a * r * m)
    if p / (p + n) >= 0.4 or (lo >= 0.8 - 1e-9 and hi >= 2.0 - 1e-9):
      return lo, hi
    lo, hi = min(lo + 0.05, 0.8), min(hi + 0.2, 2.0)


def _cov_selected(lp, a, m, frac):
  n = m.sum()
  cov = (lp - (lp * m).sum() / n) * (a - (a * m).sum() / n)
  cov = np.where(m > 0, cov, -np.inf)
  k = int(np.ceil(frac * n))
  thr = np.sort(cov.ravel())[::-1][k - 1]
  return (cov >= thr) & (cov > 0) & (m > 0)


# Rollout-correction presets whose weight reads the whole row.
SEQ_CORRECTIONS = ("tis_seq", "mis_seq", "mis_geo", "tr_mask_k3", "tr_mask_k1")


def correction_ref(name, lw, m):
  """A correction preset's ``(weight, dropped, truncated)`` [B, T] from ``lw = log(pi_x / mu)``.

  docs/science.md s7, written out per preset: TIS ``min(w, 2)`` (token, or the
  row's ``exp(sum lw)`` on every token); IcePop / MIS ``w`` inside
  ``[lo, hi]``, else 0; MIS min/max rule (row dropped if any ``w_t`` leaves
  ``[0.125, 8]``); geometric band ``[0.999, 1.001]`` plus veto ``w_t < 1e-4``
  (weight 1); trust-region masking with token weight ``w_t`` (row dropped if
  ``max_t k3 > 0.05`` / ``mean_t k1 > 1e-3``).
  """
  valid = m > 0
  w = np.exp(lw)
  none = np.zeros(lw.shape, bool)
  row = lambda x: np.broadcast_to(np.any(x & valid, axis=-1, keepdims=True), x.shape)
  n = np.maximum(m.sum(-1, keepdims=True), 1.0)
  if name in ("tis_old", "tis_seq"):
    if name == "tis_seq":
      w = np.exp((lw * m).sum(-1, keepdims=True)) + 0 * lw
    return np.minimum(w, 2.0), none, (w > 2.0) & valid
  if name in ("icepop_old", "mis_token"):
    lo, hi = (0.5, 5.0) if name == "icepop_old" else (0.125, 8.0)
    out = ((w < lo) | (w > hi)) & valid
    return np.where(out, 0.0, w), out, none
  if name == "mis_seq":
    out = row((w < 0.125) | (w > 8.0))
  elif name == "mis_geo":
    geo = np.exp((lw * m).sum(-1, keepdims=True) / n) + 0 * lw
    out = (geo < 0.999) | (geo > 1.001) | row(w < 1e-4)
    w = np.ones_like(w)
  elif name == "tr_mask_k3":
    out = np.max(np.where(valid, w - 1 - lw, -np.inf), axis=-1, keepdims=True) > 0.05
  elif name == "tr_mask_k1":
    out = (-lw * m).sum(-1, keepdims=True) / n > 1e-3
  else:
    raise KeyError(name)
  out = np.broadcast_to(out, lw.shape) & valid
  return np.where(out, 0.0, w), out, none


def _dppo_keep(name, lp, mu, a, delta=None):
  """DPPO (Qi et al., arXiv 2602.04879): keep unless the divergence is too large on A's side."""
  p, q = np.exp(lp), np.exp(mu)
  if delta is None:
    delta = 0.15 if name == "dppo_tv" else 0.05
  if name == "dppo_tv":
    return np.where(a > 0, p - q <= delta, True) & np.where(a < 0, q - p <= delta, True)
  with np.errstate(divide="ignore", invalid="ignore"):
    rest = np.where(1 - q > 0, (1 - q) * np.log((1 - q) / (1 - np.minimum(p, 1 - 1e-7))), 0.0)
  small = q * np.log(q / p) + rest <= delta
  return np.where(a > 0, small | (p <= q), True) & np.where(a < 0, small | (p >= q), True)


def _token_ref(name, d, a, lp, m, mu=None, prox=None, old=None):
  """(value, coef) per token for token-local presets (+ batch searches)."""
  r = np.exp(d)
  old = mu if old is None else old
  sig = lambda x: 1.0 / (1.0 + np.exp(-x))
  if name in ("reinforce", "vtrace", "remax"):  # vtrace: the truncated ratio is inside A
    return -a * lp, -a + 0 * lp
  if name in ("rec_critic", "vtrace_rec", "remax_rec"):  # REC-OneSide-NoIS on other advantages
    return _rec(r, a, lp, "one", False)
  if name in ("grpo", "ppo", "ppo_critic", "opsm", "st_ppo"):  # st_ppo: single-token turns only
    return _ppo(r, a, 0.8, 1.2)
  if name == "dual_clip":
    return _ppo(r, a, 0.8, 1.2, dual=3.0)
  if name == "dapo":
    return _ppo(r, a, 0.8, 1.28)
  if name.startswith("rec_"):
    kind = "one" if "oneside" in name else ("two" if "twoside" in name else "ring")
    if name == "rec_oneside_nois_wide":
      return _rec(r, a, lp, "one", False, lo=0.4, hi=3.0)
    return _rec(r, a, lp, kind, name.endswith("_is"))
  if name == "opmd":
    return -a * lp + 0.1 * (lp - mu) ** 2, -a + 0.2 * (lp - mu)
  if name == "asymre":
    return -a * lp - 0.1 * lp, -a - 0.1 + 0 * lp
  if name == "red_weight":
    return _weighted(np.exp(a), a, lp)
  if name == "cispo":
    return _weighted(np.clip(r, 0.0, 1.28), a, lp)
  if name == "dispo":
    return _weighted(np.where(a < 0, np.clip(r, 0.8, 2.0), np.clip(r, 0.0, 1.28)), a, lp)
  if name == "topr":
    return _weighted(np.where(a >= 0, 1.0, np.clip(r, 0.0, 1.0)), a, lp)
  if name == "sapo":
    tau = np.where(a > 0, 1.0, 1.05)
    s = sig(tau * (r - 1.0))
    return -a * s * 4.0 / tau, -a * 4.0 * s * (1.0 - s) * r
  if name == "tis":
    return _weighted(np.minimum(r, 2.0), a, lp)
  if name == "icepop":
    return _weighted(np.where((r >= 0.5) & (r <= 5.0), r, 0.0), a, lp)
  if name in ("tis_old", "icepop_old"):  # c(pi_old / mu) * PPO-clip(pi / pi_old)
    c = correction_ref(name, old - mu, m)[0]
    val, coef = _ppo(np.exp(lp - old), a, 0.8, 1.2)
    return c * val, c * coef
  if name == "mis_token":
    return _weighted(correction_ref(name, d, m)[0], a, lp)
  if name in ("dppo_tv", "dppo_kl"):
    return _weighted(r * _dppo_keep(name, lp, mu, a), a, lp)
  if name == "decoupled_ppo":
    c = np.exp(prox - mu)
    val, coef = _ppo(np.exp(lp - prox), a, 0.8, 1.2)
    return c * val, c * coef
  if name == "m2po":  # thresholds on the float32 log-ratio the library sees
    d32 = (INPUTS["logp"] - INPUTS["behavior_logp"]).astype(np.float64)
    keep = _m2po_keep(np.where(m > 0, d32, 0.0), m)
    return -a * r * keep, -a * r * keep
  if name == "bapo":
    lo, hi = _bapo_bounds(r, a, m)
    return _ppo(r, a, lo, hi)
  if name == "m2po_release":
    d32 = (INPUTS["logp"] - INPUTS["behavior_logp"]).astype(np.float64)
    tau = _m2po_capped_tau(np.where(m > 0, d32, 0.0), a, m)
    return _ppo(r, a, min(np.exp(-tau), 0.7), max(np.exp(tau), 1.5))
  if name == "minpro":
    prefix = np.minimum.accumulate(np.where(m > 0, d, np.inf), axis=-1)
    return _ppo(np.exp(np.where(m > 0, prefix, 0.0)), a, 0.8, 1.2)
  if name == "gbpo":
    target, scale = np.where(a > 0, 1.2, 0.8), np.where(a < 0, 0.2, 0.2)
    return np.abs(a) * (r - target) ** 2 / (2 * scale), np.abs(a) * (r - target) * r / scale
  if name == "mhpo":
    th = np.tanh(d / 0.5)
    up, down = np.maximum(d, 0.0) / np.log(1.2), np.maximum(-d, 0.0) / -np.log(0.8)
    val = -a * np.exp(0.5 * th) + 0.1 * (up**2 + down**2)
    coef = -a * np.exp(0.5 * th) * (1 - th**2) + 0.2 * (up / np.log(1.2) - down / -np.log(0.8))
    return val, coef
  if name == "clip_cov":
    sel = _cov_selected(lp, a, m, 2e-4)
    return -a * r, np.where(sel, 0.0, -a * r)
  if name == "kl_cov":
    sel = _cov_selected(lp, a, m, 2e-3)
    return -a * r + sel * np.abs(lp - mu), -a * r + sel * np.sign(lp - mu)
  raise KeyError(name)


def _gspo_token_ref(d, a_bt, m, lo=1 - 3e-4, hi=1 + 4e-4):
  """GSPO-token (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071).

  Per token ``min(s_it A_it, clip(s_it, lo, hi) A_it)`` with token advantages
  ``A_it`` and ``s_it = sg(s_i) pi_t / sg(pi_t)``: its value is the sequence
  ratio ``s_i = exp(mean_t (l - l_mu))`` and ``d s_it / d l_t' = s_i [t = t']``,
  so an unclipped token's gradient is ``-A_it s_i`` (times 1 / |y_i|).

  Returns:
    (per-sequence token-mean value [B], d value / d logp [B, T]).
  """
  n = np.maximum(m.sum(-1), 1.0)[:, None]
  s = np.exp((d * m).sum(-1, keepdims=True) / n) + 0 * d
  val, coef = _ppo(s, a_bt, lo, hi)
  return (val * m / n).sum(-1), coef * m / n


def _seq_ref(name, d, a_seq, m):
  """(per-sequence value [B], d value / d logp [B, T]) for sequence-level presets."""
  n = np.maximum(m.sum(-1), 1.0)
  if name == "gspo":
    s = np.exp((d * m).sum(-1) / n)
    val, coef = _ppo(s, a_seq, 1 - 3e-4, 1 + 4e-4)
    return val, coef[:, None] / n[:, None] * m
  if name == "gmpo":
    clipped = ((a_seq[:, None] > 0) & (d > 0.4)) | ((a_seq[:, None] < 0) & (d < -0.4))
    dc = np.where(a_seq[:, None] > 0, np.minimum(d, 0.4), np.maximum(d, -0.4))
    s = np.exp((dc * m).sum(-1) / n)
    return -a_seq * s, (-a_seq * s / n)[:, None] * (~clipped) * m
  if name == "oapl":
    err = (d * m).sum(-1) - a_seq
    return 0.5 * err**2, err[:, None] * m
  raise KeyError(name)


SEQ_PRESETS = ("gspo", "gspo_token", "gmpo", "oapl")
# Token-level presets whose paper objective is 1/G sum_i 1/|y_i| sum_t (SAPO,
# arXiv 2511.20347, eq. for J(theta); verl's `sapo` default).
SEQ_MEAN_TOKEN_PRESETS = ("sapo",)


def _turn_ref(d, a_bt, m, turns, lo=0.8, hi=1.2):
  """ST-PPO: PPO clip of every turn's geometric-mean ratio, token-mean (loss, grad)."""
  n = m.sum()
  total, grad = 0.0, np.zeros_like(d)
  for i in range(d.shape[0]):
    for u in np.unique(turns[i][m[i] > 0]):
      sel = (turns[i] == u) & (m[i] > 0)
      val, coef = _ppo(np.exp(d[i, sel].mean()), a_bt[i, sel].mean(), lo, hi)
      total += val * sel.sum()
      grad[i, sel] = coef / n  # d (n_turn * val) / d l_t = coef for each of its tokens
  return total / n, grad


def reference(name, logp=LOGP, mu=MU, adv=ADV, m=MASK, prox=PROX, agg=None, old=None):
  """Full-batch (loss, d loss / d logp) in float64, independent of the library.

  ``adv`` is [B] or [B, T]; ``agg`` (token presets only) overrides the preset's
  aggregation, ``token_mean`` or ``seq_mean_token_mean``; ``old`` is
  ``pi_old`` (None: ``mu``).
  """
  old = np.where(m > 0, mu if old is None else old, 0.0)
  d = np.where(m > 0, logp - mu, 0.0)
  lp = np.where(m > 0, logp, 0.0)
  mu = np.where(m > 0, mu, 0.0)
  a = np.broadcast_to(adv[:, None], d.shape) if adv.ndim == 1 else adv
  n_b = m.sum(-1)
  seqs = n_b > 0
  if name == "st_ppo":
    return _turn_ref(d, a, m, np.zeros(d.shape, int))
  if name == "gspo_token":
    val, grad = _gspo_token_ref(d, a, m)
    return val[seqs].mean(), grad / seqs.sum()
  if name in SEQ_PRESETS:
    a_seq = adv if adv.ndim == 1 else (a * m).sum(-1) / np.maximum(n_b, 1)
    val, grad = _seq_ref(name, d, a_seq, m)
    return val[seqs].mean(), grad / seqs.sum()
  if name in SEQ_CORRECTIONS:
    val, coef = _weighted(correction_ref(name, d, m)[0], a, lp)
  else:
    val, coef = _token_ref(name, d, a, lp, m, mu=mu, prox=np.where(m > 0, prox, 0.0), old=old)
  if name == "opsm":
    drop = (a < 0) & (((mu - lp) * m).sum(-1, keepdims=True) / np.maximum(n_b, 1)[:, None] > 0.1)
    val, coef = val * ~drop, coef * ~drop
  agg = agg or ("seq_mean_token_mean" if name in SEQ_MEAN_TOKEN_PRESETS else "token_mean")
  if agg == "token_mean":
    w = m / m.sum()
  else:  # seq_mean_token_mean: 1/|S| sum_{i in S} 1/n_i sum_t
    w = m / np.maximum(n_b, 1)[:, None] / seqs.sum()
  return (val * w).sum(), coef * w


# ---------------------------------------------------------------------------
# Every preset evaluated in one jitted function per input shape (few compiles).
# ---------------------------------------------------------------------------
AGG_CASES = [(n, agg) for n in ("reinforce", "gspo") for agg in losses.AGG_MODES]
SPECS = {n: losses.get_spec(n) for n in losses.names()}
SPECS.update({f"{n}:{agg}": losses.get_spec(n, agg=agg, max_len=8) for n, agg in AGG_CASES})


def _evaluate(specs, inputs):
  """{key: (LossOutput, d loss / d logp)} for every spec."""
  results = {}
  for key, spec in specs.items():
    kw = dict(inputs)
    logp = kw.pop("logp")
    if not spec.needs_proximal:
      kw.pop("proximal_logp", None)

    def f(lp, spec=spec, kw=kw):
      out = losses.policy_loss(spec, logp=lp, **kw)
      return out.loss, out

    (_, out), grad = jax.value_and_grad(f, has_aux=True)(logp)
    results[key] = (out, grad)
  return results


_evaluate_all = jax.jit(functools.partial(_evaluate, SPECS))
BASE = dict(INPUTS, proximal_logp=_pad(PROX))


def _pad_to(inputs, rows, b=11, t=9):
  """Rows ``rows`` of ``inputs`` in a [b, t] batch; the rest is garbage padding."""
  out = {}
  for i, (k, v) in enumerate(inputs.items()):
    v = np.broadcast_to(v[:, None], MASK.shape) if k == "advantages" else v
    fill = 0.0 if k == "mask" else -7.0 + i
    padded = np.full((b, t), fill, np.float32)
    padded[: len(rows), : v.shape[1]] = v[rows]
    out[k] = padded
  return out


@functools.cache
def results(kind):
  """Per-spec (LossOutput, grad) of: the base batch (jit / eager), and, in one
  vmapped call, the padded batch and three micro-batches of 3 rows each (padded
  to the same [11, 9] shape, advantages given per token)."""
  if kind == "base":
    return _evaluate_all(BASE)
  if kind == "eager":
    return _evaluate({n: SPECS[n] for n in losses.names()}, BASE)
  if kind == "stack":
    batches = [_pad_to(BASE, np.arange(9))]
    batches += [_pad_to(BASE, np.arange(3 * i, 3 * i + 3)) for i in range(3)]
    stacked = {k: np.stack([b[k] for b in batches]) for k in BASE}
    return jax.jit(jax.vmap(functools.partial(_evaluate, SPECS)))(stacked)
  raise KeyError(kind)


def run(name, **inputs):
  """One preset, eagerly, with some inputs replaced."""
  return _evaluate({name: losses.get_spec(name)}, dict(BASE, **inputs))[name]


def _region_counts(lo, hi):
  r = np.exp(D)
  regions = []
  for sign in (A_BT > 0, A_BT < 0):
    for cond in (r < lo, (r >= lo) & (r <= hi), r > hi):
      regions.append(int(np.sum(sign & cond & (MASK > 0))))
  return regions


@pytest.mark.parametrize("name", losses.names())
def test_golden_against_numpy_reference(name):
  """Loss and gradient of every preset match the float64 reference.

  Updated with the reviewer's fixes: ``sapo`` is reduced seq-mean-token-mean
  (``1/G sum_i 1/|y_i| sum_t``, the SAPO paper's objective, arXiv 2511.20347,
  and the reference implementations' default); it used to be token-mean,
  which weights each sequence by its length. The ``gspo_token`` reference
  now keeps token advantages (GSPO-token, arXiv 2507.18071); on these [B]
  advantages it equals ``gspo``, see the ``gspo_token`` tests below for
  advantages that vary inside a sequence.
  """
  out, grad = results("base")[name]
  want_loss, want_grad = reference(name)
  np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-6)
  assert np.all(grad[MASK == 0] == 0)
  assert np.isfinite(float(out.loss))


@pytest.mark.parametrize(
  "band", [(0.8, 1.2), (0.8, 1.28), (0.4, 3.0), (0.5, 5.0), (0.6, 1.2), (0.0 + 1e-9, 2.0)]
)
def test_golden_data_covers_every_mask_region(band):
  # A > 0 / A < 0  x  below / inside / above, for the token bands of the presets.
  counts = _region_counts(*band)
  assert all(c > 0 for c in counts[1:3] + counts[4:]), counts
  if band[0] > 0.01:
    assert counts[0] > 0 and counts[3] > 0, counts


def test_sequence_presets_cover_every_region():
  n = np.maximum(MASK.sum(-1), 1)
  s = np.exp((D * MASK).sum(-1) / n)[MASK.sum(-1) > 0]
  a = ADV[MASK.sum(-1) > 0]
  for sign in (a > 0, a < 0):
    for cond in (s < 1 - 3e-4, (s >= 1 - 3e-4) & (s <= 1 + 4e-4), s > 1 + 4e-4):
      assert np.any(sign & cond)


# ---------------------------------------------------------------------------
# GSPO-token keeps token advantages; SAPO aggregates seq-mean-token-mean.
# ---------------------------------------------------------------------------
# Token advantages that vary, and change sign, inside a sequence.
ADV_TOK = A_BT + np.array([0.0, 0.3, -0.6, 1.2, -2.5, 0.9])


def _loss_and_grad(name, advantages, jit, **overrides):
  """(LossOutput, d loss / d logp) of one preset on the golden batch."""

  def f(lp):
    kw = dict(INPUTS, logp=lp, advantages=np.asarray(advantages, np.float32))
    out = losses.policy_loss(name, **kw, **overrides)
    return out.loss, out

  fn = jax.value_and_grad(f, has_aux=True)
  (_, out), grad = (jax.jit(fn) if jit else fn)(INPUTS["logp"])
  return out, np.asarray(grad, np.float64)


def test_gspo_token_golden_data_covers_every_region():
  # Tokens with A_it > 0 and A_it < 0 meet s_i below, inside and above the band.
  n = np.maximum(MASK.sum(-1), 1.0)[:, None]
  s = np.exp((D * MASK).sum(-1, keepdims=True) / n) + 0 * D
  valid = MASK > 0
  for sign in (ADV_TOK > 0, ADV_TOK < 0):
    for cond in (s < 1 - 3e-4, (s >= 1 - 3e-4) & (s <= 1 + 4e-4), s > 1 + 4e-4):
      assert np.any(sign & cond & valid)
  for i in np.flatnonzero(MASK.sum(-1) > 0):  # advantages really vary per sequence
    assert np.ptp(ADV_TOK[i, valid[i]]) > 0.5


@pytest.mark.parametrize("jit", [False, True])
def test_gspo_token_keeps_token_advantages(jit):
  """GSPO-token's gradient on token t is -A_it s_i / (|y_i| G), not the sequence mean.

  Zheng et al., arXiv 2507.18071, GSPO-token: ``s_it = sg(s_i) pi_t / sg(pi_t)``
  with per-token advantages ``A_it``, clipped per token by the sign of ``A_it``.
  """
  out, grad = _loss_and_grad("gspo_token", ADV_TOK, jit)
  want_loss, want_grad = reference("gspo_token", adv=ADV_TOK)
  np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
  # Unclipped tokens: grad / A_it is one constant per sequence, -s_i / (|y_i| G).
  n_b = MASK.sum(-1)
  s = np.exp((D * MASK).sum(-1) / np.maximum(n_b, 1))[:, None] + 0 * D
  clipped = ((ADV_TOK > 0) & (s > 1 + 4e-4)) | ((ADV_TOK < 0) & (s < 1 - 3e-4))
  free = (MASK > 0) & ~clipped
  per_seq = -s / np.maximum(n_b, 1)[:, None] / np.sum(n_b > 0)
  np.testing.assert_allclose(grad[free] / ADV_TOK[free], per_seq[free], rtol=2e-5)
  assert np.all(grad[clipped | (MASK == 0)] == 0)
  # The old behaviour (sequence-mean advantage, i.e. gspo) gives another gradient.
  _, grad_seq_mean = _loss_and_grad("gspo", ADV_TOK, jit)
  assert np.max(np.abs(grad - grad_seq_mean)) > 1e-2


@pytest.mark.parametrize("jit", [False, True])
def test_gspo_token_with_sequence_advantages_equals_gspo(jit):
  # A_it = A_i: GSPO-token reduces to GSPO exactly (value and gradient), [B] or [B, T].
  want_loss, want_grad = reference("gspo")
  for adv in (ADV, A_BT):
    out_t, grad_t = _loss_and_grad("gspo_token", adv, jit)
    out_s, grad_s = _loss_and_grad("gspo", adv, jit)
    np.testing.assert_allclose(out_t.loss, out_s.loss, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grad_t, grad_s, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(out_t.loss, want_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad_t, want_grad, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(out_t.metrics["clip_frac"], out_s.metrics["clip_frac"])


@pytest.mark.parametrize("jit", [False, True])
def test_sapo_default_aggregation_is_seq_mean_token_mean(jit):
  """SAPO (Gao et al., arXiv 2511.20347): J = E[1/G sum_i 1/|y_i| sum_t f(r_it) A_it]."""
  assert losses.get_spec("sapo").agg == "seq_mean_token_mean"
  lengths = MASK.sum(-1)[MASK.sum(-1) > 0]
  assert len(set(lengths)) > 1  # sequences of unequal length tell the two apart
  for adv in (ADV, ADV_TOK):
    default, grad = _loss_and_grad("sapo", adv, jit)
    explicit, grad_e = _loss_and_grad("sapo", adv, jit, agg="seq_mean_token_mean")
    token, grad_tok = _loss_and_grad("sapo", adv, jit, agg="token_mean")
    np.testing.assert_allclose(default.loss, explicit.loss, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grad, grad_e, rtol=1e-6, atol=1e-9)
    assert float(default.loss_count) == len(lengths)
    for agg, out, g in (("seq_mean_token_mean", default, grad), ("token_mean", token, grad_tok)):
      want_loss, want_grad = reference("sapo", adv=adv, agg=agg)
      np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6, err_msg=agg)
      np.testing.assert_allclose(g, want_grad, rtol=2e-5, atol=1e-7, err_msg=agg)
    assert abs(float(default.loss) - float(token.loss)) > 1e-2
    assert np.max(np.abs(grad - grad_tok)) > 1e-3


def test_presets_cover_design_contract():
  required = (
    "reinforce grpo ppo dual_clip rec_oneside_is rec_oneside_nois rec_twoside_is "
    "rec_twoside_nois rec_ring_is rec_ring_nois opmd asymre red_weight cispo dispo gspo "
    "gspo_token gmpo topr sapo tis icepop decoupled_ppo m2po bapo minpro oapl opsm clip_cov "
    "kl_cov dapo rec_oneside_nois_wide gbpo mhpo st_ppo tis_seq tis_old icepop_old mis_token "
    "mis_seq mis_geo tr_mask_k3 tr_mask_k1 dppo_tv dppo_kl"
  ).split()
  assert set(required) <= set(losses.names())
  for name in losses.names():
    spec = losses.get_spec(name)
    assert hash(spec) == hash(losses.get_spec(name))
    assert losses.describe(name)


def test_shaping_table_covers_every_spec_value():
  choices = losses.spec._CHOICES
  assert set(losses.shaping.SHAPINGS) == set(choices["shaping"])
  assert set(losses.shaping.MASKS) == set(choices["mask_kind"])
  assert set(losses.core._REGULARISERS) == set(choices["reg"]) - {"none"}
  for fn in [*losses.shaping.SHAPINGS.values(), *losses.shaping.MASKS.values()]:
    assert "arXiv" in fn.__doc__ or "reconstruction" in fn.__doc__ or fn.__name__ == "none"


def test_every_preset_has_a_known_default_advantage():
  for name in losses.names():
    assert losses.default_advantage(name) in advantages.names(), name
  assert losses.default_advantage("grpo") == "grpo"
  assert losses.default_advantage("rec_oneside_nois") == "group_mean"
  assert losses.default_advantage("oapl") == "opmd"
  with pytest.raises(ValueError, match="no_such_loss"):
    losses.default_advantage("no_such_loss")
  with pytest.raises(ValueError, match="advantage 'nope'"):
    losses.register("test_bad_advantage", losses.LossSpec(), advantage="nope")
  assert "test_bad_advantage" not in losses.names()


@pytest.mark.parametrize("jit", [False, True])
def test_infinite_sequence_weight_is_capped_not_nan(jit):
  # A valid token with behaviour log-prob -inf makes its row's sequence IS
  # log-weight +inf; broadcasting it over the row must keep inf (0 * inf would
  # be NaN), so TIS caps the row's weight at C.
  mu = INPUTS["behavior_logp"].copy()
  mu[0, 2] = -np.inf
  inputs = dict(INPUTS, behavior_logp=mu)

  def loss_fn(lp):
    return losses.policy_loss("tis", correction_level="seq", **dict(inputs, logp=lp)).loss

  f = jax.jit(jax.value_and_grad(loss_fn)) if jit else jax.value_and_grad(loss_fn)
  loss, grad = f(INPUTS["logp"])
  log_w = np.sum((LOGP - np.where(MASK > 0, MU, 0.0)) * MASK, axis=-1)
  w = np.minimum(np.exp(np.where(np.arange(len(ADV)) == 0, np.inf, log_w)), 2.0)
  coef = -A_BT * w[:, None] * MASK / MASK.sum()
  np.testing.assert_allclose(loss, np.sum(coef * np.where(MASK > 0, LOGP, 0.0)), atol=1e-6)
  np.testing.assert_allclose(grad, coef, rtol=1e-5, atol=1e-7)


def test_regularisers_kl_and_entropy_bonus():
  rng = np.random.default_rng(3)
  ref = _pad(MU + rng.normal(0, 0.3, D.shape))
  ent = _pad(rng.uniform(0.5, 2.0, D.shape))
  spec = losses.get_spec("reinforce", kl_coef=0.05, kl_kind="k3", entropy_coef=0.01)
  assert spec.needs_ref

  def f(logp, entropy):
    kw = dict(INPUTS, logp=logp, ref_logp=ref, entropy=entropy)
    return losses.policy_loss(spec, **kw).loss

  loss, (g_logp, g_ent) = jax.value_and_grad(f, argnums=(0, 1))(INPUTS["logp"], ent)
  dref = np.where(MASK > 0, LOGP - ref, 0.0)
  val = -A_BT * LOGP + 0.05 * (np.exp(-dref) - 1 + dref) - 0.01 * ent
  coef = -A_BT + 0.05 * (1 - np.exp(-dref))
  n = MASK.sum()
  np.testing.assert_allclose(loss, (val * MASK).sum() / n, rtol=2e-5)
  np.testing.assert_allclose(g_logp, coef * MASK / n, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(g_ent, -0.01 * MASK / n, rtol=2e-5, atol=1e-9)


# ---------------------------------------------------------------------------
# Invariances.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_padding_and_token_advantages_invariance(name):
  # Extra padding rows / columns (garbage values) and [B, T] advantages change nothing.
  out, grad = results("base")[name]
  out_p, grad_p = jax.tree.map(lambda x: x[0], results("stack")[name])
  np.testing.assert_allclose(out_p.loss, out.loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad_p[:9, :6], grad, rtol=1e-5, atol=1e-8)
  assert np.all(grad_p[9:] == 0) and np.all(grad_p[:, 6:] == 0)


@pytest.mark.parametrize("name", [k for k, s in SPECS.items() if not s.batch_dependent])
def test_micro_batch_accumulation_equals_full_batch(name):
  out, grad = results("base")[name]
  parts, part_grads = jax.tree.map(lambda x: x[1:], results("stack")[name])
  total_count = np.sum(parts.loss_count)
  np.testing.assert_allclose(np.sum(parts.loss_sum) / total_count, out.loss, rtol=1e-6, atol=1e-7)
  # d loss_sum_i / d logp = count_i * d loss_i / d logp; the global loss divides once.
  acc_grad = part_grads[:, :3, :6] * np.asarray(parts.loss_count)[:, None, None] / total_count
  np.testing.assert_allclose(acc_grad.reshape(grad.shape), grad, rtol=1e-5, atol=1e-8)


# Turns of the golden rows for ST-PPO (values at padding positions must be
# ignored): every sign of A meets turn ratios below, inside and above (0.8, 1.2).
TURNS = np.array(
  [
    [0, 0, 0, 1, 1, 2],
    [0, 1, 1, 1, 2, 2],
    [0, 0, 1, 1, 1, 0],
    [0, 1, 1, 0, 0, 0],
    [0, 0, 1, 1, 2, 2],
    [0, 0, 0, 1, 1, 1],
    [0, 1, 2, 2, 0, 0],
    [0, 0, 0, 5, 5, 5],
    [3, 3, 3, 3, 3, 3],
  ],
  np.int32,
)
# Token advantages that vary inside a turn (ST-PPO uses the turn mean).
ADV_BT = (A_BT + 0.1 * np.arange(6)[None]).astype(np.float32)


@functools.cache
def _turn_results():
  """ST-PPO with TURNS: base, padded to [11, 9] and three 3-row micro-batches (jit)."""

  def f(inputs):
    kw = dict(inputs)
    logp = kw.pop("logp")

    def loss_fn(lp):
      out = losses.policy_loss("st_ppo", logp=lp, **kw)
      return out.loss, out

    (_, out), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    return out, grad

  base = dict(INPUTS, advantages=ADV_BT, turn_ids=TURNS)
  padded = []
  for rows in (np.arange(9),) + tuple(np.arange(3 * i, 3 * i + 3) for i in range(3)):
    batch = _pad_to(INPUTS, rows)
    batch["advantages"][: len(rows), :6] = ADV_BT[rows]
    turns = np.full((11, 9), 4, np.int32)  # garbage turn id on padding
    turns[: len(rows), :6] = TURNS[rows]
    padded.append(dict(batch, turn_ids=turns))
  stacked = {k: np.stack([b[k] for b in padded]) for k in padded[0]}
  return jax.jit(f)(base), jax.jit(jax.vmap(f))(stacked), f(base)


def test_st_ppo_turn_level_ratio_against_reference():
  d = np.where(MASK > 0, D, 0.0)
  want_loss, want_grad = _turn_ref(d, ADV_BT.astype(np.float64), MASK, TURNS)
  (out, grad), (out_s, grad_s), (out_e, grad_e) = _turn_results()
  np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-6)
  assert 0 < float(out.metrics["clip_frac"]) < 1
  # jit == no jit; padding rows / columns with garbage turn ids change nothing.
  np.testing.assert_allclose(out_e.loss, out.loss, rtol=1e-6)
  np.testing.assert_allclose(grad_e, grad, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(out_s.loss[0], out.loss, rtol=1e-6)
  np.testing.assert_allclose(grad_s[0, :9, :6], grad, rtol=1e-5, atol=1e-8)
  assert np.all(grad_s[0, 9:] == 0) and np.all(grad_s[0, :, 6:] == 0)
  # Micro-batches of whole rows accumulate to the full-batch loss and gradient.
  parts, counts = out_s.loss_sum[1:], np.asarray(out_s.loss_count[1:])
  np.testing.assert_allclose(np.sum(parts) / counts.sum(), out.loss, rtol=1e-6)
  acc = grad_s[1:, :3, :6] * counts[:, None, None] / counts.sum()
  np.testing.assert_allclose(acc.reshape(grad.shape), grad, rtol=1e-5, atol=1e-8)
  # One turn per sequence is the default, and differs from the multi-turn loss.
  one_turn = losses.policy_loss("st_ppo", **dict(INPUTS, turn_ids=np.zeros_like(TURNS)))
  default = losses.policy_loss("st_ppo", **INPUTS)
  np.testing.assert_allclose(one_turn.loss, default.loss, rtol=1e-6)
  assert abs(float(default.loss) - float(out.loss)) > 1e-3


def test_turn_ids_validation():
  with pytest.raises(ValueError, match="turn_ids"):
    losses.policy_loss("st_ppo", **dict(INPUTS, turn_ids=TURNS[:, :3]))
  with pytest.raises(ValueError, match="turn_ids"):
    losses.policy_loss("st_ppo", **dict(INPUTS, turn_ids=TURNS.astype(np.float32)))
  with pytest.raises(ValueError, match="hazard_shape"):
    losses.get_spec("mhpo", hazard_shape=0.5)
  with pytest.raises(ValueError, match="eps_low"):
    losses.get_spec("gbpo", eps_low=0.0)


def test_aggregation_counts():
  loss_bt = np.arange(54, dtype=np.float32).reshape(9, 6)
  n_b = MASK.sum(-1)
  s, c = losses.aggregate(loss_bt, MASK, "token_mean")
  np.testing.assert_allclose([s, c], [(loss_bt * MASK).sum(), MASK.sum()])
  s, c = losses.aggregate(loss_bt, MASK, "seq_mean_token_mean")
  per_seq = (loss_bt * MASK).sum(-1)[n_b > 0] / n_b[n_b > 0]
  np.testing.assert_allclose([s, c], [per_seq.sum(), 8], rtol=1e-6)
  s, c = losses.aggregate(loss_bt, MASK, "seq_mean_token_sum")
  np.testing.assert_allclose([s, c], [(loss_bt * MASK).sum(), 8])
  s, c = losses.aggregate(loss_bt, MASK, "seq_mean_token_sum_norm", max_len=10)
  np.testing.assert_allclose([s, c], [(loss_bt * MASK).sum(), 80])
  out = losses.policy_loss("reinforce", **dict(INPUTS, mask=np.zeros_like(MASK)))
  assert float(out.loss) == 0.0 and float(out.loss_count) == 0.0


def test_jit_equals_no_jit_for_every_preset():
  for name, (out_e, grad_e) in results("eager").items():
    out_j, grad_j = results("base")[name]
    np.testing.assert_allclose(out_j.loss, out_e.loss, rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(grad_j, grad_e, rtol=1e-5, atol=1e-8, err_msg=name)
    for key, value in out_e.metrics.items():
      np.testing.assert_allclose(out_j.metrics[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_spec_is_a_static_jit_argument():
  loss_fn = jax.jit(losses.policy_loss, static_argnums=0)
  spec = losses.get_spec("rec_oneside_nois", eps_high=0.28)
  out = loss_fn(spec, **INPUTS)
  want = losses.policy_loss("rec_oneside_nois", eps_high=0.28, **INPUTS)
  np.testing.assert_allclose(out.loss, want.loss, rtol=1e-6)
  assert loss_fn(losses.get_spec("rec_oneside_nois", eps_high=0.28), **INPUTS).loss == out.loss


# ---------------------------------------------------------------------------
# Metrics, token coefficients, errors.
# ---------------------------------------------------------------------------
def test_metrics_against_reference():
  out, _ = results("base")["ppo"]
  m = MASK > 0
  r = np.exp(D)[m]
  a = A_BT[m]
  clipped = ((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8))
  d = D[m]
  want = {
    "clip_frac": clipped.mean(),
    "clip_frac_pos": clipped[a > 0].mean(),
    "clip_frac_neg": clipped[a < 0].mean(),
    "ratio_mean": r.mean(),
    "ratio_min": r.min(),
    "ratio_max": r.max(),
    "ess": r.mean() ** 2 / (r**2).mean(),
    "kl_k1": (-d).mean(),
    "kl_k3": (np.exp(d) - 1 - d).mean(),
    "valid_tokens": m.sum(),
  }
  for key, value in want.items():
    np.testing.assert_allclose(out.metrics[key], value, rtol=1e-5, err_msg=key)
  for name, key in (("opmd", "reg"), ("m2po", "m2po_tau"), ("bapo", "bapo_high")):
    assert key in results("base")[name][0].metrics


# DPPO's masks read absolute probabilities: with mu at log-prob 0 they are degenerate.
TOKEN_LOCAL = [
  n
  for n in losses.names()
  if n
  not in SEQ_PRESETS
  + SEQ_CORRECTIONS
  + ("decoupled_ppo", "bapo", "clip_cov", "kl_cov", "opsm", "minpro", "dppo_tv", "dppo_kl")
  + ("m2po_release",)
]


RHO = np.array([0.3, 0.7, 0.9, 1.0, 1.1, 1.25, 1.5, 2.5, 4.0, 6.0])


@jax.jit
def _all_coefficients(rho):
  return {n: [losses.token_coefficient(n, rho, a) for a in (1.0, -1.0)] for n in TOKEN_LOCAL}


def test_token_coefficient_matches_reference():
  coefs = _all_coefficients(RHO)
  for name in TOKEN_LOCAL:
    if name == "m2po":
      continue
    for i, a in enumerate((1.0, -1.0)):
      av = np.full_like(RHO, a)
      _, want = _token_ref(name, np.log(RHO), av, np.log(RHO), np.ones_like(RHO), mu=0 * RHO)
      np.testing.assert_allclose(coefs[name][i], want, rtol=1e-5, atol=1e-5, err_msg=f"{name}")
  # M2PO on a single token: kept iff (log rho)^2 <= budget.
  np.testing.assert_allclose(
    coefs["m2po"][0], np.where(np.log(RHO) ** 2 <= 0.04, -RHO, 0.0), rtol=1e-6
  )


def test_unknown_names_and_bad_values_raise():
  with pytest.raises(ValueError, match="rec_oneside_nois"):
    losses.get_spec("no_such_loss")
  with pytest.raises(ValueError, match="no_such_knob"):
    losses.policy_loss("ppo", no_such_knob=1.0, **INPUTS)
  with pytest.raises(ValueError, match="eps_low"):
    losses.get_spec("ppo", eps_low=-0.1)
  with pytest.raises(ValueError, match="eps_high_prime"):
    losses.get_spec("rec_ring_nois", eps_high_prime=-1.0)
  with pytest.raises(ValueError, match="agg"):
    losses.get_spec("ppo", agg="mean")
  with pytest.raises(ValueError, match="proximal_logp"):
    losses.policy_loss("decoupled_ppo", **INPUTS)
  with pytest.raises(ValueError, match="entropy"):
    losses.policy_loss("ppo", entropy_coef=0.1, **INPUTS)
  with pytest.raises(ValueError, match="advantages"):
    losses.policy_loss("ppo", **dict(INPUTS, advantages=np.zeros(3)))
  with pytest.raises(ValueError, match="already registered"):
    losses.register("ppo", losses.LossSpec())


def test_register_custom_spec():
  spec = losses.LossSpec(shaping="mask", mask_kind="two_side", eps_low=0.1, eps_high=0.1)
  losses.register("test_custom_two_side", spec, "custom")
  try:
    assert "test_custom_two_side" in losses.names()
    out = losses.policy_loss("test_custom_two_side", **INPUTS)
    want, _ = reference("rec_twoside_nois")
    assert abs(float(out.loss) - want) > 1e-4  # narrower band changes the loss
  finally:
    losses.presets._REGISTRY.pop("test_custom_two_side")


# ---------------------------------------------------------------------------
# Adaptive pieces.
# ---------------------------------------------------------------------------
def test_m2po_tau_and_bapo_bounds_against_reference():
  d32 = D.astype(np.float32)
  tau = float(losses.m2po_tau(d32, MASK, 0.04))
  keep = _m2po_keep(d32.astype(np.float64), MASK)
  np.testing.assert_array_equal(np.abs(D) <= tau, keep)
  assert losses.m2po_tau(0.1 * D, MASK, 10.0) == np.inf
  # The released variant: harmful tokens only, capped; benign tokens never move tau.
  a_bt = np.broadcast_to(ADV[:, None], D.shape)
  tau = float(losses.m2po_capped_tau(d32, a_bt, MASK, 0.04))
  want = _m2po_capped_tau(d32.astype(np.float64), a_bt, MASK)
  assert np.isfinite(want) and tau == pytest.approx(want, rel=1e-5)
  benign = np.where(a_bt * d32 < 0, 10.0 * d32, d32)  # larger |log rho| where harmless
  assert float(losses.m2po_capped_tau(benign, a_bt, MASK, 0.04)) == pytest.approx(tau, rel=1e-6)
  assert losses.m2po_capped_tau(0.1 * D, a_bt, MASK, 10.0) == np.inf
  lo, hi = losses.bapo_bounds(np.exp(D), A_BT, MASK)
  np.testing.assert_allclose([lo, hi], _bapo_bounds(np.exp(D), A_BT, MASK), rtol=1e-6)
  lo, hi = losses.bapo_bounds(np.exp(D), -np.abs(A_BT), MASK)
  np.testing.assert_allclose([lo, hi], [0.8, 2.0], rtol=1e-6)


# ---------------------------------------------------------------------------
# The 3-armed bandit of arXiv:2509.24203 (docs/science.md section 2).
# ---------------------------------------------------------------------------
REWARDS = jnp.array([0.0, 0.8, 1.0])
BEHAVIOUR = jnp.array([0.3, 0.6, 0.1])
# Ten one-token responses drawn from mu in exact proportion: 3 x arm 0, 6 x arm 1, 1 x arm 2.
ARMS = jnp.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 2])


def train_bandit(name, on_policy, steps=400, lr=2.0):
  """Trains 3 logits; returns the final policy. Advantages are group-mean centred."""
  spec = losses.get_spec(name)
  one = jnp.ones((ARMS.shape[0], 1))

  def step(logits, _):
    if on_policy:
      # Exact on-policy expectation: each arm once, weighted by its probability.
      arms, probs = jnp.arange(3), jax.nn.softmax(logits)
      weight = 3 * probs
      behavior = jax.lax.stop_gradient(jax.nn.log_softmax(logits))[arms]
    else:
      arms, weight, behavior = ARMS, jnp.ones(10), jnp.log(BEHAVIOUR)[ARMS]
      probs = BEHAVIOUR
    adv = weight * (REWARDS[arms] - jnp.sum(probs * REWARDS))

    def loss_fn(lg):
      logp = jax.nn.log_softmax(lg)[arms][:, None]
      return losses.policy_loss(
        spec, logp=logp, behavior_logp=behavior[:, None], advantages=adv, mask=one[: len(arms)]
      ).loss

    return logits - lr * jax.grad(loss_fn)(logits), None

  logits, _ = jax.lax.scan(step, jnp.log(BEHAVIOUR), None, length=steps)
  return np.asarray(jax.nn.softmax(logits))


def test_bandit_fixed_behaviour_reinforce_picks_suboptimal_arm():
  pi_fixed = train_bandit("reinforce", on_policy=False)
  pi_on = train_bandit("reinforce", on_policy=True)
  assert pi_fixed.argmax() == 1 and pi_fixed[1] > 0.9, pi_fixed
  assert pi_on.argmax() == 2 and pi_on[2] > 0.9, pi_on
