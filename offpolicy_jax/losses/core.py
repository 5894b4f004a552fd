"""The composable policy loss: per-token terms of a `LossSpec`, then (sum, count).

Per token (``sg`` = stop-gradient, ``m`` the mask, ``A`` the advantage):

``loss_t = pg_t + R_t``, where with the ``logp`` gradient path
``pg_t = -A * sg(W_t * M_t * X_t) * logp_t`` (W the IS weight, M the
shaping mask, X extra weights: rollout correction, RED weight, sequence
filters) and with the ``ratio`` path ``pg_t = X_t * S(rho_t, A)`` for a
surrogate S of a differentiable ratio (PPO clip, soft gate, ...). ``R_t`` sums
the regularisers. See ``spec.LossSpec`` for the axes.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from offpolicy_jax.losses import adaptive, levels
from offpolicy_jax.losses import kl as kl_lib
from offpolicy_jax.losses.aggregation import aggregate, safe_divide
from offpolicy_jax.losses.presets import get_spec
from offpolicy_jax.losses.spec import LossSpec

sg = jax.lax.stop_gradient


class LossOutput(NamedTuple):
  """Result of `policy_loss`.

  Attributes:
    loss: scalar ``loss_sum / loss_count`` (0 when the count is 0).
    loss_sum: scalar numerator; sum it over micro-batches / devices.
    loss_count: scalar denominator (>= 0); sum it likewise, divide once.
    metrics: dict of float32 scalars. ``valid_tokens`` and ``loss_sum`` are
      sums; every other entry is a mean over this call's valid tokens (or a
      per-call statistic such as ``ratio_max``, ``m2po_tau``), fine to
      average over equally sized micro-batches.
  """

  loss: jax.Array
  loss_sum: jax.Array
  loss_count: jax.Array
  metrics: dict[str, jax.Array]


def _masked_mean(x, w):
  return safe_divide(*aggregate(jnp.where(w > 0, x, 0.0), w, "token_mean"))


def _bounds(spec, a, logr, rho_sg, m):
  """Ratio band ``(lo, hi)`` [B, T], its logs, and per-call adaptive statistics."""
  lo = jnp.full_like(a, 1.0 - spec.eps_low)
  hi = jnp.full_like(a, 1.0 + spec.eps_high)
  if spec.eps_low_neg is not None:
    lo = jnp.where(a < 0, 1.0 - spec.eps_low_neg, lo)
  if spec.eps_high_neg is not None:
    hi = jnp.where(a < 0, 1.0 + spec.eps_high_neg, hi)
  stats = {}
  if spec.adaptive == "m2po":
    tau = adaptive.m2po_tau(sg(logr), m, spec.m2po_budget)
    stats["m2po_tau"] = tau
    return jnp.exp(-tau) + 0 * lo, jnp.exp(tau) + 0 * hi, (-tau + 0 * lo, tau + 0 * hi), stats
  elif spec.adaptive == "bapo":
    c_lo, c_hi = adaptive.bapo_bounds(
      rho_sg,
      a,
      m,
      low=1.0 - spec.eps_low,
      high=1.0 + spec.eps_high,
      low_max=spec.bapo_low_max,
      high_max=spec.bapo_high_max,
      step_low=spec.bapo_step_low,
      step_high=spec.bapo_step_high,
      target=spec.bapo_target,
    )
    lo, hi = c_lo + 0 * lo, c_hi + 0 * hi
    stats["bapo_low"], stats["bapo_high"] = c_lo, c_hi
  log_bounds = (jnp.log(jnp.maximum(lo, 0.0)), jnp.log(hi))
  return lo, hi, log_bounds, stats


def _shape(spec, a, logp, logr, rho, lo, hi, log_bounds):
  """Shaping and gradient-path axes: ``(pg_t, clipped_t)`` before extra weights.

  Masks compare ``log rho`` with the log bounds, so mask-only presets never
  exponentiate.
  """
  rho_sg, logr_sg = sg(rho), sg(logr)
  log_lo, log_hi = log_bounds
  pos, neg = a > 0, a < 0
  none = jnp.zeros(a.shape, bool)
  weight = rho_sg if spec.weight == "ratio" else jnp.ones_like(rho_sg)
  if spec.shaping == "clip":
    clipped = (pos & (rho_sg > hi)) | (neg & (rho_sg < lo))
    pg = jnp.where(clipped, -a * jnp.clip(rho_sg, lo, hi), -a * rho)
    if spec.dual_clip_c is not None:
      dual = neg & (rho_sg > spec.dual_clip_c)
      pg = jnp.where(dual, -spec.dual_clip_c * a, pg)
      clipped = clipped | dual
    return pg, clipped
  if spec.shaping == "soft_gate":
    tau = jnp.where(pos, spec.tau_pos, spec.tau_neg)
    return -a * jax.nn.sigmoid(tau * (rho - 1.0)) * 4.0 / tau, none
  if spec.shaping == "log_clip":
    return -a * rho, none
  if spec.shaping == "regression":
    return 0.5 * jnp.square(spec.beta * logr - a), none
  if spec.shaping == "bounded_target":
    target = jnp.where(pos, 1.0 + spec.eps_high, jnp.where(neg, 1.0 - spec.eps_low, 1.0))
    scale = jnp.where(neg, spec.eps_low, spec.eps_high)
    past = (pos & (rho_sg > target)) | (neg & (rho_sg < target))
    return jnp.abs(a) * jnp.square(rho - target) / (2.0 * scale), past
  if spec.shaping == "log_bound":
    c = spec.log_bound
    return -a * jnp.exp(c * jnp.tanh(logr / c)), none
  keep, clipped = jnp.ones_like(rho_sg), none
  if spec.shaping == "mask":
    inner = (logr_sg >= log_lo) & (logr_sg <= log_hi)
    if spec.mask_kind == "one_side":
      keep_b = jnp.where(pos, logr_sg <= log_hi, True) & jnp.where(neg, logr_sg >= log_lo, True)
    elif spec.mask_kind == "two_side":
      keep_b = inner
    else:
      log_lo_ring = (
        math.log(max(1.0 - spec.eps_low_prime, 0.0)) if spec.eps_low_prime < 1 else -math.inf
      )
      low_ring = (a >= 0) & (logr_sg <= log_lo_ring)
      high_ring = (a <= 0) & (logr_sg >= math.log(1.0 + spec.eps_high_prime))
      keep_b = inner | low_ring | high_ring
    keep, clipped = keep_b.astype(rho.dtype), ~keep_b
  elif spec.shaping == "truncate":
    weight = jnp.clip(rho_sg, lo, hi)
    clipped = (rho_sg < lo) | (rho_sg > hi)
  elif spec.shaping == "topr":
    weight = jnp.where(a >= 0, 1.0, jnp.clip(rho_sg, 0.0, 1.0))
    clipped = neg & (rho_sg > 1.0)
  if spec.grad == "ratio":
    return -a * rho * keep, clipped
  return -a * sg(weight * keep) * logp, clipped


def _correction(spec, logp, behavior_logp, proximal_logp, valid):
  """Rollout IS correction weight (constant) and the tokens it zeroes/bounds."""
  ones = jnp.ones_like(logp)
  if spec.correction == "none":
    return ones, jnp.zeros(logp.shape, bool)
  top = sg(logp) if spec.ratio == "behavior" else proximal_logp
  c_log = jnp.where(valid, top - behavior_logp, 0.0)
  if spec.correction_level == "seq":
    c_log = levels.seq_sum(c_log, valid) + 0 * c_log
  c_raw = jnp.exp(c_log)
  if spec.correction == "is":
    return c_raw, jnp.zeros(logp.shape, bool)
  if spec.correction == "truncate":
    return jnp.minimum(c_raw, spec.is_cap), c_raw > spec.is_cap
  outside = (c_raw < spec.is_low) | (c_raw > spec.is_high)
  return jnp.where(outside, 0.0, c_raw), outside


def per_token_terms(
  spec: LossSpec,
  *,
  logp: jax.Array,
  behavior_logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  proximal_logp: jax.Array | None = None,
  ref_logp: jax.Array | None = None,
  entropy: jax.Array | None = None,
  turn_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Per-token loss of a spec before aggregation.

  Args:
    spec: the loss spec.
    logp, behavior_logp, mask: float32 [B, T].
    advantages: float32 [B, T].
    proximal_logp, ref_logp, entropy: float32 [B, T] or None.
    turn_ids: int [B, T] turn index of each token (``level='turn_geo'``), or
      None for one turn per sequence.

  Returns:
    ``(loss_bt, clipped_bt, stats)``: per-token loss [B, T] (0 on padding),
    bool [B, T] tokens whose gradient was zeroed or bounded, and a dict of
    per-call scalars (regulariser means, adaptive bounds, ...).
  """
  valid = mask > 0
  zero = jnp.zeros_like(logp)
  logp = jnp.where(valid, logp, 0.0)
  behavior_logp = jnp.where(valid, behavior_logp, 0.0)
  anchor = behavior_logp
  if spec.ratio != "behavior":
    anchor = jnp.where(valid, _required(proximal_logp, "proximal_logp"), 0.0)
  n_b = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  a = jnp.where(valid, advantages, 0.0)
  # Sequence ratios pair with the sequence-mean advantage; GSPO-token
  # (seq_geo_token) keeps A_{i,t}, its gradient flowing through each token.
  if spec.level in ("seq_prod", "seq_geo"):
    a = levels.seq_sum(a, valid) / n_b + 0 * a
  elif spec.level == "turn_geo":
    a = levels.turn_mean(a, valid, turn_ids)
  d = jnp.where(valid, logp - anchor, 0.0)
  logr, clipped = levels.log_ratio(spec, d, a, valid, n_b, turn_ids)
  rho = jnp.exp(logr)
  lo, hi, log_bounds, stats = _bounds(spec, a, logr, sg(rho), mask)
  pg, shaped = _shape(spec, a, logp, logr, rho, lo, hi, log_bounds)
  clipped = clipped | shaped
  extra, corrected = _correction(spec, logp, behavior_logp, proximal_logp, valid)
  clipped = clipped | corrected
  if spec.adv_weight == "exp":
    extra = extra * jnp.exp(a / spec.temp)
  if spec.seq_filter == "opsm":
    seq_kl = levels.seq_sum(behavior_logp - sg(logp), valid) / n_b
    drop = (a < 0) & (seq_kl > spec.opsm_delta)
    extra = extra * (~drop)
    clipped = clipped | drop
    stats["opsm_drop_frac"] = _masked_mean(drop.astype(mask.dtype), mask)
  pg = pg * sg(extra)
  if spec.cov != "none":
    selected = adaptive.cov_select(logp, a, mask, spec.cov_frac)
    if spec.cov == "clip":
      pg = jnp.where(selected > 0, sg(pg), pg)
      clipped = clipped | (selected > 0)
    else:
      pg = pg + spec.cov_coef * selected * jnp.abs(logp - behavior_logp)
    stats["cov_selected_frac"] = _masked_mean(selected, mask)
  total = pg
  if spec.reg == "k2":
    reg = spec.reg_coef * jnp.square(logp - behavior_logp)
  elif spec.reg == "forward_kl":
    reg = -spec.reg_coef * logp
  elif spec.reg == "hazard":
    # Weibull cumulative hazard of the up / down shift of the token log-ratio,
    # each in units of its own band edge.
    up = jnp.maximum(d, 0.0) / math.log(1.0 + spec.eps_high)
    down = jnp.maximum(-d, 0.0) / -math.log(1.0 - spec.eps_low)
    reg = spec.reg_coef * (up**spec.hazard_shape + down**spec.hazard_shape)
  else:
    reg = zero
  if spec.reg != "none":
    total = total + reg
    stats["reg"] = _masked_mean(reg, mask)
  if spec.kl_coef > 0:
    ref = jnp.where(valid, _required(ref_logp, "ref_logp"), 0.0)
    kl_bt = kl_lib.kl(logp, ref, spec.kl_kind, straight_through=spec.kl_straight_through)
    total = total + spec.kl_coef * kl_bt
    stats["kl_ref"] = _masked_mean(sg(kl_bt), mask)
  if spec.entropy_coef > 0:
    ent = jnp.where(valid, _required(entropy, "entropy"), 0.0)
    total = total - spec.entropy_coef * ent
    stats["entropy"] = _masked_mean(sg(ent), mask)
  return jnp.where(valid, total, 0.0), clipped & valid, stats


