"""A rollout placed on a disaggregated sampler mesh: `OnSamplerMesh(rollout)`.

Placement is a wrapper over any rollout kind, not a kind of its own
(`protocol.Rollout`). The device split, the weight transfer and the
sampler's parameter copy live in `scale.disagg`; this wrapper keeps the copy
at the behaviour version of the schedule (docs/science.md s5): a step whose
version differs from the copy's first reshards the parameters onto the
sampler mesh (with adapters only the adapters; the frozen base is placed
once). The step's prompts move to the sampler mesh, the wrapped rollout runs
there, and its finished rows move back to the trainer mesh, rows over the
trainer's batch axes, where the step scores, packs and learns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from offpolicy_jax import models
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.protocol import Finished, Rollout
from offpolicy_jax.scale.disagg import SamplerParams, row_shardings, transfer


class OnSamplerMesh(Rollout):
  """`rollout` run on the sampler's own mesh (module docstring).

  Args:
    rollout: the wrapped rollout.
    mesh: the sampler's mesh (`StepFns.sampler_mesh`).
    trainer_mesh: the trainer's mesh (`StepFns.model.mesh`).
    split: whole model state -> `(frozen base or None, trainable)` (`StepFns.model.split`).
  """

  traced = False  # host code around the wrapped rollout's programs (placement and transfers)

  def __init__(self, rollout: Rollout, mesh: Mesh, trainer_mesh: Mesh, split: Callable):
    self.inner, self.mesh, self.trainer_mesh, self._split = rollout, mesh, trainer_mesh, split
    self.copy = SamplerParams(mesh)
    self.base: Any = None  # a LoRA run's frozen base on the sampler mesh, placed once

  @property
  def prefetch(self) -> bool:
    return self.inner.prefetch

  @property
  def item(self) -> str:
    return self.inner.item

  def init(self) -> Any:
    return self.inner.init()

  def arrays(self, rstate) -> Any:
    return self.inner.arrays(rstate)

  def meta(self, rstate) -> dict[str, Any]:
    return self.inner.meta(rstate)

  def restore(self, rstate, arrays, meta: dict[str, Any]) -> Any:
    return self.inner.restore(rstate, arrays, meta)

  def signature(self) -> dict[str, Any] | None:
    return self.inner.signature()

  def with_sampler(self, sampler) -> Rollout:
    inner = self.inner.with_sampler(sampler)
    return OnSamplerMesh(inner, self.mesh, self.trainer_mesh, self._split)

  def advance(self, rstate, params, version, prompts, step, key, latest=None):
    """The wrapped `advance` on the sampler mesh; reshards the copy when `version` changed.

    Returns the wrapped rollout's `(rstate, finished, info)` with `finished` on
    the trainer mesh, and in `info` `reshard_time_s` and `reshard_bytes` (0
    without a reshard).
    """
    base, trainable = self._split(params)
    if base is not None and self.base is None:
      self.base = jax.block_until_ready(SamplerParams(self.mesh).place(base))
    info: dict[str, Any] = {"reshard_time_s": 0.0, "reshard_bytes": 0}
    if version != self.copy.version:
      info = self.copy.sync(trainable, version)
    device = prompt_rows.device_prompts(prompts)
    placed = {**prompts, **transfer(device, row_shardings(device, self.mesh))}
    with jax.set_mesh(self.mesh):
      whole = models.lora.join(self.base, self.copy.params)
      rstate, fin, inner = self.inner.advance(rstate, whole, version, placed, step, key, latest)
    back = lambda tree: transfer(tree, row_shardings(tree, self.trainer_mesh))
    fin = Finished(
      {**prompts, **back(prompt_rows.device_prompts(fin.prompts))},
      back(fin.out),
      fin.versions if isinstance(fin.versions, int) else back(fin.versions),
      None if fin.rewards is None else back(fin.rewards),
      fin.valid,
      fin.order,
    )
    # Device values stay on device: fetching them here would wait for the whole decode.
    return rstate, fin, {**info, **inner}
