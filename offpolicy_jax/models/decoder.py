"""Flax NNX decoder for the Qwen2 / Qwen3 / Llama 3.x / Qwen3-MoE / Mixtral families.

  h_0 = E[tokens]
  h'  = h + Attn(RMSNorm(h)),   h_{l+1} = h' + W_down (silu(W_gate x) * W_up x),  x = RMSNorm(h')
  logits = RMSNorm(h_L) W_out   (W_out = E^T when embeddings are tied)

Grouped-query attention with rotary embeddings (`attention_ops`), optional
q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3). With `num_experts` the
feed-forward is a mixture of experts (`models.moe`: Qwen3-MoE, Mixtral). One
block is `models.block.DecoderLayer`.

With `config.lora`, each targeted projection carries a low-rank adapter,
`y = x W + (alpha / r) dropout(x) A B` (`lora_ops`; `nnx.LoRA` holds A and B as
`nnx.LoRAParam`s, so `nnx.split(model, nnx.LoRAParam, ...)` separates the
adapters from the frozen base); the adapters are added after every base
parameter is drawn, so the base of a seed is the same with and without them.
The adapters' input dropout acts only in the teacher-forced forward passes
given a `dropout_key` (the train step's); all others run without it.

Every parameter carries logical axis names in its `out_sharding` metadata
(`vocab`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`), so
`nnx.get_partition_spec(nnx.state(model))` yields logical PartitionSpecs that a
rules table maps onto a mesh. Activations [B, T, D] are constrained to
`(batch, length, embed)` after the embedding and after every block
(`sharding.constrain`: rows over `(data, fsdp)`); the constraint applies when a
mesh is set with `jax.set_mesh` (the run's jitted steps set theirs) and is a
no-op otherwise.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax.models import attention_ops as ops
from offpolicy_jax.models import layout, lora_ops
from offpolicy_jax.models.attention_ops import default_positions
from offpolicy_jax.models.block import DecoderLayer
from offpolicy_jax.models.config import ModelConfig
from offpolicy_jax.models.layers import MLP, RMSNorm, param
from offpolicy_jax.models.moe import Routed, by_layer
from offpolicy_jax.models.value import ValueHead
from offpolicy_jax.scale import sharding


class KVCache(NamedTuple):
  """Per-layer key/value cache, laid out as the blocks are (`models.layout`).

  Attributes:
    k: tuple (one per layer) of [B, N_kv, S, H] keys (compute dtype), head-major;
      with stacked blocks (``scan_layers``) one array [L, B, N_kv, S, H].
    v: the values, as `k`.
  """

  k: Any
  v: Any

  def rows(self, index) -> "KVCache":
    """The cache of rows `index` (an int array over B) in every layer."""
    if isinstance(self.k, tuple):
      return jax.tree.map(lambda c: c[index], self)
    return jax.tree.map(lambda c: c[:, index], self)

  def put_rows(self, dst, new: "KVCache") -> "KVCache":
    """This cache with rows `dst` set to `new`'s rows (out-of-bounds rows dropped)."""
    lead = () if isinstance(self.k, tuple) else (slice(None),)
    return jax.tree.map(
      lambda big, x: big.at[(*lead, dst)].set(x.astype(big.dtype), mode="drop"), self, new
    )


def _constrain(h_btd: jax.Array) -> jax.Array:
  """Activations [B, T, D] with rows over the batch axes of the ambient mesh (if any)."""
  return sharding.constrain(h_btd, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))


