"""Per-batch searches: M2PO's ratio bounds, BAPO's clip bounds, Clip-Cov / KL-Cov selection.

The searches are pure jittable functions of one batch (masked reductions
inside bounded ``lax.while_loop``s and one ``top_k``; no Python loops over
data, no full sort: on XLA:CPU sorting a [256, 1024] batch takes ~40 ms, far
more than any of these searches). Their inputs are stop-gradient constants,
so the backward pass never pays for them.
"""

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


def m2po_tau(log_ratio: ArrayLike, mask: ArrayLike, budget: float = 0.04) -> jax.Array:
  """M2PO: the largest ``tau`` whose kept tokens have ``E[(log rho)^2] <= budget``.

  Tokens are kept iff ``|log rho| <= tau``; ``tau`` is the largest threshold
  such that the second moment of ``log rho`` over the kept valid tokens stays
  within the budget (the tokens with the largest ``(log rho)^2`` are dropped
  first), and it equals the largest kept ``|log rho|``. ``tau = inf`` when
  the whole batch is within budget. Zheng et al., "Prosperity before
  collapse: how far can off-policy RL reach with stale data on LLMs?" (2025).

  The kept second moment is monotone in the threshold, so the search is an
  exact bisection over the bit patterns of non-negative float32 thresholds
  between ``budget`` and ``max (log rho)^2`` (at most ~30 masked reductions,
  none when the batch is within budget; no sort).

  Args:
    log_ratio: [B, T] ``log rho``.
    mask: [B, T] 1 on valid tokens.
    budget: bound on the second moment.

  Returns:
    Scalar ``tau >= 0`` (``inf`` when nothing needs masking).
  """
  m = jnp.asarray(mask) > 0
  v = jnp.where(m, jnp.square(jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))), 0.0)

  def within_budget(threshold):
    # mean_kept(v) <= budget  <=>  sum_kept(v - budget) <= 0: one reduction.
    return jnp.sum(jnp.where(m & (v <= threshold), v - budget, 0.0)) <= 0.0

  v_max = jnp.max(v)

  def search(_):
    # Every token with v <= budget can be kept, so the search starts at the budget itself.
    lo = _largest(within_budget, jnp.float32(budget), v_max)
    tau_sq = jnp.max(jnp.where(m & (v <= lo), v, 0.0))
    # One ulp up so that |log rho| <= tau holds for every kept token despite rounding.
    return jnp.nextafter(jnp.sqrt(tau_sq), jnp.float32(jnp.inf))

  return jax.lax.cond(within_budget(v_max), lambda _: jnp.float32(jnp.inf), search, None)


def m2po_capped_tau(
  log_ratio: ArrayLike, advantages: ArrayLike, mask: ArrayLike, budget: float = 0.04
) -> jax.Array:
  """M2PO as its authors released it: ``tau`` with ``mean_H min((log rho)^2, tau^2) = budget``.

  ``H`` are the "harmful" valid tokens, those on the side PPO's clip bounds:
  ``A > 0, log rho > 0`` or ``A < 0, log rho < 0``. Their second moment is
  capped at ``tau^2`` (not truncated as in `m2po_tau`), and ``tau = inf`` when
  it is within the budget already (or ``H`` is empty). The released solver
  (github.com/Infini-AI-Lab/M2PO, `kpo_clip_harmful_tokens`) returns the
  largest ``(log rho)^2`` breakpoint below the solution; this is the
  solution itself, by the same bisection over float bits as `m2po_tau`
  (the capped sum is monotone in the threshold).

  Args:
    log_ratio: [B, T] ``log rho``.
    advantages: [B, T] advantages.
    mask: [B, T] 1 on valid tokens.
    budget: the second moment's bound.

  Returns:
    Scalar ``tau >= 0`` (``inf`` when nothing needs a bound).
  """
  lr = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
  a = jnp.asarray(advantages, jnp.float32)
  harm = (jnp.asarray(mask) > 0) & (((a > 0) & (lr > 0)) | ((a < 0) & (lr < 0)))
  v = jnp.where(harm, jnp.square(lr), 0.0)
  target = budget * jnp.sum(harm)
  capped = lambda t: jnp.sum(jnp.where(harm, jnp.minimum(v, t), 0.0))
  # capped(0) = 0 <= target < capped(max v): the threshold lies between them.
  search = lambda _: jnp.sqrt(_largest(lambda t: capped(t) <= target, 0.0, jnp.max(v)))
  return jax.lax.cond(jnp.sum(v) <= target, lambda _: jnp.float32(jnp.inf), search, None)


def _largest(ok, lo, hi) -> jax.Array:
  """The largest float32 ``t`` in ``[lo, hi)`` with ``ok(t)``, given ``ok(lo)``, not
  ``ok(hi)`` and ``ok`` monotone: a bisection over the bit patterns of non-negative
  float32 values (at most ~30 evaluations of ``ok``, no sort)."""
  to_bits = lambda x: jax.lax.bitcast_convert_type(jnp.float32(x), jnp.int32)
  to_float = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)

  def body(bounds):
    b_lo, b_hi = bounds
    mid = b_lo + (b_hi - b_lo) // 2
    good = ok(to_float(mid))
    return jnp.where(good, mid, b_lo), jnp.where(good, b_hi, mid)

  b_lo, _ = jax.lax.while_loop(lambda b: b[1] - b[0] > 1, body, (to_bits(lo), to_bits(hi)))
  return to_float(b_lo)


