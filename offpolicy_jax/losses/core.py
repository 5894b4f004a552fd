"""The composable policy loss: per-token terms of a `LossSpec`, then (sum, count).

Per token (``sg`` = stop-gradient, ``m`` the mask, ``A`` the advantage):

``loss_t = pg_t + R_t``, where with the ``logp`` gradient path
``pg_t = -A * sg(W_t * M_t * X_t) * logp_t`` (W the IS weight, M the
shaping mask, X extra weights: the rollout-correction family of
``corrections`` (IS weight, rejection, veto, trust-region masking, OPSM) and
the RED weight) and with the ``ratio`` path ``pg_t = X_t * S(rho_t, A)`` for a
surrogate S of a differentiable ratio (PPO clip, soft gate, ...). ``R_t`` sums
the regularisers. See ``spec.LossSpec`` for the axes.

`per_token_terms` runs the axes in order: the level (``levels.log_ratio``),
the ratio band (``shaping.band``), the shaping (one function per
``spec.shaping`` in ``shaping.SHAPINGS``), the extra weights, covariance
selection, and the regularisers (one function per ``spec.reg`` in
``_REGULARISERS``, then the reference KL and the entropy bonus).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from offpolicy_jax.losses import adaptive, corrections, levels, shaping
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


def _extra_weights(spec, a, logp, behavior_logp, proximal_logp, old_logp, valid, n_b, mask, stats):
  """Constant per-token weights applied after shaping, and the tokens they zero or bound.

  The rollout-correction family (`corrections.apply`: IS weight, rejection,
  veto, trust-region masking, OPSM) times RED-Weight ``exp(A / temp)``.
  """
  corr, corr_stats = corrections.apply(
    spec,
    a=a,
    logp=logp,
    behavior_logp=behavior_logp,
    proximal_logp=proximal_logp,
    old_logp=old_logp,
    valid=valid,
    mask=mask,
    n_b=n_b,
  )
  stats.update(corr_stats)
  extra = corr.weight
  if spec.adv_weight == "exp":
    extra = extra * jnp.exp(a / spec.temp)
  return extra, corr.dropped | corr.truncated


def _covariance(spec, pg, logp, behavior_logp, a, mask, stats):
  """Clip-Cov (detach the selected tokens) or KL-Cov (``+ coef |l - l_mu|`` on them)."""
  selected = adaptive.cov_select(logp, a, mask, spec.cov_frac)
  stats["cov_selected_frac"] = _masked_mean(selected, mask)
  if spec.cov == "clip":
    return jnp.where(selected > 0, sg(pg), pg), selected > 0
  return pg + spec.cov_coef * selected * jnp.abs(logp - behavior_logp), jnp.zeros(pg.shape, bool)


def _k2(spec, logp, behavior_logp, d):
  """``c (l - l_mu)^2``: OPMD / Kimi k1.5 read as REINFORCE + penalty (arXiv 2501.12599)."""
  del d
  return spec.reg_coef * jnp.square(logp - behavior_logp)


def _forward_kl(spec, logp, behavior_logp, d):
  """``-c l``: AsymRE's baseline lowered by c, a pull towards mu (arXiv 2506.20520)."""
  del behavior_logp, d
  return -spec.reg_coef * logp


def _hazard(spec, logp, behavior_logp, d):
  """MHPO: ``c ((max(d, 0) / log(1 + eps_high))^k + (max(-d, 0) / -log(1 - eps_low))^k)``.

  The Weibull cumulative hazard of the up / down shift ``d`` of the token
  log-ratio, each in units of its own band edge (arXiv 2603.16929;
  paper-level reconstruction).
  """
  del logp, behavior_logp
  up = jnp.maximum(d, 0.0) / math.log(1.0 + spec.eps_high)
  down = jnp.maximum(-d, 0.0) / -math.log(1.0 - spec.eps_low)
  return spec.reg_coef * (up**spec.hazard_shape + down**spec.hazard_shape)


