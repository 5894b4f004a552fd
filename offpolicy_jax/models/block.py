"""One decoder block: h + Attn(RMSNorm(h)), then h + FeedForward(RMSNorm(h)).

The feed-forward is the SwiGLU `layers.MLP`, or with `num_experts` the
mixture of experts `moe.MoE`. The block returns its routing: the experts
each token took (None for a dense block) and, given a token mask, their
`moe.RouterStats`; given the experts the sampler recorded, it compares with
them and, with `replay`, routes along them (`models.moe`). `models.decoder`
runs the blocks.
"""

from flax import nnx

from offpolicy_jax.models import lora_ops
from offpolicy_jax.models.attention import Attention
from offpolicy_jax.models.config import ModelConfig
from offpolicy_jax.models.layers import MLP, RMSNorm
from offpolicy_jax.models.moe import MoE


class DecoderLayer(nnx.Module):
  """Pre-norm block: h + Attn(norm(h)), then h + MLP(norm(h))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ("embed",), config)
    self.self_attn = Attention(config, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      config.hidden_size, config.rms_norm_eps, ("embed",), config
    )
    self.mlp = MoE(config, rngs=rngs) if config.num_experts else MLP(config, rngs=rngs)

  def __call__(
    self,
    h_btd,
    cos_bth,
    sin_bth,
    allowed_bts,
    cache_kv=None,
    cache_index=None,
    key=None,
    route=None,
  ):
    """`(h, stats, experts, cache_kv)`: the block's output, its routing (`_feed_forward`)."""
    attn, cache_kv = self.self_attn(
      self.input_layernorm(h_btd), cos_bth, sin_bth, allowed_bts, cache_kv, cache_index, key
    )
    return *self._feed_forward(h_btd + attn, key, route), cache_kv

  def _feed_forward(self, h_btd, key=None, route=None):
    """`(h, stats, experts)`: with experts, `moe.MoE.forward`'s routing, else None twice.

    `route` is `(router_mask [B, T] or None, recorded [B, T, k] or None, replay)`.
    """
    x = self.post_attention_layernorm(h_btd)
    if not isinstance(self.mlp, MoE):
      return h_btd + self.mlp(x, key), None, None
    y, stats, experts = self.mlp.forward(x, *(route or (None, None, False)))
    return h_btd + y, stats, experts

  def shared_prefix(
    self, h_p, h_s, rope_p, rope_s, prompt_mask_gp, group_size, key=None, routes=None
  ):
    """The block on prompts [G,P,D] and their continuations [G*K,N,D] (see `Attention`).

    Returns `(h_p, h_s, stats)`: `routes` is the prompts' and the continuations'
    `route` (`_feed_forward`); stats, the `moe.RouterStats` of both together,
    are None for a dense block or without masks.
    """
    attn_p, attn_s = self.self_attn.shared_prefix(
      self.input_layernorm(h_p),
      self.input_layernorm(h_s),
      rope_p,
      rope_s,
      prompt_mask_gp,
      group_size,
      key,
    )
    key_p, key_s = lora_ops.fold(key, 0), lora_ops.fold(key, 1)  # as in the attention
    route_p, route_s = routes or (None, None)
    h_p, stats_p, _ = self._feed_forward(h_p + attn_p, key_p, route_p)
    h_s, stats_s, _ = self._feed_forward(h_s + attn_s, key_s, route_s)
    return h_p, h_s, None if stats_p is None else stats_p + stats_s

  def decode_shared(self, h_b1d, rope, prefix_kv, suffix_kv, prompt_mask_gp, index, block=0):
    """One decode step against a per-group prompt cache (see `Attention`): `(h, experts, kv)`."""
    attn, suffix_kv = self.self_attn.decode_shared(
      self.input_layernorm(h_b1d), rope, prefix_kv, suffix_kv, prompt_mask_gp, index, block
    )
    h, _, experts = self._feed_forward(h_b1d + attn)
    return h, experts, suffix_kv

  def extend_shared(
    self, h_btd, rope, prefix_kv, suffix_kv, prompt_mask_gp, index_b, counts_b, block=0
  ):
    """The block for T new tokens per row against a per-group prompt cache (see `Attention`)."""
    attn, suffix_kv = self.self_attn.extend_shared(
      self.input_layernorm(h_btd),
      rope,
      prefix_kv,
      suffix_kv,
      prompt_mask_gp,
      index_b,
      counts_b,
      block,
    )
    return self._feed_forward(h_btd + attn)[0], suffix_kv
