"""Attention maths without parameters: rotary embeddings, head projections, grouped attention.

Rotary position embeddings (RoFormer, arXiv:2104.09864) in the "rotate half"
layout of HF checkpoints with llama3 / linear frequency scaling; positions that
left padding does not shift; head projections as one 2-D matmul; the grouped
attention of K continuations to their shared prompt (training with a shared
prefix, and decoding against a per-group prompt cache); and decode attention
over the filled part of the cache only (`own_blocks`).

Two implementations of the same maths: ours (`grouped_attention` and the
decoder's einsums), which read head-major keys [B, N_kv, S, H] in place and
one prompt per group; and `fused_attention` / `grouped_fused_attention` over
`jax.nn.dot_product_attention`, the ecosystem call JAX lowers to cuDNN flash
attention on GPU (and that a TPU build can point at its splash kernel), with
the prompt part and the continuation part merged by their log-sum-exps.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from offpolicy_jax.models.config import ModelConfig

NEG_INF = -1e30


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """Inverse frequencies theta^(-2i/H), i < H/2, with optional llama3/linear scaling.

  Args:
    config: model config.

  Returns:
    float32 [H/2] inverse frequencies.
  """
  h = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  scaling = config.rope_scaling_dict
  if scaling is None:
    return inv_freq
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return inv_freq
  if kind == "linear":
    return inv_freq / scaling["factor"]
  if kind != "llama3":
    raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear)")
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(medium, smoothed, scaled)


def project_heads(x_btd, w_dnh):
  """``einsum("btd,dnh->btnh")`` as one 2-D matmul on free reshapes (no weight transpose)."""
  d, n, h = w_dnh.shape
  return jnp.dot(x_btd, w_dnh.reshape(d, n * h)).reshape(*x_btd.shape[:-1], n, h)


def apply_rope(x_btnh, cos_bth, sin_bth):
  half = x_btnh.shape[-1] // 2
  rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
  cos, sin = (
    cos_bth[:, :, None, :].astype(x_btnh.dtype),
    sin_bth[:, :, None, :].astype(x_btnh.dtype),
  )
  return x_btnh * cos + rotated * sin


def default_positions(attention_mask: ArrayLike) -> jax.Array:
  """positions = cumsum(mask) - 1 clipped at 0, so left padding does not shift positions."""
  mask = jnp.asarray(attention_mask).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def grouped_attention(
  qg, prefix_kv, own_kv, prompt_mask_gp, own_allowed_ts, dt, filled=None, block: int = 0
):
  """Continuations attending to their group's prompt and to their own keys, one softmax.

  Args:
    qg: [G*K, T, N_kv, N/N_kv, H] queries, grouped by kv head, rows group-major.
    prefix_kv: (k, v) [G, N_kv, P, H] of the prompts: read once per group, not
      copied K times.
    own_kv: (k, v) [G*K, N_kv, S, H] of each continuation.
    prompt_mask_gp: [G, P] real prompt tokens.
    own_allowed_ts: [G*K or 1, T, S] which own keys each query sees.
    dt: compute dtype.
    filled, block: with `block`, only the own slots below `filled` (traced) are
      read, `block` at a time (`own_blocks`), each block's softmax merged by its
      log-sum-exp: the same numbers within float tolerance.

  Returns:
    [G*K, T, N_kv, N/N_kv, H] attention outputs.
  """
  (kp, vp), (ks, vs) = prefix_kv, own_kv
  g, p = prompt_mask_gp.shape
  group_size = qg.shape[0] // g
  root = math.sqrt(qg.shape[-1])
  qg_g = qg.reshape(g, group_size, *qg.shape[1:])
  to_prompt = jnp.einsum(
    "gctkqh,gksh->gckqts", qg_g, kp.astype(dt), preferred_element_type=jnp.float32
  )
  to_prompt = jnp.where(prompt_mask_gp[:, None, None, None, None, :], to_prompt / root, NEG_INF)

  def self_scores(k_bsh, allowed):
    scores = jnp.einsum(
      "btkqh,bksh->bkqts", qg, k_bsh.astype(dt), preferred_element_type=jnp.float32
    )
    return jnp.where(allowed[:, None, None], scores / root, NEG_INF)

  blocks = own_blocks(filled, block, ks.shape[2])
  if blocks is not None:
    return _grouped_blocked(qg, to_prompt, vp, self_scores, own_kv, own_allowed_ts, dt, blocks)
  to_self = self_scores(ks, own_allowed_ts).reshape(g, group_size, *qg.shape[2:4], qg.shape[1], -1)
  probs = jax.nn.softmax(jnp.concatenate([to_prompt, to_self], axis=-1), axis=-1).astype(dt)
  vs_g = vs.astype(dt).reshape(g, group_size, *vs.shape[1:])
  out = jnp.einsum("gckqts,gksh->gctkqh", probs[..., :p], vp.astype(dt)) + jnp.einsum(
    "gckqts,gcksh->gctkqh", probs[..., p:], vs_g
  )
  return out.reshape(qg.shape)


def _grouped_blocked(qg, to_prompt, vp, self_scores, own_kv, own_allowed_ts, dt, blocks):
  """`grouped_attention` reading the own keys a block at a time: the prompt's softmax and
  each block's merge by their log-sum-exps (`_merge`), one loop per layer."""
  b, t = qg.shape[:2]
  lse_p = jax.nn.logsumexp(to_prompt, axis=-1, keepdims=True)
  probs = jnp.exp(to_prompt - lse_p).astype(dt)
  # Outputs in the compute dtype, as the one-softmax path's (XLA's CPU runtime has no
  # bfloat16 x bfloat16 -> float32 batched dot).
  o_p = jnp.einsum("gckqts,gksh->gctkqh", probs, vp.astype(dt)).astype(jnp.float32)
  # [B, T, N_kv, N/N_kv, H] and [B, T, N_kv, N/N_kv]
  prompt = (o_p.reshape(qg.shape), jnp.moveaxis(lse_p[..., 0], -1, 2).reshape(qg.shape[:-1]))
  ks, vs = own_kv
  allowed = jnp.broadcast_to(own_allowed_ts, (b, *own_allowed_ts.shape[1:]))

  def merge_block(i, acc):
    start, fresh = blocks.span(i)
    sees = jax.lax.dynamic_slice_in_dim(allowed, start, blocks.size, axis=-1) & fresh[None, None]
    k, v = (jax.lax.dynamic_slice_in_dim(x, start, blocks.size, axis=2) for x in (ks, vs))
    scores = self_scores(k, sees)  # [B, N_kv, N/N_kv, T, block]
    lse = jax.nn.logsumexp(scores, axis=-1, keepdims=True)
    pr = jnp.exp(scores - lse).astype(dt)
    o = jnp.einsum("bkqts,bksh->btkqh", pr, v.astype(dt)).astype(jnp.float32)
    part = (o, jnp.moveaxis(lse[..., 0], -1, 1))
    return _merge(acc, part, jnp.any(sees, axis=-1)[:, :, None, None])

  return jax.lax.fori_loop(0, blocks.n, merge_block, prompt)[0].astype(dt)


