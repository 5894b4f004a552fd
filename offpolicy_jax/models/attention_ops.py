"""Attention maths without parameters: rotary embeddings, head projections, grouped attention.

Rotary position embeddings (RoFormer, arXiv:2104.09864) in the "rotate half"
layout of HF checkpoints with llama3 / linear frequency scaling; positions that
left padding does not shift; head projections as one 2-D matmul; the grouped
attention of K continuations to their shared prompt (training with a shared
prefix, and decoding against a per-group prompt cache); and decode attention
over the filled part of the cache only (`over_filled`).

Two implementations of the same maths: ours (`grouped_attention` and the
decoder's einsums), which read head-major keys [B, N_kv, S, H] in place and
one prompt per group; and `fused_attention` / `grouped_fused_attention` over
`jax.nn.dot_product_attention`, the ecosystem call JAX lowers to cuDNN flash
attention on GPU (and that a TPU build can point at its splash kernel), with
the prompt part and the continuation part merged by their log-sum-exps.
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
    own_allowed_ts: [G*K or 1, T, S] which own keys each query sees.
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
  to_self = jnp.where(own_allowed_ts[:, None, None], to_self / root, NEG_INF)
  to_self = to_self.reshape(g, group_size, *to_self.shape[1:])
  probs = jax.nn.softmax(jnp.concatenate([to_prompt, to_self], axis=-1), axis=-1).astype(dt)
  vs_g = vs.astype(dt).reshape(g, group_size, *vs.shape[1:])
  out = jnp.einsum("gckqts,gksh->gctkqh", probs[..., :p], vp.astype(dt)) + jnp.einsum(
    "gckqts,gcksh->gctkqh", probs[..., p:], vs_g
  )
  return out.reshape(qg.shape)


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


def grouped_fused_attention(q_btnh, prefix_kv, own_kv, prompt_mask_gp, own_allowed_bts, dt):
  """`grouped_attention` through `jax.nn.dot_product_attention`, prompts read once per group.

  The K continuations' queries of a group attend to its prompt as one
  sequence of K * T queries, and each row to its own keys; the two partial
  softmaxes merge exactly by their log-sum-exps l_p, l_s:
  out = (e^l_p o_p + e^l_s o_s) / (e^l_p + e^l_s) (Dao, FlashAttention-2,
  arXiv:2307.08691, section 3.1.1).

  Args:
    q_btnh: [G*K, T, N, H] queries, rows group-major.
    prefix_kv: (k, v) [G, N_kv, P, H] of the prompts.
    own_kv: (k, v) [G*K, N_kv, S, H] of each continuation.
    prompt_mask_gp: [G, P] real prompt tokens.
    own_allowed_bts: [G*K or 1, T, S] which own keys each query sees.
    dt: compute dtype.

  Returns:
    [G*K, T, N, H] attention outputs.
  """
  b, t, n, h = q_btnh.shape
  g = prompt_mask_gp.shape[0]
  o_p, l_p = fused_attention(
    q_btnh.reshape(g, b // g * t, n, h), *prefix_kv, prompt_mask_gp[:, None, None, :], dt, True
  )
  o_s, l_s = fused_attention(q_btnh, *own_kv, own_allowed_bts[:, None], dt, True)
  l_p = l_p.reshape(b, t, n).astype(jnp.float32)
  l_s = l_s.astype(jnp.float32)
  top = jnp.maximum(l_p, l_s)
  w_p, w_s = jnp.exp(l_p - top)[..., None], jnp.exp(l_s - top)[..., None]
  out = (w_p * o_p.reshape(b, t, n, h) + w_s * o_s) / (w_p + w_s)
  return out.astype(dt)


# Most branches of `over_filled`'s switch, whatever max_new_tokens / decode_block is: each
# branch compiles its own copy of every layer's attention, and compile time grew faster than
# the copies (qwen2.5-0.5b's sampler at N = 512 on CPU: 13.7 s with 1 span, 18.3 s with 2,
# 35.4 s with 4, unfinished after 540 s with 16; docs/results/compile_time.md).
MAX_SPANS = 3


def over_filled(attend, own_kv, own_allowed_bts, filled, block: int):
  """`attend(own_kv, own_allowed)` over the first ceil(filled / span) * span own slots only.

  Decode step i needs own keys 0..i only; attending over all S slots reads
  (and multiplies by zero) the empty rest of the cache. The static spans
  b, 2 b, ..., S are the branches of one `lax.switch` on the traced `filled`,
  so each step reads the smallest span that holds its keys; b is `block`,
  or larger where S / block would give more than `MAX_SPANS` branches. The
  slots cut off are masked out anyway: the same softmax, so the same
  numbers within float32 summation order (a blockwise softmax merged by
  log-sum-exps would compile flat but round differently in bfloat16, and
  the bf16 learner would no longer reproduce the sampler's log-probs).

  Args:
    attend: `attend((k, v), allowed) -> out` over own keys [B, N_kv, s, H] and
      allowed [B or 1, T, s].
    own_kv: (k, v) [B, N_kv, S, H].
    own_allowed_bts: [B or 1, T, S].
    filled: traced int, slots that any row may attend (max index + 1).
    block: span granularity (>= 1); spans >= S mean one branch, the whole cache.

  Returns:
    What `attend` returns.
  """
  s_max = own_kv[0].shape[2]
  block = max(block, -(-s_max // MAX_SPANS))
  spans = [*range(block, s_max, block), s_max]
  if len(spans) == 1:
    return attend(own_kv, own_allowed_bts)

  def branch(span):
    def run(own_kv, allowed):
      return attend(tuple(x[:, :, :span] for x in own_kv), allowed[..., :span])

    return run

  index = jnp.clip((jnp.asarray(filled) - 1) // block, 0, len(spans) - 1)
  return jax.lax.switch(index, [branch(s) for s in spans], own_kv, own_allowed_bts)
