"""`lag.mode="async"`: a sampler thread runs the rollout half ahead of the trainer.

The thread samples with the latest published parameters (`SamplerThread`),
scores and packs the batch; the trainer's `learning.learn` consumes it. In a
disaggregated run (`disagg`) the thread samples on the sampler's own mesh,
each publish reshards the parameters onto it, and each batch moves to the
trainer mesh on the thread, so sampling overlaps training. Batches
more than `lag.max_staleness` loop steps old are dropped (and counted).
Multi-turn episodes (`rollout.episodes.WholeEpisodes`) look for newer parameters before
every turn: an episode in flight continues under them, and each policy token
records the version that drew it.

A kind with carried state (partial rollouts, the episode pool) runs here as in
a sync run: the thread owns the state and advances it batch after batch, and
each batch brings a copy of the state as its advance left it
(`Rollout.arrays` / `meta`), which the trainer takes into its own run state
before learning the batch. A checkpoint therefore holds the groups in flight
as they were after the last batch learnt. Not bit-reproducible (thread timing
decides versions), and on resume the batches that were queued when the
checkpoint was taken are not replayed.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import lag, models
from offpolicy_jax.rewards import verifiers
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.scale import disagg, sharding
from offpolicy_jax.step import host_step, run_state


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
    base: the frozen base of adapter `params` (`RunState.base`), placed on the
      sampler's mesh once; only adapters are published afterwards.
    rstate: the rollout's carried state to start from (`RunState.rollout`; copied).
    threads: sampler threads (`lag.sampler_threads`), each with a batch in flight and
      its own lane of verifier workers (`rewards.verifiers.lane`); a kind with
      carried state takes one.
  """

  def __init__(
    self,
    fns: run_state.StepFns,
    params,
    step: int,
    data_iter,
    seed: int,
    max_staleness,
    base=None,
    rstate=None,
    threads: int = 1,
  ):
    self._fns, self._data, self._seed = fns, data_iter, seed
    rollout = fns.rollout
    if rollout.item and threads > 1:
      raise ValueError(
        f"lag.sampler_threads: {threads} threads, but a rollout with carried state "
        f"({rollout.item}: rollout.partial_budget > 0) takes one sampler thread"
      )
    self._step_lock = threading.Lock()
    self._rstate = (
      rollout.restore(rollout.init(), *carried(rollout, rstate)) if rollout.item else None
    )
    self._counted = (0.0, 0.0)  # the sampler's busy seconds and dropped tokens already reported
    self._produced = step
    self._mesh = fns.sampler_mesh or fns.model.mesh
    self._copy, place = None, None
    self._base = base
    if fns.sampler_mesh is not None:
      self._copy = copy = disagg.SamplerParams(fns.sampler_mesh)
      place = lambda p: jax.block_until_ready(copy.place(p))
      if base is not None:
        self._base = jax.block_until_ready(disagg.SamplerParams(fns.sampler_mesh).place(base))
    bound = fns.learner.version(max_staleness) or 2**30
    self.sampler = SamplerThread(
      self._sample,
      params,
      fns.learner.version(step),
      max_staleness=bound,
      place=place,
      threads=threads,
      thread_context=verifiers.lane,
    )

  def _sample(self, params, version: int):
    fns = self._fns
    with self._step_lock:
      self._produced += 1
      step, local = self._produced, next(self._data)
    start = time.perf_counter()
    prompts = prompt_rows.assemble_global(self._mesh, local)
    own_mesh = jax.set_mesh(self._mesh) if self._copy else contextlib.nullcontext()
    # An episode continues under parameters published while it runs.
    latest = lambda: self._joined(*self.sampler.latest())
    with own_mesh:
      full = models.lora.join(self._base, params)
      rollout, rstate = fns.rollout, self._rstate
      args = (full, version, prompts, step, self._seed, latest)
      rstate, batch, keep, info = host_step.collect(fns, rollout, rstate, *args)
    self._rstate = rstate
    info["keep"] = keep
    info["carried"] = carried(rollout, rstate) if rollout.item else None
    if self._copy is not None:  # to the trainer mesh, on this thread
      batch = disagg.transfer(batch, sharding.batch_shardings(batch, fns.model.mesh))
    info["prompts_truncated"] = prompt_rows.truncated(local)
    info["sample_time_s"] = time.perf_counter() - start
    return batch, info

  def _joined(self, params, version: int) -> tuple[Any, int]:
    return models.lora.join(self._base, params), version

  def get(self, step: int) -> tuple[Any, dict[str, Any]]:
    """The next batch within the staleness bound for loop step `step`, and its host info.

    The info holds `keep` (`host_step.collect`) and `carried`: the rollout's
    carried state after this batch (`carried`), or None for a stateless kind.
    """
    current = self._fns.learner.version(step - 1)
    batch, info = self.sampler.get(current_version=current, timeout=600.0, with_info=True)
    stats = self.sampler.stats
    info["async_dropped_batches"] = stats["dropped_batches"]
    # Since the previous step (the run's cost accounting, `step.costs`).
    info["async_sampler_busy_s"] = stats["busy_s"] - self._counted[0]
    info["async_dropped_tokens"] = stats["dropped_tokens"] - self._counted[1]
    self._counted = (stats["busy_s"], stats["dropped_tokens"])
    return batch, info

  def publish(self, params, step: int) -> dict[str, Any]:
    """Hands the trainer's parameters after `step` to the sampler (copied: the state is donated).

    Returns:
      In a disaggregated run, `reshard_time_s` (from the trainer's step being
      done to the copy being on the sampler's devices) and `reshard_bytes`;
      else nothing.
    """
    if self._copy is None:
      self.sampler.publish(params, self._fns.learner.version(step))
      return {}
    jax.block_until_ready(params)  # the trainer's step is done: time only the copy
    begin = time.perf_counter()
    self.sampler.publish(params, self._fns.learner.version(step))
    return {
      "reshard_time_s": time.perf_counter() - begin,
      "reshard_bytes": disagg.tree_bytes(params),
    }

  def close(self) -> None:
    self.sampler.close()


