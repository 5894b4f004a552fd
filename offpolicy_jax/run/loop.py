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

from offpolicy_jax import lag, models
from offpolicy_jax.rollout import (
  episode_pool,
  episodes,
  pipeline,
  producer,
  sampler_choice,
  sampler_mesh,
)
from offpolicy_jax.rollout.pipeline import EVAL, step_key
from offpolicy_jax.rollout.rl_step import (
  LagSchedule,
  RunState,
  init_state,
  programs,
  state_from_items,
  state_items,
  weights,
)
from offpolicy_jax.run import evaluation, observability, sft
from offpolicy_jax.run.components import Components, build_components, snapshot_slots
from offpolicy_jax.store import checkpointing, metrics
from offpolicy_jax.store import workdir as workdir_lib

# The checkpoint item (and meta key) of the episodes in flight (`episode_pool`).
POOL_ITEM = "episode_pool"


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
  os.makedirs(workdir, exist_ok=True)
  primary = jax.process_index() == 0
  with workdir_lib.lock(workdir) if primary else contextlib.nullcontext():
    comps = build_components(config, data_cache_dir=workdir)
    ckpt = checkpointing.Checkpointer(
      os.path.join(workdir, "checkpoints"),
      max_to_keep=comps.run.keep_checkpoints,
      async_save=comps.run.async_checkpoint,
    )
    try:
      latest = ckpt.latest_step()
      pool = _episode_pool(comps)
      if latest:  # before the config check records an allowed change
        _check_pool(ckpt, pool)
      if latest and primary:
        workdir_lib.check_config(workdir, config, step=latest, allow_change=allow_config_change)
      data_iter = producer.LockedIterator(pipeline.prompt_iterator(comps.fns, comps.run.seed))
      state, start, start_accuracy, base, choice = _restore_or_init(
        comps, ckpt, data_iter, workdir, config.model, pool
      )
      writer = _make_writer(comps, config, workdir, start)
    except BaseException:
      ckpt.close()
      raise
    loop = _Loop(comps, ckpt, writer, data_iter, workdir, on_step)
    loop.pool = pool
    loop.base_record = base
    loop.resume_choice(choice)
    try:
      if not start:
        start_accuracy = loop.evaluate(state, 0).get("eval/accuracy")
        if start_accuracy is not None:
          warm = "after the warm start" if comps.run.sft_enabled else "(no warm start)"
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


def _fresh_state(comps: Components, params, base=None) -> RunState:
  run = comps.run
  slots = snapshot_slots(run.lag_mode, run.sync_interval, run.sync_offset)
  return init_state(
    comps.fns, params, capacity_batches=run.replay_capacity_batches, snapshots=slots, base=base
  )


def initial_weights(comps: Components, *, warm_start: bool = True, log_fn=print):
  """`(base, params)` a run starts from: the model (warm-started), split by `StepFns.split`.

  With adapters, the warm start trains the base under the fresh adapters (B =
  0), and the adapters are what RL trains; without, `base` is None.
  """
  fns, run = comps.fns, comps.run
  base, params = fns.split(fns.init_params(run.seed))
  if warm_start and run.sft_enabled:
    kw = dict(
      steps=run.sft_steps,
      batch_size=run.sft_batch_size,
      learning_rate=run.sft_learning_rate,
      distractor=run.sft_distractor,
      seed=run.seed,
      log_fn=log_fn,
    )
    if base is None:
      params = sft.warm_start(fns, params, **kw)
    else:
      base = sft.warm_start(fns, base, frozen=params, **kw)
  return base, params


def _base_record(base, model: str) -> dict[str, str] | None:
  """What a checkpoint records of a LoRA run's frozen base: its source and fingerprint."""
  return None if base is None else {"model": model, "fingerprint": models.lora.fingerprint(base)}


def _episode_pool(comps: Components) -> episode_pool.EpisodePool | None:
  """The pool of episodes in flight of a multi-turn run with partial rollouts, or None."""
  fns = comps.fns
  if fns.episodes is None or not fns.episodes.partial_budget:
    return None
  sizes = fns.sizes
  fields = {
    "prompt_tokens": ((sizes.max_prompt_len,), np.int32),
    "prompt_lengths": ((), np.int32),
    "answer_tokens": ((fns.task.max_answer_len + 1,), np.int32),  # data.prompt_iterator's
  }
  return episode_pool.EpisodePool(fns, fns.episodes.partial_budget, fields)


