"""`lag.mode="async"`: a sampler thread runs the rollout half ahead of the trainer.

The thread samples with the latest published parameters (`lag.AsyncSampler`),
scores and packs the batch; the trainer's `rl_step.learn` consumes it. In a
disaggregated run (`disagg`) the thread samples on the sampler's own mesh,
each publish reshards the parameters onto it, and each batch moves to the
trainer mesh on the thread, so sampling overlaps training. Batches
more than `lag.max_staleness` loop steps old are dropped (and counted). Not
bit-reproducible (thread timing decides versions), and on resume the batches
that were queued when the checkpoint was taken are not replayed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import jax

from offpolicy_jax import disagg, lag, rl_step, rollouts, sharding


class LockedIterator:
  """A data iterator shared by the trainer (checkpoints) and a sampler thread."""

  def __init__(self, it):
    self._it = it
    self._lock = threading.Lock()

  def __next__(self):
    with self._lock:
      return next(self._it)

  def get_state(self):
    with self._lock:
      return self._it.get_state()

  def set_state(self, state):
    with self._lock:
      self._it.set_state(state)


class AsyncProducer:
  """Produces scored `TrainBatch`es on a thread with the latest published parameters.

  Args:
    fns: the run's step functions.
    params: the parameters to start sampling with (copied).
    step: the loop step the run is at (versions are in optimizer steps: step * U).
    data_iter: the shared prompt iterator.
    seed: the run's seed.
    max_staleness: in loop steps; 0 for no bound.
  """

  def __init__(self, fns: rl_step.StepFns, params, step: int, data_iter, seed: int, max_staleness):
    self._fns, self._data, self._seed = fns, data_iter, seed
    self._produced = step
    self._pack = jax.jit(rollouts.pack, static_argnums=(0, 1))
    self._mesh = fns.sampler_mesh or fns.mesh
    self._copy, place = None, None
    if fns.sampler_mesh is not None:
      self._copy = copy = disagg.SamplerParams(fns.sampler_mesh)
      place = lambda p: jax.block_until_ready(copy.place(p))
    bound = max_staleness * fns.updates or 2**30
    self.sampler = lag.AsyncSampler(
      self._sample, params, step * fns.updates, max_staleness=bound, place=place
    )

  def _sample(self, params, version: int):
    fns = self._fns
    self._produced += 1
    step, start = self._produced, time.perf_counter()
    local = next(self._data)
    prompts = rollouts.assemble_global(self._mesh, local)
    key = rl_step.step_key(self._seed, step, rl_step.SAMPLE)
    own_mesh = jax.set_mesh(self._mesh) if self._copy else contextlib.nullcontext()
    with own_mesh:
      out = fns.sampler(params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)
      rewards_b, info = rollouts.score(fns, prompts, out)
      adv_key = rl_step.step_key(self._seed, step, rl_step.ADV)
      batch = self._pack(fns.sizes, fns.advantage, prompts, out, rewards_b, version, adv_key)
    if self._copy is not None:  # to the trainer mesh, on this thread
      batch = disagg.transfer(batch, sharding.batch_shardings(batch, fns.mesh))
    info["prompts_truncated"] = int((local["truncated"] & local["valid"]).sum())
    info["sample_time_s"] = time.perf_counter() - start
    return batch, info

  def get(self, step: int) -> tuple[Any, dict[str, Any]]:
    """The next batch within the staleness bound for loop step `step`, and its host info."""
    current = (step - 1) * self._fns.updates
    batch, info = self.sampler.get(current_version=current, timeout=600.0, with_info=True)
    info["async_dropped_batches"] = self.sampler.stats["dropped_batches"]
    return batch, info

  def publish(self, params, step: int) -> dict[str, Any]:
    """Hands the trainer's parameters after `step` to the sampler (copied: the state is donated).

    Returns:
      In a disaggregated run, `reshard_time_s` (from the trainer's step being
      done to the copy being on the sampler's devices) and `reshard_bytes`;
      else nothing.
    """
    if self._copy is None:
      self.sampler.publish(params, step * self._fns.updates)
      return {}
    jax.block_until_ready(params)  # the trainer's step is done: time only the copy
    begin = time.perf_counter()
    self.sampler.publish(params, step * self._fns.updates)
    return {
      "reshard_time_s": time.perf_counter() - begin,
      "reshard_bytes": disagg.tree_bytes(params),
    }

  def close(self) -> None:
    self.sampler.close()