class _Blocks(NamedTuple):
  """The own-key blocks a decode step reads: `n` (traced) blocks of `size` of `slots`."""

  n: jax.Array
  size: int
  slots: int

  def span(self, i):
    """(start, fresh [size]): block i starts at i * size, moved back to fit in the slots;
    `fresh` marks its slots that no earlier block covered."""
    start = jnp.minimum(i * self.size, self.slots - self.size)
    return start, start + jnp.arange(self.size) >= i * self.size


def own_blocks(filled, block: int, slots: int) -> _Blocks | None:
  """The blocks of `block` own slots that hold slots 0..filled - 1, or None: read all `slots`.

  Decode step i needs own keys 0..i only; attending over all S slots reads
  (and multiplies by zero) the empty rest of the cache. A loop with a traced
  trip count over blocks of `block` slots reads only the filled ones, in one
  program whatever S is (a `lax.switch` over the spans block, 2 block, ..., S
  compiled S / block copies of the attention per layer: minutes of compile at
  S = 512). A last block that would run past S starts at S - block instead;
  the slots it shares with the block before are counted once.
  """
  if not block or block >= slots or filled is None:
    return None
  count = (jnp.clip(jnp.asarray(filled, jnp.int32), 1, slots) + block - 1) // block
  return _Blocks(count, block, slots)