def _check_pool(ckpt, pool: episode_pool.EpisodePool | None) -> None:
  """Refuses, naming the field, a latest checkpoint whose episodes in flight do not fit `pool`.

  Raises:
    workdir.ConfigChanged: the pool's budget or shape changed (or it was turned on or off).
  """
  try:
    meta = ckpt.restore_meta()
  except checkpointing.CheckpointError:
    return  # `restore_latest` reports it and falls back to an older step
  saved = meta.get(POOL_ITEM)
  had = None if saved is None else {"slots": saved.get("slots"), "budget": saved.get("budget")}
  has = None if pool is None else {"slots": pool.slots, "budget": pool.budget}
  if had != has:  # not allowed by allow_config_change: the pool cannot be taken back
    raise workdir_lib.ConfigChanged(
      f"config.rollout.partial_budget: the checkpoint of step {meta.get('step')} holds "
      f"episodes in flight of a pool {had or 'that does not exist'}, this run's pool is "
      f"{has or 'none'}; refusing to resume (restore the budget or use a new workdir)"
    )


def _restore_or_init(comps: Components, ckpt, data_iter, workdir: str, model: str, pool=None):
  """The run state, its step, the starting accuracy, the base record and the sampler choice.

  From the latest checkpoint, or fresh (choice None: `sampler_choice.SamplerChoice.state`).
  `pool` (an `episode_pool.EpisodePool`) takes back the checkpoint's episodes in flight.

  Raises:
    ValueError: the checkpoint's adapters were trained on another base.
  """
  fns = comps.fns
  if ckpt.latest_step():
    # The base is rebuilt (loaded, warm-started) as at the start; only adapters are saved.
    base, params = initial_weights(comps, warm_start=fns.lora is not None)
    record = _base_record(base, model)
    template = _fresh_state(comps, params, base)
    # The newest intact step: corrupt ones are reported and moved aside.
    wanted = state_items(template)
    if pool is not None:
      wanted[POOL_ITEM] = pool.arrays()
    items, meta, start = ckpt.restore_latest(wanted)
    if meta.get("base") != record:
      raise ValueError(
        f"{workdir}: the checkpoint of step {start} holds adapters of the base "
        f"{meta.get('base')}, but this run's base is {record} (config.model, the warm start "
        "or the checkpoint's files changed); refusing to resume on another base"
      )
    data_iter.set_state(meta["data_state"])
    if pool is not None:
      pool.restore(items.pop(POOL_ITEM), meta[POOL_ITEM])
    print(f"resumed from step {start} in {workdir}", flush=True)
    state = state_from_items(items, template)
    return state, start, meta.get("start_accuracy"), record, meta.get("sampler_choice")
  base, params = initial_weights(comps)
  return _fresh_state(comps, params, base), 0, None, _base_record(base, model), None


# ------------------------------------------------------------------ the loop


def _rows_of(stacked: dict[str, np.ndarray], n: int) -> list[dict[str, Any]]:
  return [{k: metrics.to_python(v[i]) for k, v in stacked.items()} for i in range(n)]