def _check_inputs(
  spec, logp, behavior_logp, advantages, mask, proximal_logp, ref_logp, entropy, turn_ids
):
  if logp.ndim != 2:
    raise ValueError(f"logp must be [B, T]; got shape {logp.shape}")
  for name, x in (("behavior_logp", behavior_logp), ("mask", mask)):
    if x.shape != logp.shape:
      raise ValueError(f"{name} shape {x.shape} != logp shape {logp.shape}")
  if advantages.shape not in (logp.shape[:1], logp.shape):
    raise ValueError(f"advantages must be [B] or [B, T]; got {advantages.shape} for {logp.shape}")
  required = (
    ("proximal_logp", proximal_logp, spec.needs_proximal),
    ("ref_logp", ref_logp, spec.needs_ref),
    ("entropy", entropy, spec.entropy_coef > 0),
  )
  for name, x, needed in required:
    if needed and x is None:
      raise ValueError(f"{name} is required by this loss spec (got None)")
    if needed and x.shape != logp.shape:
      raise ValueError(f"{name} shape {x.shape} != logp shape {logp.shape}")
  if turn_ids is not None:
    if turn_ids.shape != logp.shape:
      raise ValueError(f"turn_ids shape {turn_ids.shape} != logp shape {logp.shape}")
    if not jnp.issubdtype(turn_ids.dtype, jnp.integer):
      raise ValueError(f"turn_ids must be integers; got {turn_ids.dtype}")


