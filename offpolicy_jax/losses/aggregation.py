"""Exact (sum, count) reductions of per-token losses.

A loss is reported as ``loss_sum`` and ``loss_count``; the scalar loss is
``loss_sum / loss_count``. Summing both over micro-batches (or devices) and
dividing once reproduces the full-batch loss and gradient exactly.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

AGG_MODES = (
  "token_mean",
  "seq_mean_token_mean",
  "seq_mean_token_sum",
  "seq_mean_token_sum_norm",
)


def aggregate(
  loss_bt: ArrayLike,
  mask_bt: ArrayLike,
  agg: str = "token_mean",
  *,
  max_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Reduces per-token values to ``(sum, count)``.

  With ``n_i = sum_t m_it`` and ``S`` the set of sequences with ``n_i > 0``:

  - ``token_mean``: ``(sum_it m l, sum_it m)`` (DAPO's global token mean).
  - ``seq_mean_token_mean``: ``(sum_{i in S} sum_t m l / n_i, |S|)`` (GRPO).
  - ``seq_mean_token_sum``: ``(sum_it m l, |S|)``.
  - ``seq_mean_token_sum_norm``: ``(sum_it m l, |S| * max_len)`` with a
    constant ``max_len`` (Dr. GRPO, Liu et al., arXiv 2503.20783).

  Args:
    loss_bt: [B, T] per-token values.
    mask_bt: [B, T] 1 on valid tokens, 0 on padding.
    agg: aggregation mode.
    max_len: constant for ``seq_mean_token_sum_norm``; ``None`` uses T.

  Returns:
    ``(sum, count)`` float32 scalars; ``count >= 0``.
  """
  loss_bt = jnp.asarray(loss_bt)
  mask_bt = jnp.asarray(mask_bt, loss_bt.dtype)
  masked = jnp.where(mask_bt > 0, loss_bt * mask_bt, 0.0)
  n_b = jnp.sum(mask_bt, axis=-1)
  num_seqs = jnp.sum((n_b > 0).astype(loss_bt.dtype))
  if agg == "token_mean":
    return jnp.sum(masked), jnp.sum(mask_bt)
  if agg == "seq_mean_token_mean":
    per_seq = jnp.sum(masked, axis=-1) / jnp.maximum(n_b, 1e-8)
    return jnp.sum(jnp.where(n_b > 0, per_seq, 0.0)), num_seqs
  if agg == "seq_mean_token_sum":
    return jnp.sum(masked), num_seqs
  if agg == "seq_mean_token_sum_norm":
    norm = loss_bt.shape[-1] if max_len is None else max_len
    return jnp.sum(masked), num_seqs * norm
  raise ValueError(f"agg={agg!r}; expected one of {AGG_MODES}")


def safe_divide(total: ArrayLike, count: ArrayLike) -> jax.Array:
  """``total / count``, and 0 when ``count == 0`` (an all-padding batch)."""
  count = jnp.asarray(count)
  return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)