def fused_attention(q_btnh, k_bksh, v_bksh, mask, dt, residual=False):
  """`jax.nn.dot_product_attention` of queries [B, T, N, H] over head-major keys/values.

  Args:
    q_btnh: [B, T, N, H] queries.
    k_bksh, v_bksh: [B, N_kv, S, H] keys and values (the cache layout; the call
      takes [B, S, N_kv, H], a transpose).
    mask: bool, broadcastable to [B, N, T, S]: which keys each query sees.
    dt: compute dtype.
    residual: also return the log-sum-exp [B, T, N] of each query's logits.

  Returns:
    [B, T, N, H] outputs (and the log-sum-exp with `residual`).
  """
  k, v = (jnp.swapaxes(x, 1, 2).astype(dt) for x in (k_bksh, v_bksh))
  return jax.nn.dot_product_attention(q_btnh.astype(dt), k, v, mask=mask, return_residual=residual)


def grouped_fused_attention(
  q_btnh, prefix_kv, own_kv, prompt_mask_gp, own_allowed_bts, dt, filled=None, block: int = 0
):
  """`grouped_attention` through `jax.nn.dot_product_attention`, prompts read once per group.

  The K continuations' queries of a group attend to its prompt as one
  sequence of K * T queries, and each row to its own keys; the partial
  softmaxes (the prompt's, the own keys' or each block of them) merge exactly
  by their log-sum-exps l_1, l_2: out = (e^l_1 o_1 + e^l_2 o_2) / (e^l_1 + e^l_2)
  (Dao, FlashAttention-2, arXiv:2307.08691, section 3.1.1).

  Args:
    q_btnh: [G*K, T, N, H] queries, rows group-major.
    prefix_kv: (k, v) [G, N_kv, P, H] of the prompts.
    own_kv: (k, v) [G*K, N_kv, S, H] of each continuation.
    prompt_mask_gp: [G, P] real prompt tokens.
    own_allowed_bts: [G*K or 1, T, S] which own keys each query sees.
    dt: compute dtype.
    filled, block: as for `grouped_attention`.

  Returns:
    [G*K, T, N, H] attention outputs.
  """
  b, t, n, h = q_btnh.shape
  g = prompt_mask_gp.shape[0]
  kp, vp = prefix_kv
  o_p, l_p = fused_attention(
    q_btnh.reshape(g, b // g * t, n, h), kp, vp, prompt_mask_gp[:, None, None, :], dt, True
  )
  prompt = (o_p.reshape(b, t, n, h).astype(jnp.float32), l_p.reshape(b, t, n).astype(jnp.float32))
  ks, vs = own_kv
  blocks = own_blocks(filled, block, ks.shape[2])
  if blocks is None:
    o_s, l_s = fused_attention(q_btnh, ks, vs, own_allowed_bts[:, None], dt, True)
    return _merge(prompt, (o_s, l_s), jnp.ones((), bool))[0].astype(dt)
  allowed = jnp.broadcast_to(own_allowed_bts, (b, *own_allowed_bts.shape[1:]))

  def merge_block(i, acc):
    start, fresh = blocks.span(i)
    sees = jax.lax.dynamic_slice_in_dim(allowed, start, block, axis=-1) & fresh[None, None]
    k, v = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=2) for x in (ks, vs))
    part = fused_attention(q_btnh, k, v, sees[:, None], dt, True)
    return _merge(acc, part, jnp.any(sees, axis=-1)[..., None])

  return jax.lax.fori_loop(0, blocks.n, merge_block, prompt)[0].astype(dt)


def _merge(a, b, b_sees):
  """Two partial attentions `(out [..., H], lse [...])` as one (float32); `b` counts where
  `b_sees` (broadcastable to lse) holds: a query that sees none of b's keys keeps a."""
  (o_a, l_a), (o_b, l_b) = a, b
  l_b = jnp.where(b_sees, l_b.astype(jnp.float32), -jnp.inf)
  top = jnp.maximum(l_a, l_b)
  w_a, w_b = jnp.exp(l_a - top), jnp.exp(l_b - top)
  o_b = jnp.where(b_sees[..., None], o_b.astype(jnp.float32), 0.0)
  out = (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None]
  return out, top + jnp.log(w_a + w_b)