class Decoder(nnx.Module):
  """Decoder-only transformer; see the module docstring for the maths.

  Call: `model(tokens[B,T], positions=None, attention_mask=None) -> logits[B,T,V] f32`.
  With a cache: `model(tokens[B,T], attention_mask=kv_mask[B,S], cache=cache,
  cache_index=i) -> (logits[B,T,V], cache)`; the T new tokens are written at cache
  slots i..i+T-1, query t attends to slots j <= i + t with kv_mask[b, j] = 1, and
  default positions are `cumsum(kv_mask) - 1` at slots i..i+T-1.

  Sampling K continuations per prompt against a prompt cache shared by the
  group: `decode_shared` (one token per row) and `extend_shared` (up to T
  tokens per row at each row's own slots, e.g. a multi-turn environment's
  observation appended in one pass).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    pd = jnp.dtype(c.param_dtype)
    self.embed_tokens = param(rngs.params(), (c.vocab_size, c.hidden_size), ("vocab", "embed"), pd)
    layers = [DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)]
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, ("embed",), c)
    if not c.tie_embeddings:
      self.lm_head = param(rngs.params(), (c.hidden_size, c.vocab_size), ("embed", "vocab"), pd)
    if c.value_head:  # the critic's head (`models.value`), drawn from no key
      self.value_head = ValueHead(c)
    if c.lora is not None:  # last, so the base parameters do not depend on the adapters
      adapter_rngs = nnx.Rngs(params=rngs.params())
      attn = tuple(t for t in c.lora.targets if t in ("q_proj", "k_proj", "v_proj", "o_proj"))
      mlp = tuple(t for t in c.lora.targets if t not in attn)
      for layer in layers:
        layer.self_attn.add_adapters(attn, adapter_rngs)
        if isinstance(layer.mlp, MLP):  # a mixture of experts takes none (`ModelConfig`)
          layer.mlp.add_adapters(mlp, adapter_rngs)
    # Drawn one by one in both layouts, so a seed's weights do not depend on the layout.
    self.layers = layout.stack_modules(layers) if c.scan_layers else nnx.List(layers)
    if c.critic is not None:  # a separate critic (`models.value`), drawn after the policy
      self.critic = Decoder(c.critic, rngs=rngs)

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    """Zero KV cache of `max_len` slots for `batch` rows (compute dtype by default)."""
    c = self.config
    dtype = jnp.dtype(dtype or c.dtype)
    shape = (batch, c.num_kv_heads, max_len, c.head_dim)
    if c.scan_layers and c.scan_decode:  # stacked like the blocks: [L, B, N_kv, S, H]
      return KVCache(*(jnp.zeros((c.num_layers, *shape), dtype) for _ in "kv"))
    return KVCache(*(tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers)) for _ in "kv"))

  def hidden_states(
    self,
    tokens,
    positions=None,
    attention_mask=None,
    cache=None,
    cache_index=None,
    dropout_key=None,
  ):
    """Final-norm hidden states [B, T, D] (compute dtype) and the updated cache (or None).

    `dropout_key` turns on the adapters' input dropout (`lora_ops`; no cache
    only); ignored when the config has none.
    """
    return self.routed(tokens, positions, attention_mask, cache, cache_index, dropout_key)[:2]

  def routed(
    self,
    tokens,
    positions=None,
    attention_mask=None,
    cache=None,
    cache_index=None,
    dropout_key=None,
    router_mask=None,
    recorded=None,
    replay: bool = False,
  ):
    """`hidden_states` and the experts' routing: `(h, cache, Routed)` (None for a dense model).

    Args:
      tokens, positions, attention_mask, cache, cache_index, dropout_key: as
        for `hidden_states`.
      router_mask: [B, T] tokens the `moe.RouterStats` count (no cache only);
        None: no stats.
      recorded: int [B, T, L, k] the experts a sampler recorded for these
        tokens (routing replay; no cache only), or None.
      replay: route along `recorded` (R3) instead of the router's own top-k.

    Returns:
      (h, cache, routed): `moe.Routed` with the stats [L, ...] and the experts
      each token took [B, T, L, k].
    """
    tokens = jnp.asarray(tokens)
    b, t = tokens.shape
    if cache is None:
      mask = jnp.ones((b, t), bool) if attention_mask is None else jnp.asarray(attention_mask) > 0
      q_offset, s = 0, t
    else:
      if attention_mask is None or cache_index is None:
        raise ValueError("attention_mask (kv mask [B,S]) and cache_index are required with cache")
      mask = jnp.asarray(attention_mask) > 0
      q_offset, s = cache_index, mask.shape[1]
    if positions is None:
      positions = default_positions(mask)
      if cache is not None:
        positions = jax.lax.dynamic_slice_in_dim(positions, q_offset, t, axis=1)
    cos, sin = self._rope(positions)
    q_idx = q_offset + jnp.arange(t)
    allowed = (jnp.arange(s)[None, :] <= q_idx[:, None])[None] & mask[:, None, :]
    h = self._embed(tokens)
    counted = None if router_mask is None else jnp.asarray(router_mask) > 0
    if cache is None:
      keys = lora_ops.fold_range(
        lora_ops.dropout_key(self.config, dropout_key), self.config.num_layers
      )

      def block(layer, h, key, rec):
        out = layer(h, cos, sin, allowed, key=key, route=(counted, rec, replay))
        return _constrain(out[0]), out[1:3]

      h, (stats, experts) = self._apply_layers(block, h, keys, by_layer(recorded))
      return self.norm(h), None, self._routed(stats, experts)
    if dropout_key is not None or router_mask is not None or recorded is not None:
      raise ValueError("dropout_key, router_mask, recorded: teacher-forced forward (no cache) only")

    def cached(layer, h, kv):
      h, _, ex, kv = layer(h, cos, sin, allowed, kv, cache_index)
      return _constrain(h), KVCache(*kv), ex

    h, cache, experts = layout.apply_cached(self.layers, self.config, cached, h, cache)
    return self.norm(h), cache, self._routed(None, experts)

  def _routed(self, stats, experts_l):
    """`moe.Routed` of per-block stats [L, ...] and experts [L, B, T, k] (None: dense)."""
    if not self.config.num_experts:
      return None
    return Routed(stats, jnp.moveaxis(experts_l, 0, 2))

  def shared_prefix_hidden_states(
    self, prompt_tokens, prompt_mask, tokens, group_size: int, dropout_key=None
  ):
    """Final-norm hidden states of K continuations per prompt, each prompt run once.

    Equals `hidden_states` of the concatenations ``[prompt_g, tokens_b]`` with
    attention mask ``[prompt_mask_g, 1...]`` for rows ``b = g * K + k``
    (group-major), within float tolerance, with the prompt's share of the
    work done once per group instead of K times.

    Args:
      prompt_tokens: int32 [G, P] left-padded prompts.
      prompt_mask: [G, P] 1 on real prompt tokens.
      tokens: int32 [G*K, N] continuations, group-major.
      group_size: K.
      dropout_key: turns on the adapters' input dropout (as in `hidden_states`).

    Returns:
      (h_prompt [G, P, D], h_tokens [G*K, N, D]).
    """
    args = (prompt_tokens, prompt_mask, tokens, group_size, dropout_key)
    return self.shared_prefix_routed(*args)[:2]

  def shared_prefix_routed(
    self,
    prompt_tokens,
    prompt_mask,
    tokens,
    group_size: int,
    dropout_key=None,
    router_mask=None,
    recorded=None,
    replay: bool = False,
  ):
    """`shared_prefix_hidden_states` and the experts' `moe.RouterStats`: `(h_p, h_s, stats)`.

    The stats [L, ...] count the real prompt tokens (each K times, as `routed`
    on the K concatenated rows would) and the continuation tokens with
    `router_mask` [G*K, N]; None for a dense model
    or without `router_mask`. `recorded` is the pair (prompts' experts
    [G, P, L, k], continuations' [G*K, N, L, k]) and `replay` as in `routed`.
    """
    prompt_tokens, tokens = jnp.asarray(prompt_tokens), jnp.asarray(tokens)
    prompt_mask = jnp.asarray(prompt_mask) > 0
    n = tokens.shape[1]
    lengths = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)
    suffix_positions = jnp.repeat(lengths, group_size)[:, None] + jnp.arange(n)[None, :]
    rope_p = self._rope(default_positions(prompt_mask))
    rope_s = self._rope(suffix_positions)
    k = float(group_size)  # each prompt token weighs K, as in `routed` on the K full rows
    counted = None if router_mask is None else (prompt_mask * k, jnp.asarray(router_mask) > 0)
    rec_p, rec_s = recorded or (None, None)

    def block(layer, hs, key, rec):
      routes = ((counted and counted[0], rec[0], replay), (counted and counted[1], rec[1], replay))
      h_p, h_s, stats = layer.shared_prefix(
        *hs, rope_p, rope_s, prompt_mask, group_size, key, routes
      )
      return (_constrain(h_p), _constrain(h_s)), stats

    hs = (self._embed(prompt_tokens), self._embed(tokens))
    keys = lora_ops.fold_range(
      lora_ops.dropout_key(self.config, dropout_key), self.config.num_layers
    )
    (h_p, h_s), stats = self._apply_layers(block, hs, keys, (by_layer(rec_p), by_layer(rec_s)))
    return self.norm(h_p), self.norm(h_s), stats

  def decode_shared(
    self, tokens_b, prefix: KVCache, suffix: KVCache, prompt_mask, index, block: int = 0
  ):
    """Final-norm hidden states [G*K, D] of one new token per row, prompts cached once per group.

    Equals a decode step of `hidden_states` with the prompt's cache repeated K
    times (within float tolerance), but reads each prompt's keys and values once
    per group.

    Args:
      tokens_b: int32 [G*K] the new tokens (group-major rows).
      prefix: the prompts' cache, [G, N_kv, P, H] per layer (the prefill's).
      suffix: the continuations' cache, [G*K, N_kv, S, H] per layer.
      prompt_mask: [G, P] 1 on real prompt tokens.
      index: suffix slot of the new tokens (their position is prompt length + index):
        a scalar, or int32 [G*K] per row.
      block: 0 attends over every suffix slot; else over the filled slots only,
        in spans of `block` (the same numbers, less of the cache read).

    Returns:
      (h [G*K, D], updated suffix cache).
    """
    return self.decode_shared_routed(tokens_b, prefix, suffix, prompt_mask, index, block)[:2]

  def decode_shared_routed(
    self, tokens_b, prefix: KVCache, suffix: KVCache, prompt_mask, index, block: int = 0
  ):
    """`decode_shared` and the experts each new token took: `(h, cache, experts [G*K, L, k])`.

    experts is None for a dense model (what routing replay records).
    """
    prompt_mask = jnp.asarray(prompt_mask) > 0
    rows = tokens_b.shape[0]
    lengths = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)
    positions = jnp.repeat(lengths, rows // prompt_mask.shape[0]) + index
    positions = positions[:, None]
    rope = self._rope(positions)
    h = self._embed(tokens_b[:, None])

    def cached(layer, h, kvs):
      pre, suf = kvs
      h, ex, kv = layer.decode_shared(h, rope, pre, suf, prompt_mask, index, block)
      return _constrain(h), KVCache(*kv), ex

    h, cache, experts = layout.apply_cached(self.layers, self.config, cached, h, [prefix, suffix])
    routed = self._routed(None, experts)
    return self.norm(h)[:, 0], cache, routed and routed.experts[:, 0]

  def extend_shared(
    self,
    tokens_bt,
    counts_b,
    prefix: KVCache,
    suffix: KVCache,
    prompt_mask,
    index_b,
    block: int = 0,
  ):
    """Appends up to T tokens per row to its suffix cache in one pass (e.g. an observation).

    Row b's tokens ``tokens_bt[b, :counts[b]]`` are written at suffix slots
    ``index[b] .. index[b] + counts[b] - 1`` (positions prompt length + slot),
    attending to the group's prompt cache and causally to the row's own
    filled slots, as `decode_shared` would one token at a time (within float
    tolerance; `tests/test_multiturn.py`), in one call of T queries instead
    of T calls. Tokens past ``counts[b]`` are padding: their keys and values
    are not written, so nothing a later step reads changes; a row with
    counts 0 keeps its cache as it was.

    Args:
      tokens_bt: int32 [G*K, T] new tokens (group-major rows), padded past counts.
      counts_b: int32 [G*K] real new tokens of each row, 0 <= counts <= T.
      prefix: the prompts' cache, [G, N_kv, P, H] per layer (the prefill's).
      suffix: the rows' own cache, [G*K, N_kv, S, H] per layer.
      prompt_mask: [G, P] 1 on real prompt tokens.
      index_b: int32 [G*K] suffix slot of each row's first new token (its
        filled slots so far); index + counts <= S.
      block: 0 attends over every suffix slot; else over the filled ones
        only, in spans of `block` (`attention_ops.over_filled`).

    Returns:
      (h [G*K, D] final-norm hidden state at each row's last real new token,
      whose logits predict the row's next token (meaningless for counts 0),
      updated suffix cache).
    """
    prompt_mask = jnp.asarray(prompt_mask) > 0
    tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
    b, t = tokens_bt.shape
    index_b = jnp.broadcast_to(jnp.asarray(index_b, jnp.int32), (b,))
    counts_b = jnp.broadcast_to(jnp.asarray(counts_b, jnp.int32), (b,))
    lengths = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)
    start = jnp.repeat(lengths, b // prompt_mask.shape[0]) + index_b
    rope = self._rope(start[:, None] + jnp.arange(t)[None, :])
    h = self._embed(tokens_bt)

    def cached(layer, h, kvs):
      pre, suf = kvs
      h, kv = layer.extend_shared(h, rope, pre, suf, prompt_mask, index_b, counts_b, block)
      return _constrain(h), KVCache(*kv), None

    h, cache, _ = layout.apply_cached(self.layers, self.config, cached, h, [prefix, suffix])
    last = jnp.maximum(counts_b - 1, 0)[:, None, None]
    h_last = jnp.take_along_axis(h, last, axis=1)[:, 0]
    return self.norm(h_last), cache

  def _embed(self, tokens):
    return _constrain(jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.config.dtype))

  def _rope(self, positions):
    """(cos, sin) [B, T, H] of the rotary embedding at `positions` [B, T]."""
    freqs = jnp.multiply.outer(jnp.asarray(positions, jnp.float32), ops.rope_inv_freq(self.config))
    freqs = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(freqs), jnp.sin(freqs)

  def _apply_layers(self, block, carry, keys=None, xs=None):
    """``carry, y_l = block(layer, carry, key_l, x_l)`` over the layers (`layout.apply`)."""
    return layout.apply(self.layers, self.config, block, carry, keys, xs)

  def logits_from_hidden(self, h_btd: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final hidden states [..., D]."""
    dt = jnp.dtype(self.config.dtype)
    if self.config.tie_embeddings:
      w = self.embed_tokens[...].astype(dt)
      return jnp.einsum("...d,vd->...v", h_btd, w, preferred_element_type=jnp.float32)
    w = self.lm_head[...].astype(dt)
    return jnp.einsum("...d,dv->...v", h_btd, w, preferred_element_type=jnp.float32)

  def __call__(self, tokens, positions=None, attention_mask=None, cache=None, cache_index=None):
    h, new_cache = self.hidden_states(tokens, positions, attention_mask, cache, cache_index)
    logits = self.logits_from_hidden(h)
    return logits if cache is None else (logits, new_cache)
