"""The RL loop: `train_and_evaluate(config, workdir)`.

The loop only restores, iterates and writes: `components.build_components`
builds what the run needs from the config, `rl_step` holds the pure step
(see its docstring for the lag schedule and versions), and this module feeds
it prompts, writes a metrics row per loop step, evaluates and checkpoints.

Chunks. With a device reward, `log_every` steps run as one jitted `lax.scan`
and their metrics reach the host once per chunk; the chunk length is
`gcd(log_every, eval_every, checkpoint_every)`, so evaluations and
checkpoints fall on chunk ends. With a host reward, or a disaggregated
sampler (`disagg`, `mesh.sampler_devices`), each step runs as two jitted
halves around the (sandboxed) scoring. Every row carries per-phase wall
times (`time/sample_s`, `time/reward_s`, `time/train_s`, `time/device_s`,
`time/other_s`) and the number of XLA compilations so far (`compiles`).

With `rollout.continuous_auto_steps`, the loop measures the static batch's
decode waste and may switch to continuous batching once (`sampler_choice`).

Checkpoints hold the run state by field name (`params`, `opt_state`,
`counters`, `replay`, `snapshots`, `ref_params`) plus the data iterator's
state in their meta; a run killed at any moment resumes from its last
checkpoint and reproduces the uninterrupted run's rows exactly (sync mode).

Multi-host: every process runs this same loop (SPMD) on its own block of
prompt rows (`pipeline.assemble_global`); every process saves and restores
the checkpoints; only process 0 writes metrics.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import errors, lag
from offpolicy_jax.rollout import host_step, pipeline, producer, sampler_choice, sampler_mesh
from offpolicy_jax.rollout.pipeline import EVAL, step_key
from offpolicy_jax.rollout.programs import programs
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.rollout.rl_step import (
  LagSchedule,
  RunState,
  StepFns,
  state_items,
  state_meta,
  weights,
)
from offpolicy_jax.run import evaluation, observability, stopping, validation
from offpolicy_jax.run import start as start_lib
from offpolicy_jax.run.components import Components, build_components
from offpolicy_jax.store import checkpointing, metrics
from offpolicy_jax.store import workdir as workdir_lib


def train_and_evaluate(
  config,
  workdir: str,
  *,
  on_step: Callable[[int, dict[str, Any]], None] | None = None,
  allow_config_change: bool = False,
) -> list[dict[str, Any]]:
  """Trains with off-policy RL per `config`, writing metrics and checkpoints to `workdir`.

  Resumes from the latest checkpoint in `workdir` if there is one, after
  checking that `config` means the same run as the workdir's `config.json`.
  The workdir is locked for the duration (`workdir.lock`).

  Args:
    config: an experiment ConfigDict (see configs/default.py for every field).
    workdir: run directory: metrics.jsonl, config.json, tb/, checkpoints/.
    on_step: optional callback `(step, row)` called right after each loop
      step's row is written, before any evaluation or checkpoint of that step.
    allow_config_change: resume even if fields that change the run's meaning
      differ from the record (the change goes to `config_history.jsonl`).

  Returns:
    The metric rows written by this call (train and eval rows).

  Raises:
    workdir.WorkdirLocked: another run holds `workdir`.
    workdir.ConfigChanged: a resume with a changed config, not allowed.
  """
  validation.validate_config(config)  # a refused config leaves no trace in the workdir
  primary = jax.process_index() == 0
  created = workdir_lib.create(workdir)
  started = False
  try:
    held = workdir_lib.lock(workdir) if primary else contextlib.nullcontext()
    with held, stopping.Stop() as stop:
      comps, ckpt, writer, data_iter, begin = _start(config, workdir, allow_config_change)
      started = True
      return _run(comps, ckpt, writer, data_iter, begin, workdir, on_step, stop)
  except errors.UserError:
    if created and not started and primary:
      workdir_lib.remove_created(workdir)  # a refused start leaves no empty workdir behind
    raise


def _start(config, workdir: str, allow_config_change: bool):
  """Builds the run and restores its state (or a fresh one): everything before the first step."""
  primary = jax.process_index() == 0
  comps = build_components(config, data_cache_dir=workdir)
  ckpt = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    max_to_keep=comps.run.keep_checkpoints,
    async_save=comps.run.async_checkpoint,
  )
  try:
    latest = ckpt.latest_step()
    if latest:  # before the config check records an allowed change
      start_lib.check_rollout(ckpt, comps.fns.rollout)
    if latest and primary:
      workdir_lib.check_config(workdir, config, step=latest, allow_change=allow_config_change)
    data_iter = producer.LockedIterator(pipeline.prompt_iterator(comps.fns, comps.run.seed))
    state, start, start_accuracy, base, choice = start_lib.restore_or_init(
      comps, ckpt, data_iter, workdir, comps.run.model
    )
    writer = _make_writer(comps, config, workdir, start)
  except BaseException:
    ckpt.close()
    raise
  return comps, ckpt, writer, data_iter, (state, start, start_accuracy, base, choice)


def _run(comps, ckpt, writer, data_iter, begin, workdir: str, on_step, stop) -> list[dict]:
  """Runs the loop from the restored state to `total_steps` (or a signal), then closes."""
  state, start, start_accuracy, base, choice = begin
  loop = _Loop(comps, ckpt, writer, data_iter, workdir, on_step, stop)
  loop.base_record = base
  loop.resume_choice(choice)
  try:
    if not start:
      start_accuracy = loop.evaluate(state, 0).get("eval/accuracy")
      if start_accuracy is not None:
        warm = "after the warm start" if comps.run.sft.enabled else "(no warm start)"
        writer.log_text(f"starting accuracy {warm}: {start_accuracy:.3f}")
    loop.start_accuracy = start_accuracy
    loop.run(state, start)
  finally:
    loop.close()
    ckpt.close()
    writer.close()
  return loop.rows


def _make_writer(comps: Components, config, workdir: str, start: int) -> metrics.MetricsWriter:
  run = comps.run
  return metrics.MetricsWriter(
    workdir,
    resume_step=start or None,
    total_steps=run.total_steps,
    config=config,
    tensorboard=run.tensorboard,
    wandb_project=run.wandb_project or None,
    progress=run.progress,
    primary=jax.process_index() == 0,
  )


# ------------------------------------------------------------------ the loop


def _rows_of(stacked: dict[str, np.ndarray], n: int) -> list[dict[str, Any]]:
  return [{k: metrics.to_python(v[i]) for k, v in stacked.items()} for i in range(n)]


class _Loop:
  """Iterates chunks of loop steps, writing rows, evaluating and checkpointing at boundaries."""

  def __init__(self, comps: Components, ckpt, writer, data_iter, workdir: str, on_step, stop):
    self.comps, self.fns, self.run_cfg = comps, comps.fns, comps.run
    self.stop: stopping.Stop = stop
    self.stopping: int | None = None  # the signal all processes agreed to stop on
    self.ckpt, self.writer, self.data = ckpt, writer, data_iter
    self.on_step = on_step
    self.rows: list[dict[str, Any]] = []
    self.start_accuracy = None
    self.base_record: dict[str, str] | None = None  # a LoRA run's base (checkpoint meta)
    run = comps.run
    rep = jax.sharding.NamedSharding(comps.mesh, jax.sharding.PartitionSpec())
    put = lambda v: jax.device_put(jnp.int32(v), rep)
    self._rep = rep
    self.schedule = LagSchedule(put(run.lag.sync_interval), put(run.lag.sync_offset))
    self.seed = put(run.seed)
    self.compiles = observability.CompileCounter()
    self.profiler = observability.Profiler(os.path.join(workdir, "profile"), run.profile_steps)
    # The rollout; a disaggregated sync-mode run samples on its own mesh (`disagg`; the
    # async producer places its own copy).
    fns = comps.fns
    self.rollout: Rollout = fns.rollout
    if fns.sampler_mesh is not None and run.lag.mode == "sync":
      self.rollout = sampler_mesh.OnSamplerMesh(fns.rollout, fns.sampler_mesh, fns.mesh, fns.split)
    self.choice = sampler_choice.SamplerChoice(comps.fns, run.rollout.continuous_waste_threshold)
    self.host = host_step.Stepper(fns, self.rollout, comps.replay, run.seed, self.schedule)

  def resume_choice(self, saved: dict[str, Any] | None) -> None:
    """Takes up the automatic sampler choice saved in the checkpoint the run resumes from."""
    self.choice = sampler_choice.SamplerChoice(
      self.comps.fns, self.run_cfg.rollout.continuous_waste_threshold, saved
    )
    self._sample_with(self.choice.fns(self.comps.fns))

  def _sample_with(self, fns: StepFns) -> None:
    self.fns = fns
    if isinstance(self.rollout, sampler_mesh.OnSamplerMesh):
      self.rollout.inner = fns.rollout
    else:
      self.rollout = fns.rollout
    self.host.fns, self.host.rollout = fns, self.rollout

  def close(self) -> None:
    self.profiler.stop()
    self.compiles.close()

  def evaluate(self, state: RunState, step: int) -> dict[str, float]:
    """Evaluates the trainer's parameters at `step`, writing an eval row when there is one."""
    run = self.run_cfg
    key = step_key(run.seed, step, EVAL)
    # The run as built: evaluation does not use the sampler a switch replaces (no recompile).
    ev = evaluation.evaluate(
      self.comps.fns, weights(state), key, run.eval_prompts, run.eval_samples
    )
    if ev:
      self.rows.append(self.writer.write(step, ev))
      text = ", ".join(f"{k}={v:.3f}" for k, v in ev.items())
      self.writer.log_text(f"eval at step {step}: {text}")
    return ev

  def _chunk(self, step: int) -> int:
    """Steps in the chunk after `step`.

    One length for the whole run, `gcd(log_every, eval_every, checkpoint_every)`,
    so that evaluations and checkpoints fall on chunk ends and one scan
    program serves every chunk (only a shorter last chunk compiles another).
    """
    run = self.run_cfg
    if run.lag.mode == "async" or not self._on_device():
      return 1
    length = math.gcd(run.log_every, run.eval_every, run.checkpoint_every)
    return self.choice.chunk(step, min(length, run.total_steps - step))

  def _on_device(self) -> bool:
    """Whether a whole step is one jitted program: a traced rollout and a device reward."""
    return self.rollout.traced and self.fns.reward.device is not None

  def run(self, state: RunState, start: int) -> None:
    run = self.run_cfg
    prod = None
    if run.lag.mode == "async":
      prod = producer.AsyncProducer(
        self.fns, state.train.params, start, self.data, run.seed, run.lag.max_staleness, state.base
      )
    step = start
    # A step's wall time runs from the end of the previous chunk's row writing
    # (evaluations and checkpoints excluded) to the end of its own jitted work.
    begin = time.perf_counter()
    try:
      while step < run.total_steps:
        n = self._chunk(step)
        self.profiler.before(step + 1, n, first=step == start)
        if prod is not None:
          state, rows = self._async_step(state, step + 1, prod)
        elif self._on_device():
          state, rows = self._device_chunk(state, step, n)
        else:
          state, rows = self._host_step(state, step + 1)
        self.profiler.after(step + n)
        done = time.perf_counter()
        per_step = (done - begin) / n
        continuous = int(sampler_choice.is_continuous(self.fns))
        for i, row in enumerate(rows):
          row["sampler/continuous"] = continuous
          if self.choice.observe(step + i + 1, row):
            self._sample_with(self.choice.fns(self.comps.fns))
          self._write(step + i + 1, row, per_step)
        step += n
        writing = time.perf_counter() - done  # charged to the next chunk
        self._boundary(state, step)
        self._maybe_stop(state, step)
        begin = time.perf_counter() - writing
    finally:
      if prod is not None:
        prod.close()

  def _write(self, step: int, row: dict[str, Any], per_step: float) -> None:
    if row.pop("snapshot_missing", 0):
      raise RuntimeError(f"lag: the behaviour snapshot of step {step} is missing")
    row["step_time_s"] = per_step
    row["tokens_per_s"] = row.get("response_tokens", 0.0) / max(per_step, 1e-9)
    known = sum(v for k, v in row.items() if k.startswith("time/") and k != "time/other_s")
    row["time/other_s"] = max(per_step - known, 0.0)
    row["compiles"] = self.compiles.count
    self.rows.append(self.writer.write(step, row))
    self.writer.progress(step, reward=row.get("reward_mean", float("nan")))
    if self.on_step is not None:
      self.on_step(step, row)

  def _boundary(self, state: RunState, step: int) -> None:
    run = self.run_cfg
    last = step == run.total_steps
    if (run.eval_every and step % run.eval_every == 0) or last:
      self.evaluate(state, step)
    if self._checkpoints(step):
      self._save(state, step)

  def _checkpoints(self, step: int) -> bool:
    run = self.run_cfg
    every = run.checkpoint_every
    return bool(every and step % every == 0) or step == run.total_steps

  def _maybe_stop(self, state: RunState, step: int) -> None:
    """Ends the run after `step` on a signal, saved: `errors.Interrupted` (`stopping`).

    A step sampled ahead (prefetch) is trained first, so that the checkpoint's
    data state holds no prompts the next run would skip.
    """
    if self.stopping is None:
      self.stopping = self.stop.agreed()
    if self.stopping is None or step >= self.run_cfg.total_steps or self.host.prefetched:
      return
    if not self._checkpoints(step):
      self._save(state, step)
    self.writer.sync()
    raise errors.Interrupted(
      f"stopped at step {step}; the same command resumes", 128 + self.stopping
    )

  def _save(self, state: RunState, step: int) -> None:
    run = self.run_cfg
    # Rows up to this step reach the disk before the checkpoint that covers them.
    self.writer.sync()
    meta = {
      "step": step,
      "seed": run.seed,
      "data_state": self.data.get_state(),
      "start_accuracy": self.start_accuracy,
    }
    if self.base_record is not None:
      meta["base"] = self.base_record
    if self.choice.auto:
      meta["sampler_choice"] = self.choice.state()
    meta |= state_meta(state, self.rollout)
    self.ckpt.save(step, state_items(state, self.rollout), meta)

  def _prompts(self, n: int) -> tuple[list[dict], list[int]]:
    local = [next(self.data) for _ in range(n)]
    truncated = [int((p["truncated"] & p["valid"]).sum()) for p in local]
    return local, truncated

  def _device_chunk(self, state: RunState, step: int, n: int):
    """Steps `step + 1 .. step + n` as one jitted scan; one host transfer of metrics."""
    local, truncated = self._prompts(n)
    stacked = {k: np.stack([p[k] for p in local]) for k in pipeline.DEVICE_FIELDS}
    prompts = pipeline.assemble_global(self.comps.mesh, stacked, leading_axes=1)
    steps = jax.device_put(np.arange(step + 1, step + n + 1, dtype=np.int32), self._rep)
    fn = programs(self.fns, self.comps.replay, state).rl_steps
    begin = time.perf_counter()
    state, out = fn(state, prompts, steps, self.seed, self.schedule)
    out = jax.device_get(out)
    device = (time.perf_counter() - begin) / n
    rows = _rows_of(out, n)
    for row, t in zip(rows, truncated, strict=True):
      row.update(pipeline.no_reward_stats(), prompts_truncated=t)
      row["time/device_s"] = device
    return state, rows

  def _read(self) -> tuple[dict[str, Any], int]:
    """The next step's prompts (global arrays) and how many of them were truncated."""
    (local,), (truncated,) = self._prompts(1)
    return pipeline.assemble_global(self.comps.mesh, local), truncated

  def _can_prefetch(self, step: int) -> bool:
    """Whether step `step + 1` may sample before step `step` has trained.

    The rollout must allow it (nothing carried, nothing on the host), its
    behaviour parameters must not be the ones `step` produces, and `step`
    must not end in a checkpoint (the checkpoint's data state must not include
    a prefetched batch).
    """
    run = self.run_cfg
    if not self.rollout.prefetch or self.stopping is not None:
      return False
    if step >= run.total_steps or (run.checkpoint_every and step % run.checkpoint_every == 0):
      return False
    if self.choice.pending(step) and step == self.choice.steps:  # step + 1 may switch
      return False
    return lag.behavior_version(step + 1, run.lag.sync_interval, run.lag.sync_offset) < step

  def _host_step(self, state: RunState, step: int):
    """One step whose rollout or reward leaves the device (`host_step.Stepper`).

    Host-reward runs, host rollouts (episodes, the episode pool) and
    disaggregated runs take this path; the next step's rollout is dispatched
    ahead when `_can_prefetch` allows.
    """
    state, row = self.host.step(state, step, self._read, self._can_prefetch(step))
    row["prompts_truncated"] = row.pop("read_info")
    return state, [row]

  def _async_step(self, state: RunState, step: int, prod: producer.AsyncProducer):
    t0 = time.perf_counter()
    batch, info = prod.get(step)
    t1 = time.perf_counter()
    fn = programs(self.fns, self.comps.replay, state).learn
    step_a = jax.device_put(np.int32(step), self._rep)
    state, row = fn(state, batch, step_a, self.seed, self.schedule)
    published = prod.publish(state.train.params, step)
    big = jnp.iinfo(jnp.int32).max
    oldest_a = jnp.min(jnp.where(batch.mask > 0, batch.versions, big))
    row = {k: metrics.to_python(x) for k, x in jax.device_get(row).items()}
    oldest = int(oldest_a)
    row["behavior_version"] = oldest if oldest != big else self.fns.version(step - 1)
    row.update(info)
    row.update(published)
    row["time/sample_s"] = row.pop("sample_time_s")
    row["time/wait_s"] = t1 - t0
    row["time/train_s"] = time.perf_counter() - t1
    return state, [row]
