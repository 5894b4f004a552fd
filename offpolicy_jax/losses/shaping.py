"""The shaping axis of a loss: what each token's policy-gradient term becomes.

Every shaping is a small pure function ``(x, spec) -> (pg_bt, clipped_bt)`` of
the per-token quantities in `ShapingInputs`: the per-token policy-gradient
term before extra weights, and the bool tokens whose gradient it zeroed or
bounded. `SHAPINGS` maps ``LossSpec.shaping`` to its function and
``core.per_token_terms`` dispatches through it; `MASKS` does the same for
``LossSpec.mask_kind``. Notation: ``A`` the advantage, ``l`` the log-prob,
``rho`` the ratio at the spec's level, ``[lo, hi]`` the ratio band
(``1 - eps_low``, ``1 + eps_high`` unless adaptive), ``sg`` stop-gradient.

Two gradient paths (``LossSpec.grad``):

- ``logp``: ``pg = -A * sg(W * M) * l`` with W the weight (``1``, or ``rho``
  with ``weight='ratio'``) and M the kept-token indicator. Shapings
  ``none``, ``mask``, ``truncate`` and ``topr`` choose W and M.
- ``ratio``: a surrogate of a differentiable ``rho``
  (``grad rho = rho * grad l``); ``none`` and ``mask`` then give
  ``-A * rho * M``, the others define their own surrogate.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax.losses import adaptive
from offpolicy_jax.losses.spec import LossSpec

sg = jax.lax.stop_gradient


class ShapingInputs(NamedTuple):
  """Per-token quantities a shaping reads, all float32 [B, T] (0 on padding).

  Attributes:
    a: advantages ``A`` at the spec's level.
    logp: log-probs ``l`` under the current parameters (differentiable).
    logr: ``log rho`` at the spec's level (differentiable).
    rho: ``exp(logr)`` (differentiable).
    lo, hi: the ratio band.
    log_lo, log_hi: ``log lo`` (``-inf`` for ``lo <= 0``) and ``log hi``.
  """

  a: jax.Array
  logp: jax.Array
  logr: jax.Array
  rho: jax.Array
  lo: jax.Array
  hi: jax.Array
  log_lo: jax.Array
  log_hi: jax.Array


Shaping = Callable[[ShapingInputs, LossSpec], tuple[jax.Array, jax.Array]]


def _nothing_clipped(x: ShapingInputs) -> jax.Array:
  return jnp.zeros(x.a.shape, bool)


def _gradient_path(
  x: ShapingInputs, spec: LossSpec, weight: jax.Array | None = None, keep: jax.Array | None = None
) -> jax.Array:
  """``-A * rho * M`` (``grad='ratio'``) or ``-A * sg(W * M) * l`` (``grad='logp'``).

  ``weight=None`` takes W from ``spec.weight``; ``keep=None`` keeps every token.
  """
  if spec.grad == "ratio":
    pg = -x.a * x.rho
    return pg if keep is None else pg * keep
  if weight is None:
    weight = sg(x.rho) if spec.weight == "ratio" else jnp.ones_like(x.rho)
  if keep is not None:
    weight = weight * keep
  return -x.a * sg(weight) * x.logp


def none(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """No trust region: ``-A * sg(W) * l``, or ``-A * rho`` on the ratio path.

  With ``W = 1`` this is REINFORCE (Williams, "Simple statistical
  gradient-following algorithms for connectionist reinforcement learning",
  1992); with ``W = rho`` the plain importance-sampled policy gradient.
  """
  return _gradient_path(x, spec), _nothing_clipped(x)


def clip(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """PPO clip, with the optional dual clip.

  ``max(-A rho, -A clip(rho, lo, hi))``: the gradient is zeroed where
  ``A > 0, rho > hi`` or ``A < 0, rho < lo`` (Schulman et al., "Proximal
  policy optimization algorithms", arXiv 1707.06347). Dual clip: for
  ``A < 0`` and ``rho > c`` the loss is the constant ``-c A`` (Ye et al.,
  "Mastering complex control in MOBA games with deep reinforcement
  learning", arXiv 1912.09729).
  """
  a, rho = x.a, x.rho
  rho_sg = sg(rho)
  neg = a < 0
  clipped = ((a > 0) & (rho_sg > x.hi)) | (neg & (rho_sg < x.lo))
  pg = jnp.where(clipped, -a * jnp.clip(rho_sg, x.lo, x.hi), -a * rho)
  if spec.dual_clip_c is not None:
    dual = neg & (rho_sg > spec.dual_clip_c)
    pg = jnp.where(dual, -spec.dual_clip_c * a, pg)
    clipped = clipped | dual
  return pg, clipped


def one_side_mask(x: ShapingInputs, spec: LossSpec) -> jax.Array:
  """REC one-side mask: ``A > 0`` keeps ``rho <= hi``; ``A < 0`` keeps ``rho >= lo``.

  With the IS weight this is exactly the PPO-clip gradient (Yao et al.,
  "Group-relative REINFORCE is secretly an off-policy algorithm",
  arXiv 2509.24203).
  """
  del spec
  logr = sg(x.logr)
  return jnp.where(x.a > 0, logr <= x.log_hi, True) & jnp.where(x.a < 0, logr >= x.log_lo, True)


def two_side_mask(x: ShapingInputs, spec: LossSpec) -> jax.Array:
  """REC two-side mask: keep ``lo <= rho <= hi`` for either sign of A (arXiv 2509.24203)."""
  del spec
  logr = sg(x.logr)
  return (logr >= x.log_lo) & (logr <= x.log_hi)


def ring_mask(x: ShapingInputs, spec: LossSpec) -> jax.Array:
  """REC ring mask: the two-side band, or an outer ring on the side A pushes from.

  Keeps ``lo <= rho <= hi``, or ``A >= 0`` and ``rho <= 1 - eps_low_prime``,
  or ``A <= 0`` and ``rho >= 1 + eps_high_prime`` (arXiv 2509.24203;
  defaults eps' = (0.6, 2.0)).
  """
  logr = sg(x.logr)
  if spec.eps_low_prime < 1:
    log_lo_ring = math.log(max(1.0 - spec.eps_low_prime, 0.0))
  else:
    log_lo_ring = -math.inf
  low_ring = (x.a >= 0) & (logr <= log_lo_ring)
  high_ring = (x.a <= 0) & (logr >= math.log(1.0 + spec.eps_high_prime))
  return two_side_mask(x, spec) | low_ring | high_ring


def _probs(x: ShapingInputs) -> tuple[jax.Array, jax.Array]:
  """``(pi, anchor)`` probabilities of the sampled token (token level: ``anchor = pi / rho``)."""
  logp = sg(x.logp)
  return jnp.exp(logp), jnp.exp(logp - sg(x.logr))


def tv_mask(x: ShapingInputs, spec: LossSpec) -> jax.Array:
  """DPPO binary-TV mask: A > 0 keeps ``pi - mu <= delta``, A < 0 keeps ``mu - pi <= delta``.

  Divergence PPO replaces the ratio clip by a mask on a cheap divergence of
  the sampled token's probability, the binary total variation
  ``|pi(a) - mu(a)|``, masked only on the side the advantage pushes; the
  anchor is the ratio's denominator (``mu`` for ``ratio='behavior'``);
  ``delta = dppo_delta`` (about 0.15). Qi et al., "Rethinking the trust
  region in LLM reinforcement learning", arXiv 2602.04879 (sail-sg/Stable-RL).
  """
  p, q = _probs(x)
  delta = spec.dppo_delta
  return jnp.where(x.a > 0, p - q <= delta, True) & jnp.where(x.a < 0, q - p <= delta, True)


def binary_kl(p: jax.Array, q: jax.Array) -> jax.Array:
  """KL of Bernoulli(q) from Bernoulli(p): ``q log(q / p) + (1 - q) log((1 - q) / (1 - p))``.

  The KL(mu || pi) of the two-outcome split {the sampled token, any other}
  (arXiv 2602.04879); ``p`` is clipped below 1 and ``0 log 0 = 0``.
  """
  p = jnp.clip(p, 0.0, 1.0 - 1e-7)
  rest = 1.0 - q
  log_rest = jnp.log(jnp.where(rest > 0, rest, 1.0)) - jnp.log1p(-p)
  return q * (jnp.log(q) - jnp.log(p)) + jnp.where(rest > 0, rest * log_rest, 0.0)


def binary_kl_mask(x: ShapingInputs, spec: LossSpec) -> jax.Array:
  """DPPO binary-KL mask: drop where the binary KL exceeds delta on the side A pushes.

  ``A > 0`` keeps ``pi <= mu`` or ``KL_bin(mu || pi) <= delta``; ``A < 0``
  keeps ``pi >= mu`` or ``KL_bin <= delta``; delta about 0.05 (Qi et al.,
  arXiv 2602.04879).
  """
  p, q = _probs(x)
  small = binary_kl(p, q) <= spec.dppo_delta
  return jnp.where(x.a > 0, small | (p <= q), True) & jnp.where(x.a < 0, small | (p >= q), True)


MASKS: dict[str, Callable[[ShapingInputs, LossSpec], jax.Array]] = {
  "one_side": one_side_mask,
  "two_side": two_side_mask,
  "ring": ring_mask,
  "tv": tv_mask,
  "binary_kl": binary_kl_mask,
}


def mask(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """REC masks: ``-A * sg(W * M) * l`` (or ``-A * rho * M``), M from ``spec.mask_kind``.

  Masks compare ``log rho`` with the log band, so mask-only presets never
  exponentiate (arXiv 2509.24203; M2PO uses the two-side mask with an
  adaptive band).
  """
  keep = MASKS[spec.mask_kind](x, spec)
  return _gradient_path(x, spec, keep=keep.astype(x.rho.dtype)), ~keep


def truncate(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """CISPO / DISPO: ``-sg(clip(rho, lo, hi)) * A * l``, a bounded, never zero weight.

  MiniMax, "MiniMax-M1: scaling test-time compute efficiently with lightning
  attention", arXiv 2506.13585. DISPO's sign-dependent bounds come in through
  ``eps_low_neg`` / ``eps_high_neg``.
  """
  rho_sg = sg(x.rho)
  clipped = (rho_sg < x.lo) | (rho_sg > x.hi)
  return _gradient_path(x, spec, weight=jnp.clip(rho_sg, x.lo, x.hi)), clipped


def topr(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """TOPR: ``A >= 0``: ``-A * l``; ``A < 0``: ``-sg(clip(rho, 0, 1)) * A * l``.

  Le Roux et al., "Tapered off-policy REINFORCE", arXiv 2503.14286.
  """
  rho_sg = sg(x.rho)
  weight = jnp.where(x.a >= 0, 1.0, jnp.clip(rho_sg, 0.0, 1.0))
  return _gradient_path(x, spec, weight=weight), (x.a < 0) & (rho_sg > 1.0)


def soft_gate(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """SAPO: ``-A * sigmoid(tau (rho - 1)) * 4 / tau``, ``tau = tau_pos`` / ``tau_neg`` by sign of A.

  A smooth gate instead of a hard clip; its gradient ``-A rho`` at ``rho = 1``
  equals REINFORCE's (Gao et al., "Soft adaptive policy optimization",
  arXiv 2511.20347).
  """
  tau = jnp.where(x.a > 0, spec.tau_pos, spec.tau_neg)
  return -x.a * jax.nn.sigmoid(tau * (x.rho - 1.0)) * 4.0 / tau, _nothing_clipped(x)


def log_clip(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """GMPO: ``-A * rho`` where ``rho = exp(mean_t clip(log rho_t))``.

  The sign-aware clip of each token's log-ratio to ``(-eps_low, eps_high)``
  happens in ``levels.log_ratio`` (it acts before the sequence mean), which
  also reports the clipped tokens (Zhao et al., "Geometric-mean policy
  optimization", arXiv 2507.20673).
  """
  del spec
  return -x.a * x.rho, _nothing_clipped(x)


def regression(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """OAPL: ``0.5 * (beta * log rho - A)^2``, no importance sampling.

  Regresses ``beta log(pi / pi_lag)(y)`` onto the advantage; with the
  ``opmd`` advantage ``A = r - beta log mean exp(r / beta)`` (OAPL;
  reconstruction).
  """
  return 0.5 * jnp.square(spec.beta * x.logr - x.a), _nothing_clipped(x)


def bounded_target(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """GBPO: ``|A| (rho - rho*)^2 / (2 eps)`` with the bounded-ratio target ``rho*``.

  ``rho* = 1 + eps_high`` (A > 0) or ``1 - eps_low`` (A < 0), ``eps`` the
  matching band width: regresses the ratio onto the bounded-ratio optimum;
  the ``1 / eps`` makes the on-policy gradient REINFORCE's ``-A`` ("Bounded
  ratio reinforcement learning", arXiv 2604.18578; paper-level
  reconstruction). Tokens past their target are reported as clipped.
  """
  a, rho_sg = x.a, sg(x.rho)
  pos, neg = a > 0, a < 0
  target = jnp.where(pos, 1.0 + spec.eps_high, jnp.where(neg, 1.0 - spec.eps_low, 1.0))
  scale = jnp.where(neg, spec.eps_low, spec.eps_high)
  past = (pos & (rho_sg > target)) | (neg & (rho_sg < target))
  return jnp.abs(a) * jnp.square(x.rho - target) / (2.0 * scale), past


def log_bound(x: ShapingInputs, spec: LossSpec) -> tuple[jax.Array, jax.Array]:
  """MHPO modulator: ``-A * exp(c * tanh(log rho / c))``, ``c = log_bound``.

  Maps the ratio into ``(e^-c, e^c)`` smoothly (MHPO, arXiv 2603.16929;
  paper-level reconstruction; its hazard penalty is ``reg='hazard'``).
  """
  c = spec.log_bound
  return -x.a * jnp.exp(c * jnp.tanh(x.logr / c)), _nothing_clipped(x)


def band(
  spec: LossSpec, a: jax.Array, logr: jax.Array, rho: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
  """The ratio band ``[lo, hi]``, its logs, and the per-call adaptive statistics.

  Fixed band: ``[1 - eps_low, 1 + eps_high]``, for ``A < 0`` with
  ``eps_low_neg`` / ``eps_high_neg`` when set (DISPO). ``adaptive='m2po'``:
  ``[e^-tau, e^tau]`` with ``tau`` from `adaptive.m2po_tau`; ``'m2po_capped'``:
  ``[min(e^-tau, 1 - eps_low), max(e^tau, 1 + eps_high)]`` with ``tau`` from
  `adaptive.m2po_capped_tau`;
  ``adaptive='bapo'``: the bounds of `adaptive.bapo_bounds`, starting from
  the fixed band.

  Args:
    spec: the loss spec.
    a: [B, T] advantages.
    logr: [B, T] ``log rho``.
    rho: [B, T] ``rho``.
    mask: [B, T] 1 on valid tokens.

  Returns:
    ``(lo, hi, log_lo, log_hi, stats)``: four [B, T] arrays and a dict of
    scalars (``m2po_tau``, ``bapo_low``, ``bapo_high``).
  """
  lo = jnp.full_like(a, 1.0 - spec.eps_low)
  hi = jnp.full_like(a, 1.0 + spec.eps_high)
  if spec.eps_low_neg is not None:
    lo = jnp.where(a < 0, 1.0 - spec.eps_low_neg, lo)
  if spec.eps_high_neg is not None:
    hi = jnp.where(a < 0, 1.0 + spec.eps_high_neg, hi)
  stats = {}
  if spec.adaptive == "m2po":
    tau = adaptive.m2po_tau(sg(logr), mask, spec.m2po_budget)
    stats["m2po_tau"] = tau
    full = lambda x: jnp.broadcast_to(x, a.shape)
    return full(jnp.exp(-tau)), full(jnp.exp(tau)), full(-tau), full(tau), stats
  if spec.adaptive == "m2po_capped":  # the released M2PO: a band never narrower than eps's
    tau = adaptive.m2po_capped_tau(sg(logr), a, mask, spec.m2po_budget)
    stats["m2po_tau"] = tau
    lo = jnp.broadcast_to(jnp.minimum(jnp.exp(-tau), 1.0 - spec.eps_low), a.shape)
    hi = jnp.broadcast_to(jnp.maximum(jnp.exp(tau), 1.0 + spec.eps_high), a.shape)
    return lo, hi, jnp.log(lo), jnp.log(hi), stats
  if spec.adaptive == "bapo":
    c_lo, c_hi = adaptive.bapo_bounds(
      sg(rho),
      a,
      mask,
      low=1.0 - spec.eps_low,
      high=1.0 + spec.eps_high,
      low_max=spec.bapo_low_max,
      high_max=spec.bapo_high_max,
      step_low=spec.bapo_step_low,
      step_high=spec.bapo_step_high,
      target=spec.bapo_target,
    )
    lo, hi = jnp.broadcast_to(c_lo, a.shape), jnp.broadcast_to(c_hi, a.shape)
    stats["bapo_low"], stats["bapo_high"] = c_lo, c_hi
  return lo, hi, jnp.log(jnp.maximum(lo, 0.0)), jnp.log(hi), stats


SHAPINGS: dict[str, Shaping] = {
  "none": none,
  "clip": clip,
  "mask": mask,
  "truncate": truncate,
  "topr": topr,
  "soft_gate": soft_gate,
  "log_clip": log_clip,
  "regression": regression,
  "bounded_target": bounded_target,
  "log_bound": log_bound,
}
