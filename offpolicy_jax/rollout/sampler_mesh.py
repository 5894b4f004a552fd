"""The sampler side of a disaggregated sync-mode run: a parameter copy, rollouts, rewards.

The device split, the weight transfer and the sampler's parameter copy live in
`scale.disagg`; this module runs the schedule's rollouts on the sampler mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from offpolicy_jax import lag, models
from offpolicy_jax.rollout import pipeline, rl_step
from offpolicy_jax.scale import sharding
from offpolicy_jax.scale.disagg import SamplerParams, row_shardings, transfer


class Sampled(NamedTuple):
  """A rollout dispatched on the sampler mesh and moved to the trainer mesh.

  Attributes:
    out: the `sampling.SampleOutput`, rows over the trainer's batch axes.
    version: the behaviour loop step v (int32 scalar on the trainer mesh).
    found: whether the behaviour snapshot was present.
    rewards: float32 [B] device rewards on the trainer mesh, or None (host rewards).
    info: host metrics (`reshard_time_s`, `reshard_bytes`; 0 without a sync).
  """

  out: Any
  version: jax.Array
  found: Any
  rewards: jax.Array | None
  info: dict[str, Any]


class SamplerMesh:
  """The sampler side of a disaggregated sync-mode run: a parameter copy, rollouts, rewards.

  The copy holds the behaviour parameters of the schedule, v(t) (SCIENCE.md
  s5); a step whose v(t) differs from the copy's version first reshards the
  trainer's parameters (or its snapshot of v(t)) onto the sampler mesh. With
  adapters, those are the adapters: the frozen base is placed once.

  Args:
    fns: the run's step functions (`fns.sampler_mesh` set).
    opts: the run's replay options (which compiled programs of the state to use).
    schedule: `(sync_interval, sync_offset)` as ints.
    seed: the run's seed.
  """

  def __init__(
    self, fns: rl_step.StepFns, opts: rl_step.ReplayOptions, schedule: tuple[int, int], seed: int
  ):
    assert fns.sampler_mesh is not None
    self.fns, self.replay, self.schedule, self.seed = fns, opts, schedule, seed
    self.mesh: Mesh = fns.sampler_mesh
    self.copy = SamplerParams(self.mesh)
    self.base: Any = None  # a LoRA run's frozen base on the sampler mesh, placed once
    self._rep = sharding.replicated(fns.mesh)

  def _behaviour_loop_step(self, state: rl_step.RunState, step: int) -> int:
    if state.snapshots is None:
      return step - 1
    return lag.behavior_version(step, *self.schedule)

  def _sync(self, state: rl_step.RunState, step: int, v: int) -> tuple[bool, dict[str, Any]]:
    if state.snapshots is None:  # on-policy: the trainer's own parameters
      return True, self.copy.sync(state.train.params, v)
    fn = rl_step.programs(self.fns, self.replay, state).behaviour
    put = lambda a: sharding.put(np.int32(a), self._rep)
    lag_a = rl_step.LagSchedule(put(self.schedule[0]), put(self.schedule[1]))
    params, _, found = fn(state, put(step), lag_a)
    # `params` is a fresh selection (never the state's own buffers): donate it.
    return bool(found), self.copy.sync(params, v, donate=True)

  def sample(self, state: rl_step.RunState, local: dict[str, Any], step: int) -> Sampled:
    """Samples (and scores, for a device reward) step `step`'s prompts on the sampler mesh.

    Args:
      state: the trainer's run state (read only at a sync).
      local: this process's block of the step's prompts (numpy).
      step: the loop step, 1-indexed.
    """
    v = self._behaviour_loop_step(state, step)
    if state.base is not None and self.base is None:
      self.base = jax.block_until_ready(SamplerParams(self.mesh).place(state.base))
    found, info = True, {"reshard_time_s": 0.0, "reshard_bytes": 0}
    if v != self.copy.version:
      found, info = self._sync(state, step, v)
    prompts = pipeline.assemble_global(self.mesh, local)
    fns, trainer = self.fns, self.fns.mesh
    with jax.set_mesh(self.mesh):
      params = models.lora.join(self.base, self.copy.params)
      out = pipeline.sample(fns, params, prompts, step, self.seed)
      rewards = None
      if fns.reward.device is not None:
        rewards = pipeline.score_on_device(fns, prompts, out)
    out = transfer(out, row_shardings(out, trainer))
    if rewards is not None:
      rewards = transfer(rewards, sharding.batch_sharding(trainer, 1))
    version = sharding.put(np.int32(v), self._rep)
    return Sampled(out, version, found, rewards, info)
