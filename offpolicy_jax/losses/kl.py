"""Per-token KL estimators and memory-light entropy from logits."""

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


def _chunk_entropy(logits_btv: jax.Array) -> jax.Array:
  z = logits_btv.astype(jnp.float32)
  lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
  p = jnp.exp(z - lse)
  return lse[..., 0] - jnp.sum(p * z, axis=-1)


def entropy_from_logits(logits: ArrayLike, *, chunk_size: int = 128) -> jax.Array:
  """Per-position entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.

  Memory-light: the sequence axis is processed in chunks of ``chunk_size``
  positions, each upcast to float32 and rematerialised in the backward pass,
  so at most one ``[B, chunk_size, V]`` float32 temporary is alive at a time
  (never a full ``[B, T, V]`` float32 copy of bfloat16 logits).

  Args:
    logits: [B, T, V] (or [T, V]) logits, any float dtype.
    chunk_size: positions per chunk.

  Returns:
    [B, T] (or [T]) float32 entropy in nats.
  """
  logits = jnp.asarray(logits)
  if logits.ndim == 2:
    return entropy_from_logits(logits[None], chunk_size=chunk_size)[0]
  if logits.ndim != 3:
    raise ValueError(f"logits must be [B, T, V]; got shape {logits.shape}")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size={chunk_size} must be > 0")
  chunk_fn = jax.checkpoint(_chunk_entropy)
  t = logits.shape[1]
  parts = [chunk_fn(logits[:, s : s + chunk_size]) for s in range(0, t, chunk_size)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
