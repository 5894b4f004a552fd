"""Off-policy diagnostics of every training row: how far mu is, and why (docs/science.md s6-7).

The ratio of the current policy to the behaviour's recorded log-probs factors
through pi_old, the behaviour version's parameters scored by the learner
(`TrainBatch.old_logp`, `rollout.score_old`):

  pi / mu = (pi / pi_old) * (pi_old / mu)
            staleness        engine mismatch
            (+ the update    (other numerics or truncation
            in progress)     at the same parameters)

For each of the three, with ``u`` the per-token log-ratio, the token-weighted
estimates of the KL of the denominator's distribution to the numerator's from
the sampled tokens (Schulman 2020; `losses.kl`): ``k1 = -u``, ``k2 = u^2 / 2``,
``k3 = exp(u) - 1 - u``; for ``pi / mu`` and ``pi_old / mu`` also the ratio's
p1 / p50 / p99 (nearest rank over valid tokens) and the fractions of tokens
below 1 / TAIL and above TAIL. Everything is computed from arrays the step
already has. Names:

  behavior_kl_k{1,2,3}, behavior_ratio_p{1,50,99}, behavior_ratio_tail_{low,high}
  staleness_kl_k{1,2,3}
  mismatch_kl_k{1,2,3}, mismatch_ratio_p{1,50,99}, mismatch_ratio_tail_{low,high}

The mismatch factor does not depend on the parameters being trained and is
computed once on the whole batch. The other two are computed per micro-batch
at the parameters of each optimizer step and combined token-weighted over
micro-batches and updates (a quantile is then the token-weighted mean of the
micro-batches' quantiles: exact with one micro-batch and one update).
Without `rollout.score_old`, pi_old = mu: the mismatch terms are 0 and the
staleness terms equal the behaviour terms.
"""

from typing import Any

import jax
import jax.numpy as jnp

from offpolicy_jax import reductions as red
from offpolicy_jax.losses.kl import kl as kl_estimate
from offpolicy_jax.types import TrainBatch

# Token ratios outside [1 / TAIL, TAIL] are counted in the tail fractions.
TAIL = 2.0
QUANTILES = (1, 50, 99)


def _quantiles(log_ratio: jax.Array, valid: jax.Array) -> jax.Array:
  """exp of the nearest-rank quantiles QUANTILES of `log_ratio` over `valid` tokens (1 if none)."""
  n = valid.sum()
  s = jnp.sort(jnp.where(valid, log_ratio, jnp.inf).ravel())
  q = jnp.asarray(QUANTILES, jnp.float32) / 100.0
  idx = jnp.clip(jnp.round(q * (n - 1)).astype(jnp.int32), 0, s.shape[0] - 1)
  return jnp.where(n > 0, jnp.exp(s[idx]), 1.0)


def _factor(name: str, top, bottom, valid, *, ratios: bool) -> dict[str, Any]:
  """KL estimates (and ratio quantiles and tails) of ``u = top - bottom`` over valid tokens."""
  m = valid.astype(jnp.float32)
  count = m.sum()
  out: dict[str, Any] = {
    f"{name}_kl_{k}": red.Mean((kl_estimate(bottom, top, k) * m).sum(), count)
    for k in ("k1", "k2", "k3")
  }
  if ratios:
    u = jnp.where(valid, top - bottom, 0.0)
    for q, value in zip(QUANTILES, _quantiles(u, valid), strict=True):
      out[f"{name}_ratio_p{q}"] = red.Mean(value * count, count)
    bound = jnp.log(TAIL)
    out[f"{name}_ratio_tail_low"] = red.Mean(((u < -bound) * m).sum(), count)
    out[f"{name}_ratio_tail_high"] = red.Mean(((u > bound) * m).sum(), count)
  return out


def policy_terms(logp: jax.Array, mb: TrainBatch) -> dict[str, Any]:
  """The pi / mu and pi / pi_old terms of a micro-batch at the current parameters (typed)."""
  valid = mb.mask > 0
  logp = jax.lax.stop_gradient(logp)
  return {
    **_factor("behavior", logp, mb.behavior_logp, valid, ratios=True),
    **_factor("staleness", logp, mb.old_logp, valid, ratios=False),
  }


def mismatch_terms(batch: TrainBatch) -> dict[str, jax.Array]:
  """The pi_old / mu terms of the whole batch (plain scalars)."""
  return red.results(
    _factor("mismatch", batch.old_logp, batch.behavior_logp, batch.mask > 0, ratios=True)
  )
