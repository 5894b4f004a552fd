"""The loop's one step driver: how a run goes from loop step t to t + n.

A run advances in one of three ways, chosen once by `make` from the step
functions and the lag mode (and kept when the sampler choice switches the
sampler, `switch`), for one run or the study's seeds side by side (`Seeds`):

  Scanned  every step is one jitted program (a traced rollout and a device
           reward): a chunk of n steps runs as one `lax.scan`
           (`Programs.rl_steps`), and its metrics reach the host once.
  Split    the step leaves the device (a host reward, a host rollout, a
           rollout placed on a disaggregated sampler mesh): `host_step.Stepper`
           runs its rollout and learning halves, with the next step's
           rollout dispatched ahead where the loop allows it.
  Async    a sampler thread produces scored batches ahead
           (`producer.AsyncProducer`), advancing the rollout's carried state
           for a kind that has one; the trainer learns each batch, takes the
           carried state it came with, and publishes its parameters.

Scanned and Split take the loop's prompts from `read(n, state)` (the local
prompt batches of n steps, read under the run state the steps start from, and
each one's row fields: how many of its prompts were truncated, and what the
choice of prompts by their values reports, `rollout.prompt_filter`); Async's
producer reads the shared prompt iterator itself. Each returns the run state
and one metrics row per step. The loop keeps the lifecycle (restore,
evaluations, checkpoints, signals, rows) and calls `Driver.steps` alone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import lag
from offpolicy_jax.rollout import prompt_rows, sampler_mesh
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.scale import sharding
from offpolicy_jax.step import host_step, producer, rows, scoring
from offpolicy_jax.step.programs import one_program, programs
from offpolicy_jax.step.run_state import LagSchedule, ReplayOptions, StepFns
from offpolicy_jax.step.seeds import Seeds

# `read(n, state)`: the local prompt batches of the next n loop steps, read under the run state
# they start from, and per batch its row fields (`prompts_truncated`, `v0/*`).
Read = Callable[[int, Any], tuple[list[dict[str, Any]], list[dict[str, Any]]]]


class Driver(Protocol):
  """How a run advances (module docstring)."""

  fns: StepFns
  rollout: Rollout  # the rollout whose carried state the checkpoints hold (placed or not)
  max_chunk: int  # loop steps one call of `steps` may take

  @property
  def prefetched(self) -> bool:
    """Whether the next step's rollout was sampled ahead (its prompts already read)."""
    ...

  def steps(self, state, step: int, n: int) -> tuple[Any, list[dict[str, Any]]]:
    """Loop steps `step + 1 .. step + n`: `(state, one metrics row per step)`."""
    ...

  def switch(self, fns: StepFns) -> None:
    """Samples with `fns` (the same run, its sampler switched) from the next step on."""
    ...

  def close(self) -> None: ...


def make(
  fns: StepFns,
  *,
  lag_mode: str,
  replay: ReplayOptions,
  read: Read,
  seeds: Seeds,
  sync: tuple[int, int],
  may_prefetch: Callable[[int], bool],
  data=None,
  max_staleness: int = 0,
  sampler_threads: int = 1,
) -> Driver:
  """The run's driver: `Async` in lag mode async, else `Scanned` or `Split` (module docstring).

  Args:
    fns: the run's step functions (as the sampler choice has them now).
    lag_mode: `lag.mode`.
    replay: the replay options (which compiled programs to use).
    read: the loop's prompt reader (`Read`).
    seeds: the run's seed (`Seeds.one`), or the study's S seeds (`Seeds.many`: the
      state, programs and metrics carry a leading seed axis; sync mode, no sampler mesh).
    sync: the `(lag.sync_interval, lag.sync_offset)` schedule.
    may_prefetch: whether the loop allows step t + 1's rollout before step t learns
      (no signal, no checkpoint after t, no pending sampler choice at t).
    data, max_staleness, sampler_threads: the async producer's (`lag_mode="async"`):
      the shared prompt iterator, `lag.max_staleness` and `lag.sampler_threads`. It
      starts with the first call of `steps`, from the state and loop step that call gives.
  """
  run = _Run(fns, replay, seeds, sync)
  if seeds.stacked and (lag_mode == "async" or fns.sampler_mesh is not None):
    raise ValueError("seeds side by side run in lag.mode='sync' on the trainer's mesh only")
  if lag_mode == "async":
    return Async(run, data, max_staleness, sampler_threads)
  if fns.sampler_mesh is not None:  # a sync run samples on its own mesh
    placed = sampler_mesh.OnSamplerMesh(
      fns.rollout, fns.sampler_mesh, fns.model.mesh, fns.model.split
    )
    return Split(run, placed, read, may_prefetch, placed=placed)
  if one_program(fns):
    return Scanned(run, read)
  return Split(run, fns.rollout, read, may_prefetch)


class _Run:
  """What every driver uses of the run: its programs' inputs as replicated device scalars
  (the seeds' [S] vector side by side), and its programs (`programs`, vmapped over seeds)."""

  def __init__(self, fns: StepFns, replay: ReplayOptions, seeds: Seeds, sync: tuple[int, int]):
    self.fns, self.replay, self.seeds, self.sync = fns, replay, seeds, sync
    self.mesh = fns.model.mesh
    self.seed = seeds.seed_arg(self.mesh)
    self.schedule = LagSchedule(*(sharding.replicated_int(self.mesh, x) for x in sync))

  def programs(self, fns: StepFns, state):
    return programs(fns, self.replay, state, seeds=self.seeds)


