"""Attention maths without parameters: rotary embeddings, head projections, grouped attention.

Rotary position embeddings (RoFormer, arXiv:2104.09864) in the "rotate half"
layout of HF checkpoints with llama3 / linear frequency scaling; positions that
left padding does not shift; head projections as one 2-D matmul; and the
grouped attention of K continuations to their shared prompt (training with a
shared prefix, and decoding against a per-group prompt cache).
"""

import math

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


def grouped_attention(qg, prefix_kv, own_kv, prompt_mask_gp, own_allowed_ts, dt):
  """Continuations attending to their group's prompt and to their own keys, one softmax.

  Args:
    qg: [G*K, T, N_kv, N/N_kv, H] queries, grouped by kv head, rows group-major.
    prefix_kv: (k, v) [G, N_kv, P, H] of the prompts: read once per group, not
      copied K times.
    own_kv: (k, v) [G*K, N_kv, S, H] of each continuation.
    prompt_mask_gp: [G, P] real prompt tokens.
    own_allowed_ts: [T, S] which own keys each query sees.
    dt: compute dtype.

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
  to_self = jnp.einsum("btkqh,bksh->bkqts", qg, ks.astype(dt), preferred_element_type=jnp.float32)
  to_self = jnp.where(own_allowed_ts, to_self / root, NEG_INF)
  to_self = to_self.reshape(g, group_size, *to_self.shape[1:])
  probs = jax.nn.softmax(jnp.concatenate([to_prompt, to_self], axis=-1), axis=-1).astype(dt)
  vs_g = vs.astype(dt).reshape(g, group_size, *vs.shape[1:])
  out = jnp.einsum("gckqts,gksh->gctkqh", probs[..., :p], vp.astype(dt)) + jnp.einsum(
    "gckqts,gcksh->gctkqh", probs[..., p:], vs_g
  )
  return out.reshape(qg.shape)
