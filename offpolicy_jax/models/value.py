"""A value head on the decoder's trunk: the critic of `learn.critic`.

  V(s_t) = w . h_t + b,   h_t = RMSNorm(h_L) at the state before token t

`ModelConfig.value_head` adds it to a `Decoder` (`Decoder.value_head`, a
`ValueHead`); the policy and the critic then share the trunk and one forward
pass gives both the log-probs and the values (`models.logprobs`). The head
starts at zero (V = 0 everywhere), so it learns from the returns before its
gradient reaches the trunk. It computes in float32 whatever the compute dtype.

Hugging Face checkpoints hold no value head: `hf.from_pretrained` starts it at
zero, or reads `value_head.safetensors` beside the weights, which
`hf.save_pretrained` writes for a model that has one (transformers ignores
the file).

A separate critic (`ModelConfig.critic`, the run's `critic.model`) is a
decoder of its own with a value head, carried as the policy's `critic`
submodule (`attach`), so one parameter state, one optimizer (its gradient
clipped on its own, `train_state.make_optimizer`) and one checkpoint hold
both. It reads the same tokens in its own forward (`values_of`'s `hidden`):
the train step's one program runs both models. It starts from its own
weights (a preset drawn from the seed, or a checkpoint), or as a copy of the
policy's starting weights with a zero head (`with_critic`). An export writes
it as a checkpoint of its own in `critic/` (`hf.save_pretrained`). The
samplers and lag snapshots carry its parameters unused.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from offpolicy_jax.models.config import ModelConfig
from offpolicy_jax.models.layers import param

FILE = "value_head.safetensors"
CRITIC_DIR = "critic"  # a separate critic's checkpoint inside an exported model's


class ValueHead(nnx.Module):
  """`w` [D] (logical axis `embed`) and `b` [], float32, zero at initialisation."""

  def __init__(self, config: ModelConfig):
    self.w = param(None, (config.hidden_size,), ("embed",), jnp.float32, init="zeros")
    self.b = param(None, (), (), jnp.float32, init="zeros")

  def __call__(self, h_btd: jax.Array) -> jax.Array:
    """float32 values [...] of final hidden states [..., D]."""
    w = self.w[...].astype(jnp.float32)
    return jnp.einsum("...d,d->...", h_btd.astype(jnp.float32), w) + self.b[...]


def values_of(model, h_btd: jax.Array | None, hidden=None) -> jax.Array | None:
  """The model's values, or None when it has no critic.

  Args:
    model: the decoder.
    h_btd: the policy's hidden states, which a head on its trunk reads.
    hidden: `decoder -> [..., D]`, the states a separate critic (`model.critic`)
      reads at the same positions, from its own forward over the same tokens.
  """
  head = getattr(model, "value_head", None)
  if head is not None:
    return head(h_btd)
  critic = getattr(model, "critic", None)
  if critic is None:
    return None
  if hidden is None:
    raise ValueError("a separate critic's values need its own forward (`hidden`)")
  return critic.value_head(hidden(critic))


def attach(policy, critic):
  """`policy` carrying the decoder `critic` as its separate critic (`ModelConfig.critic`).

  Raises:
    ValueError: naming what does not fit (`ModelConfig.critic`), e.g. the vocabulary.
  """
  policy.config = dataclasses.replace(policy.config, critic=critic.config)
  policy.critic = critic
  return policy


def has_separate_critic(model) -> bool:
  """Whether `model` carries a separate critic (`ModelConfig.critic`)."""
  return getattr(model, "critic", None) is not None


def _is_critic(path, _) -> bool:
  return path[0] in ("value_head", "critic")


def without_head(params: nnx.State) -> nnx.State:
  """A model's parameter state without its critic: its value head or its separate critic
  (the same state when it has neither)."""
  return nnx.split_state(params, _is_critic, ...)[1]


def with_zero_head(params: nnx.State, abstract: nnx.State) -> nnx.State:
  """`params` (without a head) with the zero head of `abstract` (a parameter state's shapes,
  e.g. `jax.eval_shape` of one); `params` as they are when `abstract` has no head."""
  if "value_head" not in abstract or "value_head" in params:
    return params
  head = nnx.split_state(abstract, _is_critic, ...)[0]
  return nnx.merge_state(params, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), head))


def with_critic(params: nnx.State, initial: nnx.State, from_policy: bool) -> nnx.State:
  """`params` (the policy's, without a critic) with the separate critic a run starts from.

  Args:
    params: the policy's state (a critic in it is dropped).
    initial: the model's initial state (fresh from a seed, or loaded; shapes suffice with
      `from_policy`), whose critic is the start without `from_policy`.
    from_policy: the critic's trunk starts as a copy of the policy's own weights in
      `params` (the critic of "Secrets of RLHF" starts from the SFT model), its head at
      zero; the critic's architecture is then the policy's.
  """
  own = without_head(params)
  if "critic" not in initial:
    return own
  critic = initial["critic"]
  if from_policy:
    head = nnx.split_state(critic, lambda path, _: path[0] == "value_head", ...)[0]
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), head)
    critic = nnx.merge_state(jax.tree.map(jnp.copy, own), zero)
  return nnx.merge_state(own, nnx.State({"critic": critic}))


def save(model, path: str) -> None:
  """Writes the model's value head to `path`/`FILE` (nothing without one)."""
  head = getattr(model, "value_head", None)
  if head is None:
    return
  arrays = {"w": head.w[...], "b": head.b[...]}
  arrays = {k: np.array(jax.device_get(v), np.float32) for k, v in arrays.items()}
  safetensors.numpy.save_file(arrays, os.path.join(path, FILE))


def load(path: str, hidden_size: int) -> dict[str, jax.Array]:
  """The value head stored in `path`/`FILE`, or a zero head when there is none.

  Raises:
    ValueError: naming the file, for a corrupt file, a missing tensor or a bad shape.
  """
  file = os.path.join(path, FILE)
  if not os.path.exists(file):
    return {"w": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  try:
    stored = safetensors.numpy.load_file(file)
  except Exception as e:  # safetensors raises its own error types for a corrupt header
    raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
  shapes = {"w": (hidden_size,), "b": ()}
  for name, shape in shapes.items():
    if name not in stored:
      raise ValueError(f"{file}: the value head has no tensor {name!r}")
    if tuple(stored[name].shape) != shape:
      raise ValueError(
        f"{file}: value head tensor {name!r} has shape {tuple(stored[name].shape)}, "
        f"expected {shape} (hidden size {hidden_size})"
      )
  return {name: jnp.asarray(stored[name], jnp.float32) for name in shapes}