# LossSpec.reg -> (spec, logp, behavior_logp, d) -> per-token penalty [B, T].
_REGULARISERS = {"k2": _k2, "forward_kl": _forward_kl, "hazard": _hazard}


def _add_regularisers(spec, total, logp, behavior_logp, d, valid, mask, ref_logp, entropy, stats):
  """``total + R_t``: the ``reg`` penalty, ``kl_coef * KL(pi || ref)``, ``- entropy_coef * H``."""
  if spec.reg != "none":
    reg = _REGULARISERS[spec.reg](spec, logp, behavior_logp, d)
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
  return total


def _anchor(spec, behavior_logp, proximal_logp, old_logp, valid):
  """Denominator of the trust-region ratio: ``mu``, ``prox`` or ``pi_old`` (0 on padding)."""
  if spec.ratio == "behavior":
    return behavior_logp
  if spec.ratio == "old":
    return old_logp
  return jnp.where(valid, _required(proximal_logp, "proximal_logp"), 0.0)


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
  old_logp: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Per-token loss of a spec before aggregation.

  Args:
    spec: the loss spec.
    logp, behavior_logp, mask: float32 [B, T].
    advantages: float32 [B, T].
    proximal_logp, ref_logp, entropy: float32 [B, T] or None.
    turn_ids: int [B, T] turn index of each token (``level='turn_geo'``), or
      None for one turn per sequence.
    old_logp: float32 [B, T] ``pi_old`` log-probs, or None for ``mu``.

  Returns:
    ``(loss_bt, clipped_bt, stats)``: per-token loss [B, T] (0 on padding),
    bool [B, T] tokens whose gradient was zeroed or bounded, and a dict of
    per-call scalars (regulariser means, adaptive bounds, ...).
  """
  valid = mask > 0
  logp = jnp.where(valid, logp, 0.0)
  behavior_logp = jnp.where(valid, behavior_logp, 0.0)
  old_logp = behavior_logp if old_logp is None else jnp.where(valid, old_logp, 0.0)
  anchor = _anchor(spec, behavior_logp, proximal_logp, old_logp, valid)
  n_b = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  a = jnp.where(valid, advantages, 0.0)
  # Sequence ratios pair with the sequence-mean advantage; GSPO-token
  # (seq_geo_token) keeps A_{i,t}, its gradient flowing through each token.
  if spec.level in ("seq_prod", "seq_geo"):
    a = jnp.broadcast_to(levels.seq_sum(a, valid) / n_b, a.shape)
  elif spec.level == "turn_geo":
    a = levels.turn_mean(a, valid, turn_ids)
  d = jnp.where(valid, logp - anchor, 0.0)
  logr, clipped = levels.log_ratio(spec, d, a, valid, n_b, turn_ids)
  rho = jnp.exp(logr)
  lo, hi, log_lo, log_hi, stats = shaping.band(spec, a, logr, rho, mask)
  x = shaping.ShapingInputs(a, logp, logr, rho, lo, hi, log_lo, log_hi)
  pg, shaped = shaping.SHAPINGS[spec.shaping](x, spec)
  extra, dropped = _extra_weights(
    spec, a, logp, behavior_logp, proximal_logp, old_logp, valid, n_b, mask, stats
  )
  pg = pg * sg(extra)
  clipped = clipped | shaped | dropped
  if spec.cov != "none":
    pg, detached = _covariance(spec, pg, logp, behavior_logp, a, mask, stats)
    clipped = clipped | detached
  total = _add_regularisers(spec, pg, logp, behavior_logp, d, valid, mask, ref_logp, entropy, stats)
  return jnp.where(valid, total, 0.0), clipped & valid, stats


def _check_inputs(
  spec, logp, behavior_logp, advantages, mask, proximal_logp, ref_logp, entropy, turn_ids, old_logp
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
    ("old_logp", old_logp, False),
  )
  for name, x, needed in required:
    if needed and x is None:
      raise ValueError(f"{name} is required by this loss spec (got None)")
    if x is not None and x.shape != logp.shape:
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
  old_logp: ArrayLike | None = None,
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
    old_logp: optional float32 [B, T] log-probs of the sampled tokens under
      the behaviour version's parameters scored by the learner (``pi_old``),
      so that ``pi / mu = (pi / pi_old) * (pi_old / mu)``: staleness (and the
      update in progress) times engine mismatch. Read when
      ``spec.needs_old`` (``ratio='old'``, or a correction on the mismatch
      factor, ``correction_ratio='old'``); None means ``mu`` (mismatch
      factor 1).
    **overrides: `LossSpec` fields, e.g. ``eps_low=0.1``; unknown names raise.

  Returns:
    `LossOutput` with ``loss``, ``loss_sum``, ``loss_count`` and ``metrics``:
    ``clip_frac`` (+ ``_pos``/``_neg`` by sign of A: zeroed or bounded
    gradients, corrections included), ``ratio_mean/min/max`` of the
    trust-region ratio, ``ess = E[w]^2 / E[w^2]`` of ``w = pi / mu``,
    ``kl_k1`` and ``kl_k3`` estimates of KL(mu || pi), and regulariser /
    adaptive values. Specs with a rollout correction (``correction``,
    ``reject``, ``veto_threshold``, ``trm``, ``seq_filter``) add, with
    ``w = pi_x / mu`` the correction weight (``correction_ratio``):
    ``corr_token_masked_frac`` and ``corr_seq_masked_frac`` (valid tokens,
    and rows with every valid token, zeroed by any correction),
    ``corr_token_truncated_frac`` and ``corr_seq_truncated_frac`` (tokens,
    and rows with at least one token, whose weight TIS truncated), per
    mechanism ``corr_<m>_token_frac`` / ``corr_<m>_seq_frac`` with ``m`` in
    ``band`` (IS weight outside ``[is_low, is_high]``), ``reject``,
    ``veto``, ``trm``, ``opsm`` (only the active ones), ``corr_weight_mean``
    (mean correction weight), and the mismatch before and after:
    ``corr_kl_k1``, ``corr_kl_k3`` (KL(mu || pi_x) over valid tokens) and
    ``corr_kl_k1_kept``, ``corr_kl_k3_kept`` (over the kept tokens).
    Sequence fractions count this call's rows with a valid token. DPPO's
    divergence mask is a shaping: its masked tokens are ``clip_frac``.

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
  old_logp = _optional_f32(old_logp)
  _check_inputs(
    spec,
    logp,
    behavior_logp,
    advantages,
    mask,
    proximal_logp,
    ref_logp,
    entropy,
    turn_ids,
    old_logp,
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
    old_logp=old_logp,
  )
  loss_sum, loss_count = aggregate(loss_bt, mask, spec.agg, max_len=spec.max_len)
  loss = safe_divide(loss_sum, loss_count)
  valid = mask > 0
  behavior_logp = jnp.where(valid, behavior_logp, 0.0)
  anchor = None
  if spec.ratio != "behavior":
    old = behavior_logp if old_logp is None else jnp.where(valid, old_logp, 0.0)
    anchor = _anchor(spec, behavior_logp, proximal_logp, old, valid)
  metrics = _metrics(
    logp,
    behavior_logp,
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
  ``prox``, ``pi_old``, ``ref``) at log-prob 0, so ``logp = log rho``; per-batch shapers
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
  one, zero = jnp.ones((1, 1), jnp.float32), jnp.zeros((1, 1), jnp.float32)

  def coef(r, a):
    def loss_fn(lp):
      loss_bt, _, _ = per_token_terms(
        spec,
        logp=lp * one,
        behavior_logp=zero,
        advantages=a * one,
        mask=one,
        proximal_logp=zero,
        ref_logp=zero,
        entropy=zero,
        old_logp=zero,
      )
      return loss_bt[0, 0]

    return jax.grad(loss_fn)(jnp.log(r))

  return jax.vmap(coef)(rho.reshape(-1), adv.reshape(-1)).reshape(rho.shape)
