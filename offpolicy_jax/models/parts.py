"""`ModelParts`: what a run's parameters are, built once from its config.

The mesh the parameters live on, the model's graph, how to initialise or load
its weights, its tokenizer and its adapters. Every program of a run is built
on one `ModelParts` (`run_state.StepFns.model`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import nnx

from offpolicy_jax.models import lora as lora_lib
from offpolicy_jax.models import tokenizers, value
from offpolicy_jax.models.config import LoraConfig
from offpolicy_jax.scale import sharding


@dataclasses.dataclass(frozen=True, eq=False)
class ModelParts:
  """The model half of a run's static parts (hashable by identity, like `StepFns`).

  Attributes:
    mesh: the trainer's device mesh, which the parameters are placed on.
    graphdef: the model's graph (`nnx.split`), without weights.
    build: `seed -> module`, freshly initialised from `seed` or loaded from
      the run's checkpoint.
    tokenizer: the run's tokenizer.
    key: what the parameters' initial values depend on (the warm start's
      cache key, `components.warm_start_key`).
    lora: the adapters (`lora.rank > 0`): the trained parameters are the
      adapters; None: the whole model is trained.
    stacked: the blocks are stored stacked over layers (`ModelConfig.scan_layers`,
      `models.layout`), which a run's checkpoints record.
    critic: the model carries a separate critic (`ModelConfig.critic`): "policy"
      when it starts as a copy of the policy's starting weights, "own" when it
      keeps its own initial weights; "" without one.
  """

  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef
  build: Callable[[int], nnx.Module]
  tokenizer: tokenizers.Tokenizer
  key: str
  lora: LoraConfig | None = None
  stacked: bool = False
  critic: str = ""

  def init_params(self, seed: int) -> nnx.State:
    """Freshly initialised (from `seed`) or loaded parameters, placed on the mesh.

    The whole model's state; with adapters, `split` separates base and adapters.
    """
    _, params = nnx.split(self.build(seed))
    return sharding.shard_params(params, self.mesh)

  def split(self, params: nnx.State) -> tuple[nnx.State | None, nnx.State]:
    """`(base, trainable)` of a whole state: `(None, params)` without adapters."""
    if self.lora is None:
      return None, params
    return lora_lib.split(params)

  def with_critic(self, params: nnx.State, seed: int) -> nnx.State:
    """`params` a run starts from (the policy's, warm-started) with the separate critic seed
    `seed` starts with (`value.with_critic`): its own initial weights, drawn or loaded
    again (a warm start never trains it), or a copy of the policy's."""
    if not self.critic:
      return params
    if self.critic == "policy":
      params = value.with_critic(params, jax.eval_shape(lambda: self.init_params(seed)), True)
    else:
      params = value.with_critic(params, self.init_params(seed), False)
    return sharding.shard_params(params, self.mesh)  # the fresh zero head on the mesh too
