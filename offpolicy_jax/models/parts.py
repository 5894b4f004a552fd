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
from offpolicy_jax.models import tokenizers
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
  """

  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef
  build: Callable[[int], nnx.Module]
  tokenizer: tokenizers.Tokenizer
  key: str
  lora: LoraConfig | None = None
  stacked: bool = False

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
