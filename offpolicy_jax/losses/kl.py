"""Per-token KL estimators (k1, k2, k3, abs) from samples of the current policy."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl(
  logp: ArrayLike,
  ref_logp: ArrayLike,
  kind: str = "k3",
  *,
  straight_through: bool = False,
) -> jax.Array:
  """Per-token estimate of KL(pi || ref) from samples of pi.

  With ``d = logp - ref_logp`` (Schulman, "Approximating KL divergence", 2020):
  k1 ``d``; k2 ``d^2 / 2``; k3 ``exp(-d) - 1 + d``; abs ``|d|``.
  ``straight_through=True`` keeps the value of ``kind`` but the gradient of
  k2 (``d * grad logp``), whose gradient is the unbiased reverse-KL gradient
  for on-policy samples (Liu et al., "On the design of KL-regularized policy
  gradient algorithms for LLM reasoning", arXiv 2505.17508).

  Args:
    logp: [...] log-probs of the sampled tokens under the current policy.
    ref_logp: [...] log-probs under the reference policy.
    kind: one of ``k1``, ``k2``, ``k3``, ``abs``.
    straight_through: value of ``kind`` with the gradient of k2.

  Returns:
    [...] per-token KL estimate.
  """
  d = jnp.asarray(logp) - jnp.asarray(ref_logp)
  if kind == "k1":
    value = d
  elif kind == "k2":
    value = 0.5 * d**2
  elif kind == "k3":
    value = jnp.expm1(-d) + d
  elif kind == "abs":
    value = jnp.abs(d)
  else:
    raise ValueError(f"kl kind={kind!r}; expected one of {KL_KINDS}")
  if straight_through:
    k2 = 0.5 * d**2
    value = k2 + jax.lax.stop_gradient(value - k2)
  return value