def _metrics(logp, behavior_logp, anchor, a, mask, clipped, stats):
  # Every per-token input is finite on padding (sanitised upstream), so plain
  # products with the mask are safe here.
  valid = mask > 0
  d_mu = jnp.where(valid, sg(logp) - behavior_logp, 0.0)
  log_rho = d_mu if anchor is None else jnp.where(valid, sg(logp) - anchor, 0.0)
  w = jnp.exp(d_mu)
  rho = w if anchor is None else jnp.exp(log_rho)
  total = lambda x: jnp.sum(x * mask)
  n = jnp.sum(mask)
  cl = clipped.astype(mask.dtype)
  pos = (a > 0).astype(mask.dtype)
  neg = (a < 0).astype(mask.dtype)
  metrics = {
    "valid_tokens": n,
    "clip_frac": safe_divide(total(cl), n),
    "clip_frac_pos": safe_divide(total(cl * pos), total(pos)),
    "clip_frac_neg": safe_divide(total(cl * neg), total(neg)),
    "ratio_mean": safe_divide(total(rho), n),
    "ratio_min": jnp.where(n > 0, jnp.exp(jnp.min(jnp.where(valid, log_rho, jnp.inf))), 1.0),
    "ratio_max": jnp.where(n > 0, jnp.exp(jnp.max(jnp.where(valid, log_rho, -jnp.inf))), 1.0),
    "ess": safe_divide(jnp.square(total(w)), n * total(w * w)),
    # KL(mu || pi) estimated from samples of mu: d = l_mu - l.
    "kl_k1": _masked_mean(kl_lib.kl(behavior_logp, sg(logp), "k1"), mask),
    "kl_k3": _masked_mean(kl_lib.kl(behavior_logp, sg(logp), "k3"), mask),
  }
  metrics.update(stats)
  return metrics


