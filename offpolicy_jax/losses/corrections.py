"""The rollout-correction family: constant per-token weights and masks on ``w = pi_x / mu``.

docs/science.md s7. With ``l_old`` the log-prob of a sampled token under the
behaviour *version*'s parameters scored by the learner,
``pi_theta / mu = (pi_theta / pi_old) * (pi_old / mu)``: the first factor is
staleness plus the update in progress (what a trust region limits), the
second is engine mismatch (bf16 sampler vs fp32 learner, truncated sampling:
what an importance weight corrects). Every correction here reads one
per-token log-weight ``lw_t = l_x - l_mu`` (``w_t = exp(lw_t)``), ``l_x``
chosen by ``LossSpec.correction_ratio``: the current ``sg(l)``, the proximal
anchor, or ``l_old`` (the mismatch factor alone). All outputs are constants
(stop-gradient); each mechanism multiplies the policy-gradient term, so a row
with ``A = 0`` stays exactly inert and no mechanism couples rows.

- IS weight (``correction``, at ``correction_level`` token / seq, where the
  sequence weight ``exp(sum_t lw_t)`` multiplies every token of the row):
  ``is`` keeps ``w``; ``truncate`` takes ``min(w, C)`` (TIS: Yao et al.,
  "Your efficient RL framework secretly brings you off-policy RL training",
  2025; sequence level: verl#3694); ``mask`` zeroes ``w`` outside
  ``[is_low, is_high]`` (IcePop: Ling team, "Every step evolves", arXiv
  2510.18855; masked IS, verl#2953 / #3694).
- Rejection (``reject``, weight 1 on kept tokens): ``token`` drops a token
  with ``w_t`` outside ``[lo, hi]`` (prime-rl's default band
  ``[0.125, 8]``); ``seq_any`` drops the row when any token breaches the
  band (the min/max rule); ``seq_geo`` drops the row when the geometric mean
  ``exp(mean_t lw_t)`` leaves ``[lo, hi]`` (geometric sequence masking,
  huggingface/trl#4891, verl#3984; band around ``[0.999, 1.001]``).
- Veto (``veto_threshold``): drop the row if any ``w_t < tau`` (verl#3694;
  verl#4544 later flags ``|lw_t|`` instead; this follows docs/science.md s7).
- Trust-region masking (``trm``; Li et al., "Trust region masking for
  long-horizon LLM reinforcement learning", arXiv 2512.23075; verl#4544):
  drop the row when the max or mean (``trm_stat``) over its tokens of a
  per-token estimate of KL(mu || pi_x) exceeds ``trm_bound``; k1 ``-lw``,
  k3 ``exp(lw) - 1 - lw`` (>= 0); over tokens drawn from mu both average to
  the KL.
- OPSM (``seq_filter='opsm'``): drop a row with ``A < 0`` whose mean
  ``l_mu - sg(l)`` exceeds ``opsm_delta`` (DeepSeek-AI, "DeepSeek-V3.2",
  2025, off-policy sequence masking; its ``pi_old`` is the sampler's, so it
  always reads ``pi_theta / mu``, as in trl#4891's reading of it).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax.losses import kl as kl_lib
from offpolicy_jax.losses import levels
from offpolicy_jax.losses.aggregation import aggregate, safe_divide
from offpolicy_jax.losses.spec import LossSpec

sg = jax.lax.stop_gradient


class Correction(NamedTuple):
  """Constant per-token outputs of the correction family, all [B, T].

  Attributes:
    weight: float factor multiplying the policy-gradient term (0 where dropped).
    dropped: bool tokens zeroed by any correction.
    truncated: bool tokens whose IS weight was bounded (TIS).
  """

  weight: jax.Array
  dropped: jax.Array
  truncated: jax.Array


def _log(x: float) -> float:
  return math.log(x) if x > 0 else -math.inf


def log_weight(spec: LossSpec, logp, behavior_logp, proximal_logp, old_logp, valid) -> jax.Array:
  """``lw_t = l_x - l_mu`` with ``l_x`` from ``spec.correction_source``; 0 on padding."""
  source = spec.correction_source
  if source == "current":
    top = sg(logp)
  elif source == "proximal":
    top = proximal_logp
  else:
    top = behavior_logp if old_logp is None else old_logp
  return jnp.where(valid, top - behavior_logp, 0.0)


def is_weight(spec: LossSpec, lw, valid):
  """The IS weight of ``spec.correction``: ``(w, band_dropped, truncated)``, all [B, T]."""
  no = jnp.zeros(lw.shape, bool)
  if spec.correction == "none":
    return jnp.ones_like(lw), no, no
  if spec.correction_level == "seq":
    lw = jnp.broadcast_to(levels.seq_sum(lw, valid), lw.shape)
  w = jnp.exp(lw)
  if spec.correction == "is":
    return w, no, no
  if spec.correction == "truncate":
    return jnp.minimum(w, spec.is_cap), no, w > spec.is_cap
  outside = (w < spec.is_low) | (w > spec.is_high)
  return jnp.where(outside, 0.0, w), outside, no


def _row_any(x_bt, valid):
  return jnp.broadcast_to(jnp.any(x_bt & valid, axis=-1, keepdims=True), x_bt.shape)


def reject(spec: LossSpec, lw, valid, n_b) -> jax.Array:
  """Tokens dropped by ``spec.reject``: bool [B, T]."""
  lo, hi = _log(spec.reject_low), _log(spec.reject_high)
  if spec.reject == "none":
    return jnp.zeros(lw.shape, bool)
  if spec.reject == "seq_geo":
    geo = jnp.broadcast_to(levels.seq_sum(lw, valid) / n_b, lw.shape)
    return (geo < lo) | (geo > hi)
  outside = (lw < lo) | (lw > hi)
  return outside if spec.reject == "token" else _row_any(outside, valid)


def veto(spec: LossSpec, lw, valid) -> jax.Array:
  """Rows with a token ``w_t < veto_threshold`` (all their tokens): bool [B, T]."""
  if spec.veto_threshold is None:
    return jnp.zeros(lw.shape, bool)
  return _row_any(lw < math.log(spec.veto_threshold), valid)


def trm_statistic(spec: LossSpec, lw, valid, n_b) -> jax.Array:
  """Per-row max or mean of the per-token k1 (``-lw``) / k3 estimate of KL(mu || pi_x), [B, T]."""
  k = -lw if spec.trm == "k1" else jnp.expm1(lw) - lw
  if spec.trm_stat == "max":
    stat = jnp.max(jnp.where(valid, k, -jnp.inf), axis=-1, keepdims=True)
  else:
    stat = levels.seq_sum(k, valid) / n_b
  return jnp.broadcast_to(stat, lw.shape)


def trust_region(spec: LossSpec, lw, valid, n_b) -> jax.Array:
  """Rows whose `trm_statistic` exceeds ``trm_bound`` (arXiv 2512.23075): bool [B, T]."""
  if spec.trm == "none":
    return jnp.zeros(lw.shape, bool)
  return trm_statistic(spec, lw, valid, n_b) > spec.trm_bound


def opsm(spec: LossSpec, a, logp, behavior_logp, valid, n_b) -> jax.Array:
  """OPSM: rows with ``A < 0`` and mean ``l_mu - sg(l)`` above ``opsm_delta``: bool [B, T]."""
  if spec.seq_filter != "opsm":
    return jnp.zeros(logp.shape, bool)
  seq_kl = levels.seq_sum(behavior_logp - sg(logp), valid) / n_b
  return (a < 0) & (seq_kl > spec.opsm_delta)


def _token_frac(x_bt, mask):
  return safe_divide(*aggregate(jnp.where(mask > 0, x_bt.astype(mask.dtype), 0.0), mask))


def _seq_frac(rows_b, valid):
  has = jnp.any(valid, axis=-1)
  return safe_divide(jnp.sum(rows_b & has), jnp.sum(has))


def apply(
  spec: LossSpec, *, a, logp, behavior_logp, proximal_logp, old_logp, valid, mask, n_b
) -> tuple[Correction, dict[str, jax.Array]]:
  """Every correction of ``spec``, combined, and its metrics.

  Args:
    spec: the loss spec.
    a, logp, behavior_logp: [B, T] advantages and log-probs (0 on padding).
    proximal_logp, old_logp: [B, T] or None (``old_logp=None`` means ``mu``).
    valid: bool [B, T]; mask: float [B, T]; n_b: [B, 1] valid tokens per row (>= 1).

  Returns:
    ``(Correction, stats)``. When any correction is active, ``stats`` holds
    ``corr_token_masked_frac`` / ``corr_seq_masked_frac`` (tokens, and rows
    with every valid token, zeroed by any correction),
    ``corr_token_truncated_frac`` / ``corr_seq_truncated_frac`` (tokens, and
    rows with a token, whose weight was truncated), per mechanism
    ``corr_<m>_token_frac`` / ``corr_<m>_seq_frac`` for ``m`` in ``band``
    (IS weight outside ``[is_low, is_high]``), ``reject``, ``veto``, ``trm``,
    ``opsm`` when active, ``corr_weight_mean`` and the mismatch
    ``corr_kl_k1`` / ``corr_kl_k3`` (KL(mu || pi_x) from ``lw``) over all
    valid tokens and ``corr_kl_k1_kept`` / ``corr_kl_k3_kept`` over the kept
    ones; OPSM also keeps its ``opsm_drop_frac``.
  """
  lw = log_weight(spec, logp, behavior_logp, proximal_logp, old_logp, valid)
  w, band, truncated = is_weight(spec, lw, valid)
  drops = {
    "band": (spec.correction == "mask", band),
    "reject": (spec.reject != "none", reject(spec, lw, valid, n_b)),
    "veto": (spec.veto_threshold is not None, veto(spec, lw, valid)),
    "trm": (spec.trm != "none", trust_region(spec, lw, valid, n_b)),
    "opsm": (spec.seq_filter == "opsm", opsm(spec, a, logp, behavior_logp, valid, n_b)),
  }
  dropped = jnp.zeros(lw.shape, bool)
  for active, drop in drops.values():
    if active:
      dropped = dropped | drop
  dropped = dropped & valid
  truncated = truncated & valid
  corr = Correction(jnp.where(dropped, 0.0, w), dropped, truncated)
  stats: dict[str, jax.Array] = {}
  if spec.seq_filter == "opsm":
    stats["opsm_drop_frac"] = _token_frac(drops["opsm"][1], mask)
  if not (spec.reads_correction_weight or spec.seq_filter != "none"):
    return corr, stats
  whole_row = lambda x: jnp.all(x | ~valid, axis=-1)
  stats["corr_token_masked_frac"] = _token_frac(dropped, mask)
  stats["corr_seq_masked_frac"] = _seq_frac(whole_row(dropped), valid)
  stats["corr_token_truncated_frac"] = _token_frac(truncated, mask)
  stats["corr_seq_truncated_frac"] = _seq_frac(jnp.any(truncated, axis=-1), valid)
  for name, (active, drop) in drops.items():
    if active:
      stats[f"corr_{name}_token_frac"] = _token_frac(drop & valid, mask)
      stats[f"corr_{name}_seq_frac"] = _seq_frac(whole_row(drop & valid), valid)
  stats["corr_weight_mean"] = safe_divide(*aggregate(jnp.where(valid, corr.weight, 0.0), mask))
  # KL(mu || pi_x) from samples of mu: d = l_mu - l_x = -lw.
  k1, k3 = kl_lib.kl(-lw, 0.0, "k1"), kl_lib.kl(-lw, 0.0, "k3")
  kept = valid & ~dropped
  for name, k in (("k1", k1), ("k3", k3)):
    stats[f"corr_kl_{name}"] = safe_divide(*aggregate(jnp.where(valid, k, 0.0), mask))
    kept_sum = aggregate(jnp.where(kept, k, 0.0), jnp.where(kept, mask, 0.0))
    stats[f"corr_kl_{name}_kept"] = safe_divide(*kept_sum)
  return corr, stats
