"""The adapter on a projection in the decoder's forward pass, with input dropout.

A targeted projection ``y = x W`` of a decoder with `ModelConfig.lora` becomes

  y = x W + (alpha / r) dropout_p(x) A B,    A [in, r], B [r, out]

(Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685; PEFT's ``lora_B(lora_A(lora_dropout(x))) * scaling``).
``dropout_p`` (p = `LoraConfig.dropout`) zeroes each input feature with
probability p and scales the rest by 1 / (1 - p); it acts only when the
forward pass is given a PRNG key, which only the train step's current-policy
forward does (`learn.train_step`). Every other forward (the sampler, the
scorer of old / behaviour log-probs, the reference and proximal policies,
evaluation) passes no key and runs ``x A B``; with p = 0, or without a key, the
forward is exactly the one without dropout (no key is derived or carried).

Keys are explicit arguments of the functional forward: the decoder gives each
layer ``fold_in(key, layer)``, each part of a shared-prefix pass its own fold,
and each projection ``fold_in(layer_key, LORA_TARGETS.index(name))``, so every
adapter input draws an independent mask.

Here, not in `models.lora`: that module builds decoders (it imports
`decoder`), and the decoder's layers need this one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax.models.config import LORA_TARGETS, ModelConfig
from offpolicy_jax.scale import sharding

# Logical names of each projection's (input, output) features (flattened heads).
_NAMES = {
  "q_proj": (sharding.EMBED, sharding.HEADS),
  "k_proj": (sharding.EMBED, sharding.KV_HEADS),
  "v_proj": (sharding.EMBED, sharding.KV_HEADS),
  "o_proj": (sharding.HEADS, sharding.EMBED),
  "gate_proj": (sharding.EMBED, sharding.MLP),
  "up_proj": (sharding.EMBED, sharding.MLP),
  "down_proj": (sharding.MLP, sharding.EMBED),
}


def adapter_name(target: str) -> str:
  """The attribute holding the adapter of projection `target` (``q_proj`` -> ``q_lora``)."""
  return target.replace("_proj", "_lora")


def make_adapter(config: ModelConfig, target: str, rngs: nnx.Rngs) -> nnx.LoRA:
  """An `nnx.LoRA` (A [in, r] He-uniform, B [r, out] zero) for `target`, with logical axis names."""
  lc = config.lora
  assert lc is not None
  d_in, d_out = config.adapter_shapes()[target]
  names = _NAMES[target]
  meta = lambda names: {"out_sharding": names, "eager_sharding": False}
  return nnx.LoRA(
    d_in,
    lc.rank,
    d_out,
    dtype=jnp.dtype(config.dtype),
    param_dtype=jnp.dtype(config.param_dtype),
    rngs=rngs,
    a_metadata=meta((names[0], None)),
    b_metadata=meta((None, names[1])),
  )


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout: x * m / (1 - p), m ~ Bernoulli(1 - p) per element; x when no key or p = 0."""
  if key is None or rate == 0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def fold(key: jax.Array | None, i: int | jax.Array) -> jax.Array | None:
  """``fold_in(key, i)``, or None without a key (the forward without dropout)."""
  return None if key is None else jax.random.fold_in(key, i)


def fold_range(key: jax.Array | None, n: int) -> jax.Array | None:
  """Keys [n] ``fold_in(key, i)`` (of the layers, micro-batches, ...), or None without a key."""
  if key is None:
    return None
  return jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(n))


def dropout_key(config: ModelConfig, key: jax.Array | None) -> jax.Array | None:
  """`key` if the decoder of `config` has adapter dropout (p > 0), else None (no plumbing)."""
  return key if config.lora is not None and config.lora.dropout > 0 else None


class Adapted(nnx.Module):
  """Mixin of the attention and MLP blocks: their adapters and the adapted projections' deltas."""

  config: ModelConfig

  def add_adapters(self, targets: tuple[str, ...], rngs: nnx.Rngs) -> None:
    for name in targets:
      setattr(self, adapter_name(name), make_adapter(self.config, name, rngs))

  def _delta(
    self, name: str, x: jax.Array, shape: tuple, key: jax.Array | None = None
  ) -> jax.Array | float:
    """(alpha / r) dropout(x) A B of projection `name`, reshaped to `shape` (0. when not adapted).

    `key` is the layer's dropout key (None: no dropout); the projection folds in its index.
    """
    lc = self.config.lora
    if lc is None or name not in lc.targets:
      return 0.0
    x = dropout(x, lc.dropout, fold(key, LORA_TARGETS.index(name)))
    adapter = getattr(self, adapter_name(name))
    return (adapter(x) * jnp.asarray(lc.scale, x.dtype)).reshape(shape)