def _optional_f32(x: ArrayLike | None) -> jax.Array | None:
  return None if x is None else jnp.asarray(x, jnp.float32)


def _required(x: jax.Array | None, name: str) -> jax.Array:
  if x is None:
    raise ValueError(f"this loss needs `{name}`; got None")
  return x


def policy_loss(
  name_or_spec: str | LossSpec,
  *,
  logp: ArrayLike,
  behavior_logp: ArrayLike,
  advantages: ArrayLike,
  mask: ArrayLike,
  proximal_logp: ArrayLike | None = None,
  ref_logp: ArrayLike | None = None,
  entropy: ArrayLike | None = None,
  turn_ids: ArrayLike | None = None,
  **overrides,
) -> LossOutput:
  """Policy loss of a named preset or a `LossSpec`, reduced to (sum, count).

  ``loss = sum_t agg(loss_t) / count``; see the module docstring for
  ``loss_t`` and ``aggregation.aggregate`` for the exact (sum, count) pairs.
  The loss is differentiable w.r.t. ``logp`` (and ``entropy``).

  Args:
    name_or_spec: a preset name (see `names`) or a `LossSpec`.
    logp: float32 [B, T] log-probs of the response tokens under the current
      parameters.
    behavior_logp: float32 [B, T] log-probs recorded by the sampler (mu).
    advantages: float32 [B] or [B, T].
    mask: float32 [B, T] 1 on valid response tokens.
    proximal_logp: float32 [B, T], required when ``spec.needs_proximal``.
    ref_logp: float32 [B, T], required when ``spec.needs_ref``.
    entropy: float32 [B, T] per-token entropy, required when
      ``entropy_coef > 0``.
    turn_ids: optional int [B, T] turn index of each token, values in
      [0, T); tokens of a row with equal ids form one turn. Read only by
      ``level='turn_geo'`` (ST-PPO); None means one turn per sequence.
    **overrides: `LossSpec` fields, e.g. ``eps_low=0.1``; unknown names raise.

  Returns:
    `LossOutput` with ``loss``, ``loss_sum``, ``loss_count`` and ``metrics``:
    ``clip_frac`` (+ ``_pos``/``_neg`` by sign of A: zeroed or bounded
    gradients), ``ratio_mean/min/max`` of the trust-region ratio,
    ``ess = E[w]^2 / E[w^2]`` of ``w = pi / mu``, ``kl_k1`` and ``kl_k3``
    estimates of KL(mu || pi), and regulariser / adaptive values.

  Raises:
    ValueError: unknown preset or override, bad shapes, missing inputs.
  """
  if isinstance(name_or_spec, LossSpec):
    spec = name_or_spec.replace(**overrides) if overrides else name_or_spec
  else:
    spec = get_spec(name_or_spec, **overrides)
  logp, behavior_logp = jnp.asarray(logp, jnp.float32), jnp.asarray(behavior_logp, jnp.float32)
  advantages, mask = jnp.asarray(advantages, jnp.float32), jnp.asarray(mask, jnp.float32)
  proximal_logp, ref_logp = _optional_f32(proximal_logp), _optional_f32(ref_logp)
  entropy = _optional_f32(entropy)
  turn_ids = None if turn_ids is None else jnp.asarray(turn_ids)
  _check_inputs(
    spec, logp, behavior_logp, advantages, mask, proximal_logp, ref_logp, entropy, turn_ids
  )
  if advantages.ndim == 1:
    advantages = jnp.broadcast_to(advantages[:, None], logp.shape)
  loss_bt, clipped, stats = per_token_terms(
    spec,
    logp=logp,
    behavior_logp=behavior_logp,
    advantages=advantages,
    mask=mask,
    proximal_logp=proximal_logp,
    ref_logp=ref_logp,
    entropy=entropy,
    turn_ids=turn_ids,
  )
  loss_sum, loss_count = aggregate(loss_bt, mask, spec.agg, max_len=spec.max_len)
  loss = safe_divide(loss_sum, loss_count)
  valid = mask > 0
  anchor = None
  if spec.ratio != "behavior":
    anchor = jnp.where(valid, _required(proximal_logp, "proximal_logp"), 0.0)
  metrics = _metrics(
    logp,
    jnp.where(valid, behavior_logp, 0.0),
    anchor,
    advantages,
    mask,
    clipped,
    stats,
  )
  metrics["loss_sum"] = sg(loss_sum)
  return LossOutput(loss, loss_sum, loss_count, metrics)