class Scanned:
  """Chunks of steps, each chunk one jitted scan (module docstring)."""

  max_chunk = 2**31 - 1

  def __init__(self, run: _Run, read: Read):
    self.fns, self.rollout, self._run, self._read = run.fns, run.fns.rollout, run, read

  @property
  def prefetched(self) -> bool:
    return False

  def steps(self, state, step: int, n: int):
    run = self._run
    local, read_rows = self._read(n, state)
    stacked = run.seeds.stack_steps(local, prompt_rows.DEVICE_FIELDS)
    prompts = run.seeds.prompts(self.fns.model.mesh, stacked, steps=True)
    steps = jax.device_put(
      np.arange(step + 1, step + n + 1, dtype=np.int32), sharding.replicated(run.mesh)
    )
    fn = run.programs(self.fns, state).rl_steps
    begin = time.perf_counter()
    state, out = fn(state, prompts, steps, run.seed, run.schedule)
    out = jax.device_get(out)
    device = (time.perf_counter() - begin) / n
    assert len(read_rows) == n, (len(read_rows), n)
    return state, [
      rows.step_row(
        run.seeds,
        run.seeds.step_of(out, i),
        fields={**scoring.no_reward_stats(), **fields},
        times={"device_s": device},
      )
      for i, fields in enumerate(read_rows)
    ]

  def switch(self, fns: StepFns) -> None:
    self.fns, self.rollout = fns, fns.rollout

  def close(self) -> None:
    pass


class Split:
  """One step at a time in two halves around the host part (module docstring)."""

  max_chunk = 1

  def __init__(
    self,
    run: _Run,
    rollout: Rollout,
    read: Read,
    may_prefetch: Callable[[int], bool],
    placed: sampler_mesh.OnSamplerMesh | None = None,
  ):
    """`rollout` is the one the step advances: `placed` (the run's rollout on a sampler mesh,
    whose copy of the parameters a switched sampler keeps) or the run's own."""
    self.fns, self.rollout, self._run, self._placed = run.fns, rollout, run, placed
    self._read, self._may_prefetch = read, may_prefetch
    self._host = host_step.Stepper(run.fns, rollout, run.seeds, run.schedule)

  @property
  def prefetched(self) -> bool:
    return self._host.prefetched

  def _prefetch(self, step: int) -> bool:
    """Whether step `step + 1` may sample before step `step` has trained.

    The rollout must allow it (nothing carried, nothing on the host), its
    behaviour parameters must not be the ones `step` produces, and the loop
    must allow it (`may_prefetch`).
    """
    if not self.rollout.prefetch or not self._may_prefetch(step):
      return False
    return lag.behavior_version(step + 1, *self._run.sync) < step

  def _read_one(self, state) -> tuple[dict[str, Any], dict[str, Any]]:
    (local,), (fields,) = self._read(1, state)
    return self._run.seeds.prompts(self.fns.model.mesh, local), fields

  def steps(self, state, step: int, n: int):
    assert n == 1, n
    # The programs of this state's structure: the same before and after the step.
    progs = self._run.programs(self.fns, state)
    prefetch = self._prefetch(step + 1)
    read = functools.partial(self._read_one, state)
    state, row = self._host.take_step(progs, state, step + 1, read, prefetch)
    return state, [row]

  def switch(self, fns: StepFns) -> None:
    self.fns = fns
    if self._placed is not None:  # the same placement and parameter copy
      self._placed.inner = fns.rollout
    else:
      self.rollout = fns.rollout
    self._host.fns, self._host.rollout = fns, self.rollout

  def close(self) -> None:
    pass


class Async:
  """The trainer's half of lag mode async: learn each produced batch, publish (module docstring)."""

  max_chunk = 1

  def __init__(self, run: _Run, data, max_staleness: int, threads: int = 1):
    self.fns, self.rollout, self._run = run.fns, run.fns.rollout, run
    self._data, self._max_staleness, self._threads = data, max_staleness, threads
    self._prod: producer.AsyncProducer | None = None

  @property
  def prefetched(self) -> bool:
    return False

  def steps(self, state, step: int, n: int):
    assert n == 1, n
    if self._prod is None:  # the producer starts from the first step's state
      self._prod = producer.AsyncProducer(
        self.fns,
        state.train.params,
        step,
        self._data,
        self._run.seeds.ids[0],
        self._max_staleness,
        state.base,
        state.rollout,
        self._threads,
      )
    step += 1
    t0 = time.perf_counter()
    batch, info = self._prod.get(step)
    t1 = time.perf_counter()
    run, keep, carried = self._run, info.pop("keep"), info.pop("carried")
    if carried is not None:  # the groups in flight after this batch: what a checkpoint holds
      state = state._replace(rollout=self.rollout.restore(state.rollout, *carried))
    fn = run.programs(self.fns, state).learn
    step_a = sharding.replicated_int(run.mesh, step)
    state, row = fn(state, batch, step_a, run.seed, run.schedule, keep)
    published = self._prod.publish(state.train.params, step)
    big = jnp.iinfo(jnp.int32).max
    finished = (batch.mask > 0) & (batch.weights > 0)[:, None]  # the groups that finished
    out, oldest = jax.device_get((row, jnp.min(jnp.where(finished, batch.versions, big))))
    oldest = int(oldest)
    version = oldest if oldest != big else self.fns.learner.version(step - 1)
    times = {"sample_s": info.pop("sample_time_s"), "wait_s": t1 - t0}
    times["train_s"] = time.perf_counter() - t1
    fields = {"behavior_version": version, **info, **published}
    return state, [rows.step_row(run.seeds, out, fields=fields, times=times)]

  def switch(self, fns: StepFns) -> None:
    raise ValueError("the sampler choice runs in lag.mode='sync' only")

  def close(self) -> None:
    if self._prod is not None:
      self._prod.close()
