"""Grouped-query self-attention with rotary embeddings: the decoder's attention layer.

The attention kernels are in `attention_ops`; this layer holds the projections
(optional q/k/v biases, per-head q/k RMSNorm, LoRA adapters) and applies them in
the decoder's passes: full or cached (`__call__`), a shared prefix, one decode
step or an extension of each row against a prompt cache shared by its group.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax.models import attention_ops as ops
from offpolicy_jax.models import lora_ops
from offpolicy_jax.models.attention_ops import NEG_INF
from offpolicy_jax.models.config import ModelConfig
from offpolicy_jax.models.layers import RMSNorm, param


class Attention(lora_ops.Adapted):
  """Grouped-query self-attention with RoPE and an optional KV cache."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    pd = jnp.dtype(c.param_dtype)
    d, n, kv, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    self.config = c
    self.q_proj = param(rngs.params(), (d, n, h), ("embed", "heads", "head_dim"), pd)
    self.k_proj = param(rngs.params(), (d, kv, h), ("embed", "kv_heads", "head_dim"), pd)
    self.v_proj = param(rngs.params(), (d, kv, h), ("embed", "kv_heads", "head_dim"), pd)
    self.o_proj = param(rngs.params(), (n, h, d), ("heads", "head_dim", "embed"), pd)
    if c.qkv_bias:
      self.q_bias = param(None, (n, h), ("heads", "head_dim"), pd, init="zeros")
      self.k_bias = param(None, (kv, h), ("kv_heads", "head_dim"), pd, init="zeros")
      self.v_bias = param(None, (kv, h), ("kv_heads", "head_dim"), pd, init="zeros")
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.rms_norm_eps, ("head_dim",), c)
      self.k_norm = RMSNorm(h, c.rms_norm_eps, ("head_dim",), c)

  def _qkv(self, x_btd, cos_bth, sin_bth, key=None):
    """Rotated queries [B,T,N,H], keys and values [B,N_kv,T,H] (compute dtype).

    `key`: the adapters' dropout key (`lora_ops`), None for none.
    """
    c = self.config
    dt = jnp.dtype(c.dtype)
    q, k, v = (
      ops.project_heads(x_btd, w[...].astype(dt)) for w in (self.q_proj, self.k_proj, self.v_proj)
    )
    if c.lora is not None:
      q, k, v = (
        y + self._delta(name, x_btd, y.shape, key)
        for y, name in zip((q, k, v), ("q_proj", "k_proj", "v_proj"), strict=True)
      )
    if c.qkv_bias:
      q = q + jnp.broadcast_to(self.q_bias[...].astype(dt), q.shape)
      k = k + jnp.broadcast_to(self.k_bias[...].astype(dt), k.shape)
      v = v + jnp.broadcast_to(self.v_bias[...].astype(dt), v.shape)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    # Keys and values head-major [B, N_kv, T, H], the cache's layout: both attention
    # matmuls read them as they lie (with [B, T, N_kv, H] XLA's CPU backend
    # transposed every layer's whole cache at every decode step).
    k = ops.apply_rope(k, cos_bth, sin_bth)
    return ops.apply_rope(q, cos_bth, sin_bth), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

  def _out(self, out_btnh, key=None):
    # One [B*T, N*H] x [N*H, D] matmul (a free reshape of both operands); as a
    # 4-D einsum XLA's CPU backend transposed the weight at every decode step.
    dt = jnp.dtype(self.config.dtype)
    b, t, n, h = out_btnh.shape
    w = self.o_proj[...].astype(dt)
    x = out_btnh.reshape(b, t, n * h)
    out = jnp.dot(x, w.reshape(n * h, w.shape[-1]))
    return out + self._delta("o_proj", x, out.shape, key)

  def _grouped(self, q_btnh):
    """Queries [B,T,N,H] as [B,T,N_kv,N/N_kv,H] (the query heads sharing each kv head)."""
    b, t, n, h = q_btnh.shape
    kv = self.config.num_kv_heads
    return q_btnh.reshape(b, t, kv, n // kv, h)

  def __call__(
    self, x_btd, cos_bth, sin_bth, allowed_bts, cache_kv=None, cache_index=None, key=None
  ):
    q, k, v = self._qkv(x_btd, cos_bth, sin_bth, key)
    if cache_kv is not None:
      k_cache, v_cache = cache_kv
      start = (0, 0, cache_index, 0)
      k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), start)
      v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), start)
      cache_kv = (k, v)
    return self._out(self._attend(q, k, v, allowed_bts), key), cache_kv

  def _attend(self, q_btnh, k_bksh, v_bksh, allowed_bts):
    """softmax(q k^T / sqrt(H), allowed) v over head-major keys/values; [B, T, N, H]."""
    dt = jnp.dtype(self.config.dtype)
    if self.config.attention == "dot_product":
      return ops.fused_attention(q_btnh, k_bksh, v_bksh, allowed_bts[:, None], dt)
    scores = jnp.einsum(
      "btkgh,bksh->bkgts",
      self._grouped(q_btnh),
      k_bksh.astype(dt),
      preferred_element_type=jnp.float32,
    )
    scores = scores / math.sqrt(q_btnh.shape[-1])
    scores = jnp.where(allowed_bts[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bkgts,bksh->btkgh", probs, v_bksh.astype(dt)).reshape(q_btnh.shape)

  def shared_prefix(self, x_p, x_s, rope_p, rope_s, prompt_mask_gp, group_size, key=None):
    """Attention of G prompts [G,P,D] and their K continuations each [G*K,N,D].

    Prompt queries attend causally within their prompt (real tokens only); a
    continuation's queries attend to all real tokens of its group's prompt and
    causally to its own tokens. The prompt keys/values are computed once per
    group and shared by the K continuations; the softmax runs jointly over the
    prompt and continuation keys, as in the concatenated sequence. With a
    dropout `key`, the prompts' adapters fold in 0 and the continuations' 1.
    """
    p, n_len = prompt_mask_gp.shape[1], x_s.shape[1]
    key_p, key_s = lora_ops.fold(key, 0), lora_ops.fold(key, 1)
    qp, kp, vp = self._qkv(x_p, *rope_p, key_p)
    qs, ks, vs = self._qkv(x_s, *rope_s, key_s)
    causal_p = jnp.tril(jnp.ones((p, p), bool))[None] & prompt_mask_gp[:, None, :]
    out_s = self._grouped_attention(
      qs, (kp, vp), (ks, vs), prompt_mask_gp, jnp.tril(jnp.ones((1, n_len, n_len), bool))
    )
    return self._out(self._attend(qp, kp, vp, causal_p), key_p), self._out(out_s, key_s)

  def decode_shared(self, x_b1d, rope, prefix_kv, suffix_kv, prompt_mask_gp, index, block=0):
    """One decode step of K continuations per prompt against a per-group prompt cache.

    Args:
      x_b1d: [G*K, 1, D] normalised hidden states of the new tokens (group-major).
      rope: (cos, sin) [G*K, 1, H] at the new tokens' positions.
      prefix_kv: (k, v) [G, N_kv, P, H] of the prompts, written once by the prefill.
      suffix_kv: (k, v) [G*K, N_kv, S, H] of the continuations so far.
      prompt_mask_gp: [G, P] real prompt tokens.
      index: slot of the new token in the suffix cache (traced): a scalar, or
        int32 [G*K], one per row (rows at different lengths).
      block: 0 attends over all S own slots; else over the filled ones only,
        rounded up to a multiple of `block` (`attention_ops.over_filled`).

    Returns:
      (attention output [G*K, 1, D], updated suffix (k, v)).
    """
    q, k, v = self._qkv(x_b1d, *rope)
    rows = jnp.arange(x_b1d.shape[0])
    if jnp.ndim(index):
      ks, vs = (
        c.at[rows, :, index].set(x[:, :, 0].astype(c.dtype))
        for c, x in zip(suffix_kv, (k, v), strict=True)
      )
    else:
      start = (0, 0, index, 0)
      ks, vs = (
        jax.lax.dynamic_update_slice(c, x.astype(c.dtype), start)
        for c, x in zip(suffix_kv, (k, v), strict=True)
      )
    index_b = jnp.broadcast_to(index, rows.shape)
    allowed = (jnp.arange(ks.shape[2])[None, :] <= index_b[:, None])[:, None, :]

    def attend(own_kv, allowed):
      return self._grouped_attention(q, prefix_kv, own_kv, prompt_mask_gp, allowed)

    if block:
      out = ops.over_filled(attend, (ks, vs), allowed, jnp.max(index_b) + 1, block)
    else:
      out = attend((ks, vs), allowed)
    return self._out(out), (ks, vs)

  def extend_shared(
    self, x_btd, rope, prefix_kv, suffix_kv, prompt_mask_gp, index_b, counts_b, block=0
  ):
    """T new tokens per row written into its own suffix cache at once (`Decoder.extend_shared`).

    Query t of row b sits at suffix slot index[b] + t; it attends to its
    group's real prompt keys and causally to the row's own slots
    0..index[b] + t. Only the first counts[b] new keys/values of a row are
    written (the rest are dropped: the cache is unchanged beyond them, and
    the outputs of those queries are meaningless).

    Args:
      x_btd: [G*K, T, D] normalised hidden states of the new tokens.
      rope: (cos, sin) [G*K, T, H] at the new tokens' positions.
      prefix_kv: (k, v) [G, N_kv, P, H] of the prompts.
      suffix_kv: (k, v) [G*K, N_kv, S, H] of the rows so far.
      prompt_mask_gp: [G, P] real prompt tokens.
      index_b: int32 [G*K] suffix slot of each row's first new token.
      counts_b: int32 [G*K] real new tokens of each row (0..T).
      block: as for `decode_shared` (spans over the filled slots only).

    Returns:
      (attention output [G*K, T, D], updated suffix (k, v)).
    """
    q, k, v = self._qkv(x_btd, *rope)
    b, t = x_btd.shape[:2]
    s = suffix_kv[0].shape[2]
    steps = jnp.arange(t)[None, :]
    slots = index_b[:, None] + steps  # [B, T]
    dest = jnp.where(steps < counts_b[:, None], slots, s)  # slot s is out of range: dropped
    rows = jnp.arange(b)[:, None]
    ks, vs = (
      c.at[rows, :, dest].set(jnp.swapaxes(x, 1, 2).astype(c.dtype), mode="drop")
      for c, x in zip(suffix_kv, (k, v), strict=True)
    )
    allowed = jnp.arange(s)[None, None, :] <= slots[:, :, None]

    def attend(own_kv, allowed):
      return self._grouped_attention(q, prefix_kv, own_kv, prompt_mask_gp, allowed)

    if block:
      out = ops.over_filled(attend, (ks, vs), allowed, jnp.max(index_b + counts_b), block)
    else:
      out = attend((ks, vs), allowed)
    return self._out(out), (ks, vs)

  def _grouped_attention(self, q_btnh, prefix_kv, own_kv, prompt_mask_gp, own_allowed_bts):
    dt = jnp.dtype(self.config.dtype)
    if self.config.attention == "dot_product":
      return ops.grouped_fused_attention(
        q_btnh, prefix_kv, own_kv, prompt_mask_gp, own_allowed_bts, dt
      )
    out = ops.grouped_attention(
      self._grouped(q_btnh), prefix_kv, own_kv, prompt_mask_gp, own_allowed_bts, dt
    )
    return out.reshape(q_btnh.shape)