class _Loop:
  """Iterates chunks of loop steps, writing rows, evaluating and checkpointing at boundaries."""

  def __init__(self, comps: Components, ckpt, writer, data_iter, workdir: str, on_step):
    self.comps, self.fns, self.run_cfg = comps, comps.fns, comps.run
    self.ckpt, self.writer, self.data = ckpt, writer, data_iter
    self.on_step = on_step
    self.rows: list[dict[str, Any]] = []
    self.start_accuracy = None
    self.base_record: dict[str, str] | None = None  # a LoRA run's base (checkpoint meta)
    run = comps.run
    rep = jax.sharding.NamedSharding(comps.mesh, jax.sharding.PartitionSpec())
    put = lambda v: jax.device_put(jnp.int32(v), rep)
    self._rep = rep
    self.schedule = LagSchedule(put(run.sync_interval), put(run.sync_offset))
    self.seed = put(run.seed)
    self.compiles = observability.CompileCounter()
    self.profiler = observability.Profiler(os.path.join(workdir, "profile"), run.profile_steps)
    self._prefetched: tuple | None = None  # (step, dispatched rollout) of a two-program run
    self.pool: episode_pool.EpisodePool | None = None  # episodes in flight (partial rollouts)
    # A disaggregated sync-mode run samples on its own mesh (`disagg`).
    self.sampler = None
    if comps.fns.sampler_mesh is not None and run.lag_mode == "sync":
      schedule = (run.sync_interval, run.sync_offset)
      self.sampler = sampler_mesh.SamplerMesh(comps.fns, run.replay, schedule, run.seed)
    self.choice = sampler_choice.SamplerChoice(comps.fns, run.rollout_continuous_waste_threshold)

  def resume_choice(self, saved: dict[str, Any] | None) -> None:
    """Takes up the automatic sampler choice saved in the checkpoint the run resumes from."""
    self.choice = sampler_choice.SamplerChoice(
      self.comps.fns, self.run_cfg.rollout_continuous_waste_threshold, saved
    )
    self._sample_with(self.choice.fns(self.comps.fns))

  def _sample_with(self, fns) -> None:
    self.fns = fns
    if self.sampler is not None:
      self.sampler.fns = fns

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
    if run.lag_mode == "async" or self.fns.reward.device is None or self.sampler is not None:
      return 1
    length = math.gcd(run.log_every, run.eval_every, run.checkpoint_every)
    return self.choice.chunk(step, min(length, run.total_steps - step))

  def run(self, state: RunState, start: int) -> None:
    run = self.run_cfg
    prod = None
    if run.lag_mode == "async":
      prod = producer.AsyncProducer(
        self.fns, state.train.params, start, self.data, run.seed, run.max_staleness, state.base
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
        elif self.fns.reward.device is not None and self.sampler is None:
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
    if (run.checkpoint_every and step % run.checkpoint_every == 0) or last:
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
      items = state_items(state)
      if self.pool is not None:
        items[POOL_ITEM] = self.pool.arrays()
        meta[POOL_ITEM] = self.pool.meta()
      self.ckpt.save(step, items, meta)

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
    fn = programs(self.fns, self.run_cfg.replay, state).rl_steps
    begin = time.perf_counter()
    state, out = fn(state, prompts, steps, self.seed, self.schedule)
    out = jax.device_get(out)
    device = (time.perf_counter() - begin) / n
    rows = _rows_of(out, n)
    for row, t in zip(rows, truncated, strict=True):
      row.update(pipeline.no_reward_stats(), prompts_truncated=t)
      row["time/device_s"] = device
    return state, rows

  def _dispatch_rollout(self, state: RunState, step: int):
    """Reads step `step`'s prompts and dispatches its rollout (asynchronously, on device)."""
    (local,), (truncated,) = self._prompts(1)
    prompts = pipeline.assemble_global(self.comps.mesh, local)
    device = {k: prompts[k] for k in pipeline.DEVICE_FIELDS}
    step_a = jax.device_put(np.int32(step), self._rep)
    if self.sampler is not None:  # on the sampler's mesh, moved back to the trainer's
      return prompts, device, truncated, step_a, self.sampler.sample(state, local, step)
    if self.fns.episodes is not None:  # turns answered by the environment between decodes
      progs = programs(self.fns, self.run_cfg.replay, state)
      params, v, found = progs.behaviour(state, step_a, self.schedule)
      out, rewards_b, info = episodes.sample(
        self.fns, weights(state, params), prompts, step, self.seed
      )
      return (
        prompts,
        device,
        truncated,
        step_a,
        sampler_mesh.Sampled(out, v, found, rewards_b, info),
      )
    fn = programs(self.fns, self.run_cfg.replay, state).rollout
    out, v, found = fn(state, device, step_a, self.seed, self.schedule)
    return prompts, device, truncated, step_a, sampler_mesh.Sampled(out, v, found, None, {})

  def _can_prefetch(self, step: int) -> bool:
    """Whether step `step + 1` may sample before step `step` has trained.

    Its behaviour parameters must not be the ones `step` produces, and `step`
    must not end in a checkpoint (the checkpoint's data state must not include
    a prefetched batch).
    """
    run = self.run_cfg
    if self.fns.episodes is not None:  # an episode's rollout runs on the host: nothing to overlap
      return False
    if step >= run.total_steps or (run.checkpoint_every and step % run.checkpoint_every == 0):
      return False
    if self.choice.pending(step) and step == self.choice.steps:  # step + 1 may switch
      return False
    return lag.behavior_version(step + 1, run.sync_interval, run.sync_offset) < step

  def _host_step(self, state: RunState, step: int):
    """One step as two programs: jitted rollout, (sandboxed) scoring, jitted learning.

    Host-reward runs and disaggregated runs (`disagg`, whose device rewards
    come with the rollout) take this path. When the lag schedule allows
    (`_can_prefetch`), the next step's rollout is dispatched before this
    step's scoring and learning, so the device samples while the verifier
    workers score, and a disaggregated sampler samples while the trainer trains.
    """
    if self.pool is not None:
      return self._pool_step(state, step)
    t0 = time.perf_counter()
    pending, self._prefetched = self._prefetched, None
    if pending is None or pending[0] != step:
      pending = (step, self._dispatch_rollout(state, step))
    prompts, device, truncated, step_a, (out, v, found, rewards_b, info) = pending[1]
    jax.block_until_ready(out)
    t1 = time.perf_counter()
    if self._can_prefetch(step):
      self._prefetched = (step + 1, self._dispatch_rollout(state, step + 1))
    if rewards_b is None:
      rewards_b, stats = pipeline.score(self.fns, prompts, out)
    else:
      stats = pipeline.no_reward_stats()
    t2 = time.perf_counter()
    learn = programs(self.fns, self.run_cfg.replay, state).learn_scored
    state, row = learn(state, device, out, rewards_b, v, step_a, self.seed, self.schedule)
    row = {k: metrics.to_python(x) for k, x in jax.device_get(row).items()}
    t3 = time.perf_counter()
    row.update(stats, prompts_truncated=truncated, snapshot_missing=int(not bool(found)))
    row.update(info)
    row.update({"time/sample_s": t1 - t0, "time/reward_s": t2 - t1, "time/train_s": t3 - t2})
    return state, [row]

  def _pool_step(self, state: RunState, step: int):
    """One step of episodes with partial rollouts: admit, advance and emit (`episode_pool`)."""
    assert self.pool is not None
    t0 = time.perf_counter()
    (local,), (truncated,) = self._prompts(1)
    prompts = pipeline.assemble_global(self.comps.mesh, local)
    step_a = jax.device_put(np.int32(step), self._rep)
    progs = programs(self.fns, self.run_cfg.replay, state)
    params, v, found = progs.behaviour(state, step_a, self.schedule)
    version = int(self.fns.version(int(v)))
    seed = self.run_cfg.seed
    batch, keep, info = self.pool.step(weights(state, params), prompts, step, seed, version)
    t1 = time.perf_counter()
    state, row = progs.learn(state, batch, step_a, self.seed, self.schedule, keep)
    row = {k: metrics.to_python(x) for k, x in jax.device_get(row).items()}
    row.update(info, prompts_truncated=truncated, snapshot_missing=int(not bool(found)))
    row["behavior_version"] = version
    row.update({"time/sample_s": t1 - t0, "time/train_s": time.perf_counter() - t1})
    return state, [row]

  def _async_step(self, state: RunState, step: int, prod: producer.AsyncProducer):
    t0 = time.perf_counter()
    batch, info = prod.get(step)
    t1 = time.perf_counter()
    fn = programs(self.fns, self.run_cfg.replay, state).learn
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


def evaluate_checkpoint(config, workdir: str | None = None, step: int | None = None):
  """Evaluates a run's checkpoint (or, without `workdir`, the config's model as built).

  Only the parameters are read from the checkpoint (by name).

  Args:
    config: the run's config (its model, task and eval settings are used).
    workdir: a run directory with checkpoints; None evaluates the model of
      `config.model` (a preset at its seed's initialisation, or an HF directory).
    step: checkpoint step; None for the latest.

  Returns:
    dict with `step` and the `eval/` metrics of `evaluation.evaluate`.
  """
  comps = build_components(config)
  fns, run = comps.fns, comps.run
  # Without adapters the checkpoint holds the whole model: no warm start needed.
  base, params = initial_weights(comps, warm_start=fns.lora is not None)
  step_done = 0
  if workdir is not None:
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
      items, meta = ckpt.restore({"params": params}, step)
    finally:
      ckpt.close()
    params, step_done = items["params"], meta["step"]
  k = max(run.eval_samples, 1)
  key = step_key(run.seed, step_done, EVAL)
  full = models.lora.join(base, params)
  return {"step": step_done, **evaluation.evaluate(fns, full, key, run.eval_prompts, k)}