def carried(rollout: Rollout, rstate) -> tuple[Any, dict[str, Any]]:
  """A copy of a rollout's carried state in its checkpoint form: `(arrays, meta)`.

  `rollout.restore(like, *carried(rollout, rstate))` gives a state that shares
  nothing with `rstate`: the sampler thread goes on advancing its own while
  the trainer checkpoints (or donates) the copy.
  """
  arrays = jax.tree.map(_copy, rollout.arrays(rstate))
  return arrays, copy.deepcopy(rollout.meta(rstate))


def _copy(x):
  return jnp.copy(x) if isinstance(x, jax.Array) else np.array(x, copy=True)


class SamplerThread:
  """Runs a sampler on a background thread, ahead of the trainer.

  The thread repeatedly calls ``sample_fn(params, version)`` with the most
  recently published parameters and queues the resulting ``TrainBatch``
  (whose ``versions`` record the producing version per token). The queue
  bounds how far the sampler runs ahead. :meth:`get` enforces
  ``max_staleness`` against the trainer's version: with ``mode="drop"`` whole
  batches whose oldest token is too stale are discarded; with
  ``mode="weight"`` stale rows keep their place but their
  ``TrainBatch.weights`` are multiplied by ``stale_weight``. Both are counted
  in :attr:`stats`. ``place`` makes the sampler's copy of published
  parameters (default: a device copy; a disaggregated run reshards them onto
  the sampler's mesh, `disagg.SamplerParams.place`). With ``threads`` > 1,
  that many threads call ``sample_fn`` at once (it must allow that), each
  inside ``thread_context(i)`` when given, so several batches are in flight;
  ``stats["busy_s"]`` counts the seconds in which at least one was sampling.

  Example::

    sampler = SamplerThread(sample_fn, params, 0, max_staleness=2)
    for t in range(1, steps + 1):
      batch = sampler.get(current_version=t - 1)
      state, metrics = train_step(state, batch, key)
      sampler.publish(state.params, t)
    sampler.close()
  """

  def __init__(
    self,
    sample_fn: Callable[[Any, int], Any],
    params: Any,
    version: int,
    *,
    max_staleness: int,
    mode: str = "drop",
    stale_weight: float = 0.0,
    queue_size: int = 2,
    place: Callable[[Any], Any] | None = None,
    threads: int = 1,
    thread_context: Callable[[int], Any] | None = None,
  ):
    if mode not in ("drop", "weight"):
      raise ValueError(f"mode must be 'drop' or 'weight', got {mode!r}")
    if max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if queue_size < 1:
      raise ValueError(f"queue_size must be >= 1, got {queue_size}")
    if threads < 1:
      raise ValueError(f"threads must be >= 1, got {threads}")
    self._sample_fn = sample_fn
    self._place = place or (lambda p: jax.tree.map(jnp.copy, p))
    self._latest = (self._place(params), int(version))
    self._lock = threading.Lock()
    self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self.max_staleness = max_staleness
    self.mode = mode
    self.stale_weight = stale_weight
    self.stats: dict[str, float] = {
      "produced": 0,
      "consumed": 0,
      "dropped_batches": 0,
      "downweighted_rows": 0,
    }
    # Seconds in `sample_fn` (its batch ready), and response tokens of dropped batches.
    self.stats |= {"busy_s": 0.0, "dropped_tokens": 0.0}
    self._sampling, self._busy_since = 0, 0.0  # threads in `sample_fn`; its last change
    context = thread_context or (lambda i: contextlib.nullcontext())
    self._threads = [
      threading.Thread(target=self._run, args=(context(i),), daemon=True) for i in range(threads)
    ]
    for t in self._threads:
      t.start()

  def latest(self) -> tuple[Any, int]:
    """The newest published ``(params, version)`` (the sampler's copy)."""
    with self._lock:
      return self._latest

  def publish(self, params: Any, version: int) -> None:
    """Makes ``params`` (at ``version``) the sampler's parameters from now on.

    A device copy is taken (by `place`), so the trainer may donate its state afterwards.
    """
    params = self._place(params)
    with self._lock:
      self._latest = (params, int(version))

  def _count_busy(self, change: int) -> None:
    """A thread starts (+1) or ends (-1) sampling; adds the time since the last change
    during which any was (under `_lock`)."""
    now = time.perf_counter()
    if self._sampling:
      self.stats["busy_s"] += now - self._busy_since
    self._sampling += change
    self._busy_since = now

  def _run(self, context) -> None:
    try:
      with context:
        self._loop()
    except BaseException as e:  # surfaced to the trainer by get()
      self._error = e

  def _loop(self) -> None:
    while not self._stop.is_set():
      with self._lock:
        params, version = self._latest
        self._count_busy(+1)
      try:
        out = self._sample_fn(params, version)
        batch, info = out if isinstance(out, tuple) and not hasattr(out, "_fields") else (out, None)
        jax.block_until_ready(batch)
      finally:
        with self._lock:
          self._count_busy(-1)
      with self._lock:
        self.stats["produced"] += 1
      while not self._stop.is_set():
        try:
          self._queue.put((batch, info), timeout=0.05)
          break
        except queue.Full:
          continue

  def get(self, current_version: int, timeout: float | None = 60.0, with_info: bool = False):
    """Next batch within the staleness bound relative to ``current_version``.

    With ``with_info``, returns ``(batch, info)`` where ``info`` is what
    ``sample_fn`` returned beside that batch (``sample_fn`` may return
    ``(batch, info)``), or None.

    Raises:
      RuntimeError: if the sampler thread failed.
      TimeoutError: if no batch arrives within ``timeout`` seconds.
    """
    while True:
      if self._error is not None:
        raise RuntimeError("SamplerThread thread failed") from self._error
      try:
        batch, info = self._queue.get(timeout=0.05 if timeout is None else min(timeout, 0.05))
      except queue.Empty:
        if timeout is not None:
          timeout -= 0.05
          if timeout <= 0:
            raise TimeoutError("SamplerThread.get: no batch") from None
        continue
      # Rows that weigh nothing (groups still in flight) do not make a batch stale.
      mask = np.asarray(batch.mask) * (np.asarray(batch.weights) > 0)[:, None]
      stale = np.asarray(lag.row_staleness(batch.versions, mask, current_version))
      too_old = stale > self.max_staleness
      if self.mode == "drop" and too_old.any():
        self.stats["dropped_batches"] += 1
        kept = np.asarray(batch.weights) > 0
        self.stats["dropped_tokens"] += float(np.asarray(batch.mask)[kept].sum())
        continue
      if too_old.any():
        self.stats["downweighted_rows"] += int(too_old.sum())
        w = lag.staleness_weights(
          batch.versions, batch.mask, current_version, self.max_staleness, self.stale_weight
        )
        batch = batch._replace(weights=batch.weights * w)
      self.stats["consumed"] += 1
      return (batch, info) if with_info else batch

  def close(self) -> None:
    """Stops the threads and waits for them."""
    self._stop.set()
    for t in self._threads:
      t.join(timeout=30)