def token_coefficient(spec: str | LossSpec, rho: ArrayLike, adv: ArrayLike) -> jax.Array:
  """Per-token gradient coefficient ``d loss_t / d logp_t`` as a function of (rho, A).

  Each point is evaluated as its own one-token sequence with ``mu`` (and
  ``prox``, ``ref``) at log-prob 0, so ``logp = log rho``; per-batch shapers
  (M2PO, BAPO, covariance selection) then act on that single token.

  Args:
    spec: preset name or `LossSpec`.
    rho: [...] ratios (> 0).
    adv: [...] advantages, broadcastable with ``rho``.

  Returns:
    [...] float32 coefficient; REINFORCE gives ``-A``.
  """
  spec = get_spec(spec) if isinstance(spec, str) else spec
  rho, adv = jnp.broadcast_arrays(jnp.asarray(rho, jnp.float32), jnp.asarray(adv, jnp.float32))
  one = jnp.ones((1, 1), jnp.float32)

  def coef(r, a):
    def loss_fn(lp):
      loss_bt, _, _ = per_token_terms(
        spec,
        logp=lp * one,
        behavior_logp=0 * one,
        advantages=a * one,
        mask=one,
        proximal_logp=0 * one,
        ref_logp=0 * one,
        entropy=0 * one,
      )
      return loss_bt[0, 0]

    return jax.grad(loss_fn)(jnp.log(r))

  return jax.vmap(coef)(rho.reshape(-1), adv.reshape(-1)).reshape(rho.shape)