def bapo_bounds(
  rho: ArrayLike,
  advantages: ArrayLike,
  mask: ArrayLike,
  *,
  low: float = 0.6,
  high: float = 1.2,
  low_max: float = 0.8,
  high_max: float = 2.0,
  step_low: float = 0.05,
  step_high: float = 0.2,
  target: float = 0.4,
) -> tuple[jax.Array, jax.Array]:
  """BAPO: raise the clip bounds until positive tokens carry enough of the update.

  At step ``k`` the bounds are ``c_lo = min(low + k*step_low, low_max)`` and
  ``c_hi = min(high + k*step_high, high_max)``; the positive share is
  ``P / (P + N)`` with ``P = sum_{A>0, rho <= c_hi} A rho`` and
  ``N = sum_{A<0, rho >= c_lo} |A| rho`` (the tokens that still get a PPO-clip
  gradient). The search stops at the first ``k`` with share ``>= target`` or
  when both bounds reach their maxima. Xi et al., "BAPO: stabilizing
  off-policy RL for LLMs via balanced policy optimization with adaptive
  clipping" (2025). Reconstruction: the share is measured on
  gradient-carrying tokens and both bounds move together each step.

  Args:
    rho: [B, T] token ratios (treated as constants).
    advantages: [B, T] advantages.
    mask: [B, T] 1 on valid tokens.
    low, high: initial absolute bounds.
    low_max, high_max: largest bounds.
    step_low, step_high: increments per search step.
    target: required positive share.

  Returns:
    ``(c_lo, c_hi)`` float32 scalars.
  """
  rho = jax.lax.stop_gradient(jnp.asarray(rho, jnp.float32))
  a = jnp.asarray(advantages, jnp.float32)
  m = jnp.asarray(mask, jnp.float32)
  pos_w = jnp.where(a > 0, a * rho * m, 0.0)
  neg_w = jnp.where(a < 0, -a * rho * m, 0.0)

  steps = [(low_max - low) / step_low if step_low > 0 else 0.0]
  steps.append((high_max - high) / step_high if step_high > 0 else 0.0)
  k = jnp.arange(math.ceil(max(max(steps), 0.0) - 1e-6) + 1, dtype=jnp.float32)
  lo_k = jnp.minimum(low + k * step_low, max(low, low_max))
  hi_k = jnp.minimum(high + k * step_high, max(high, high_max))
  last = k.shape[0] - 1

  def share_ok(i):
    p = jnp.sum(jnp.where(rho <= hi_k[i], pos_w, 0.0))
    n = jnp.sum(jnp.where(rho >= lo_k[i], neg_w, 0.0))
    return p >= target * jnp.maximum(p + n, 1e-12)

  # Candidates in order, stopping at the first balanced one: usually one pass
  # over the batch instead of one per candidate.
  first = jax.lax.while_loop(lambda i: (i < last) & ~share_ok(i), lambda i: i + 1, 0)
  return lo_k[first], hi_k[first]


def cov_select(logp: ArrayLike, advantages: ArrayLike, mask: ArrayLike, frac: float) -> jax.Array:
  """Clip-Cov / KL-Cov token selection by covariance of log-prob and advantage.

  ``cov_t = (l_t - mean l) (A_t - mean A)`` over the valid tokens of the
  call; selects the ``ceil(frac * n_valid)`` tokens of largest positive
  covariance. Cui et al., "The entropy mechanism of reinforcement learning
  for reasoning language models", arXiv 2505.22617. Reconstruction: Clip-Cov
  samples its tokens at random from a covariance band; here both methods take
  the top fraction deterministically.

  Args:
    logp: [B, T] log-probs (treated as constants).
    advantages: [B, T] advantages.
    mask: [B, T] 1 on valid tokens.
    frac: fraction of valid tokens to select.

  Returns:
    [B, T] float32 selection indicator.
  """
  lp = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
  a = jnp.asarray(advantages, jnp.float32)
  m = jnp.asarray(mask, jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  cov = (lp - jnp.sum(lp * m) / n) * (a - jnp.sum(a * m) / n)
  cov = jnp.where(m > 0, cov, -jnp.inf)
  k_static = max(1, int(-(-frac * cov.size // 1)))
  top = jax.lax.top_k(cov.reshape(-1), k_static)[0]
  k_dyn = jnp.clip(jnp.ceil(frac * jnp.sum(m)).astype(jnp.int32), 0, k_static)
  threshold = top[jnp.maximum(k_dyn - 1, 0)]
  selected = (cov >= threshold) & (cov > 0) & (m > 0) & (k_dyn > 0)
  return selected.astype(jnp.float32)
