"""The RL loop: `train_and_evaluate(config, workdir)`.

Per loop step (one sampled batch) `t = 1..T`, with the lag schedule of Yao et
al., "Group-relative REINFORCE is secretly an off-policy algorithm"
(arXiv:2509.24203):

  prompts_t          = next(grain iterator)                       (host, static shapes)
  v(t)               = m * floor((t - n - 1) / m)  (0 if t <= n)   (lag.behavior_version)
  rollout            ~ pi_{theta_v(t)}(. | prompts_t)              (exact behaviour log-probs)
  r                  = reward(rollout)          (on device, or host with a timeout)
  A                  = advantages(r[G, K])
  buffer             = replay.add(buffer, batch);  batch = replay.sample(buffer)
  theta_t            = train_step(theta_{t-1}, batch)             (U optimizer steps)

Versions and several optimizer steps per batch: the train step takes
`U = train.num_minibatches * train.num_epochs` optimizer steps per batch and
the parameter version counts optimizer steps, so after loop step t the trainer
holds version `t * U`. The schedule counts batches: `lag.sync_interval` m and
`lag.sync_offset` n are in loop steps, so the sampler receives new parameters
every `m * U` optimizer steps, and the batch of step t carries version
`v(t) * U`. The recorded `behavior_version`, `version`, `staleness_mean` and
`staleness_max` are in optimizer steps: at the start of step t the staleness is
`(t - 1 - v(t)) * U` (the j-th minibatch of the call is j optimizer steps
staler still). With U = 1 this is exactly the paper's schedule.

In `lag.mode="sync"` the parameters of v(t) come from the snapshot store of
`lag.py`. Every PRNG key derives from `(seed, t)`, and the checkpoint holds
parameters, optimizer state, the replay buffer, the parameter snapshots the
schedule still needs and the data iterator's state, so a run killed at any
moment resumes from its last checkpoint and reproduces the uninterrupted run's
metrics exactly.

In `lag.mode="async"` a sampler thread (`lag.AsyncSampler`) runs ahead with the
latest published parameters and batches more than `lag.max_staleness` loop
steps old are dropped; this mode is not bit-reproducible.

Multi-host: every process runs this same loop (SPMD). Each keeps its own
block of rows of the global prompt batch and `Environment.global_prompts`
assembles the global batch, the same for any number of processes; iterator
states are positions that advance in lockstep, so the one saved in the
checkpoint resumes every process. Every process saves and restores the
checkpoints; only process 0 writes metrics.

The `Environment` of compiled functions lives in `environment.py`, evaluation
in `evaluation.py` and the start-up checks in `validation.py`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from offpolicy_jax import checkpointing, environment, lag, metrics, replay
from offpolicy_jax import workdir as workdir_lib
from offpolicy_jax.environment import (  # noqa: F401  (re-exported)
  _ENV_CACHE,
  Environment,
  get_environment,
  step_key,
)
from offpolicy_jax.types import TrainBatch
from offpolicy_jax.validation import (  # noqa: F401  (re-exported)
  advantage_name,
  loss_overrides,
  validate_config,
  validate_data,
)


class _Run:
  """Mutable state of a training run (the loop's bookkeeping, not a public type)."""

  def __init__(self, env: Environment, config):
    self.env = env
    self.config = config
    c = config
    self.groups = c.prompts_per_step
    # U: optimizer steps (parameter versions) per loop step.
    self.updates = env.updates_per_batch
    self.m, self.n = c.lag.sync_interval, c.lag.sync_offset
    self.capacity = lag.snapshot_capacity(self.m, self.n)
    # Async mode samples with the latest published parameters: no snapshots.
    self.use_snapshots = c.lag.mode == "sync" and not (self.m == 1 and self.n == 0)

  # ----------------------------------------------------------------- state

  def fresh_state(self, params) -> dict[str, Any]:
    env = self.env
    example = env.empty_batch()
    capacity = self.groups * self.config.replay.capacity_batches
    state = {
      "train": env.init_train_state(params),
      "replay": replay.shard(replay.init(capacity, example, self.config.group_size), env.mesh),
    }
    if self.use_snapshots:
      state["snapshots"] = lag.snapshot_init(params, self.capacity, 0)
    if self.env.spec.needs_ref:
      state["ref"] = jax.tree.map(jnp.copy, params)
    return state

  # ----------------------------------------------------------------- one step

  def behaviour_params(self, state, step: int):
    """Parameters after loop step v(step) (snapshots are keyed by loop step).

    The trainer holds the parameters after loop step `step - 1`.
    """
    v = lag.behavior_version(step, self.m, self.n)
    params = self.env.params_of(state["train"])
    if v == step - 1:  # on-policy for this step: the trainer's own parameters
      return params, v
    found_params, found = lag.snapshot_get(state["snapshots"], v)
    if not bool(found):
      raise RuntimeError(f"lag: snapshot of version {v} missing at step {step}")
    return found_params, v

  def produce(self, params, step: int, version: int, prompts: dict) -> tuple[TrainBatch, dict]:
    """Samples, scores and packs the batch of `step` with `params` (after loop step `version`).

    Args:
      params: behaviour parameters.
      step: loop step (for PRNG keys).
      version: the loop step after which `params` were taken; the batch records
        the optimizer-step version `version * U`.
      prompts: this process's prompt batch (assembled into the global batch here).

    Returns:
      The packed `TrainBatch` and its host reward statistics (`environment.REWARD_STATS`).
    """
    env, seed = self.env, self.config.seed
    prompts = env.global_prompts(prompts)
    rollout = env.sample(params, prompts, step_key(seed, step, environment.SAMPLE))
    rewards, reward_stats = env.score(prompts, rollout)
    reward_stats["prompts_truncated"] = int((prompts["truncated"] & prompts["valid"]).sum())
    key = step_key(seed, step, environment.ADV)
    return env.make_batch(prompts, rollout, rewards, version * self.updates, key), reward_stats

  def _draw(self, replay_state, step: int):
    """Draws the step's G groups from the buffer with the `config.replay` policy."""
    r = self.config.replay
    return replay.sample(
      replay_state,
      step_key(self.config.seed, step, environment.REPLAY),
      batch_size=self.groups,
      policy=r.policy,
      max_reuse=r.max_reuse or None,
      current_version=(step - 1) * self.updates,
      temperature=r.temperature,
    )

  def consume(self, state, step: int, batch: TrainBatch) -> tuple[dict, dict]:
    """Buffers `batch`, draws the step's training batch and takes U optimizer steps."""
    env, c = self.env, self.config
    replay_state, sampled, info = self._draw(replay.add(state["replay"], batch), step)
    extra = {}
    if env.spec.needs_ref:
      extra["ref_params"] = state["ref"]
    if env.spec.needs_proximal:
      # Proximal anchor = the trainer's parameters before this update (a copy: the
      # state is donated).
      extra["proximal_params"] = jax.tree.map(jnp.copy, env.params_of(state["train"]))
    stats = env.batch_stats(sampled)
    train_state, train_metrics = env.train_step(
      state["train"], sampled, step_key(c.seed, step, environment.TRAIN), **extra
    )
    state = {**state, "train": train_state, "replay": replay_state}
    if self.use_snapshots and lag.is_snapshot_version(step, self.m):
      state["snapshots"] = lag.snapshot_update(
        state["snapshots"], env.params_of(state["train"]), step
      )
    row = jax.device_get({**stats, **train_metrics, "replay_selected": info.num_selected})
    return state, {k: metrics.to_python(v) for k, v in row.items()}

  def step(self, state, step: int, prompts: dict) -> tuple[dict, dict]:
    """One synchronous step: sample with v(step)'s parameters, then train."""
    start = time.perf_counter()
    params, version = self.behaviour_params(state, step)
    batch, reward_stats = self.produce(params, step, version, prompts)
    state, row = self.consume(state, step, batch)
    row["behavior_version"] = version * self.updates
    row.update(reward_stats)
    _add_timing(row, start)
    return state, row


def _add_timing(row: dict, start: float) -> None:
  elapsed = time.perf_counter() - start
  row["step_time_s"] = elapsed
  row["tokens_per_s"] = row.get("response_tokens", 0.0) / max(elapsed, 1e-9)


class _LockedIterator:
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


class _AsyncProducer:
  """`lag.mode="async"`: a sampler thread runs ahead with the latest published parameters.

  Batches more than `lag.max_staleness` loop steps old are dropped (and counted).
  Not bit-reproducible (thread timing decides versions), and on resume the
  batches that were queued when the checkpoint was taken are not replayed.
  """

  def __init__(self, run: _Run, params, version: int, data_iter: _LockedIterator):
    self._run = run
    self._data = data_iter
    self._produced = version
    # Batches record versions in optimizer steps (loop step * U): so does the bound.
    bound = run.config.lag.max_staleness * run.updates or 2**30
    # AsyncSampler copies the parameters it is given (the train state is donated).
    self.sampler = lag.AsyncSampler(self._sample, params, version, max_staleness=bound)

  def _sample(self, params, version: int) -> tuple[TrainBatch, dict]:
    self._produced += 1
    return self._run.produce(params, self._produced, version, next(self._data))

  def step(self, state, step: int) -> tuple[dict, dict]:
    start = time.perf_counter()
    fallback = (step - 1) * self._run.updates
    # The reward statistics travel with their batch: they are charged to the
    # step that trains on it.
    batch, reward_stats = self.sampler.get(current_version=fallback, timeout=600.0, with_info=True)
    versions, mask = jax.device_get((batch.versions, batch.mask))
    state, row = self._run.consume(state, step, batch)
    # publish() copies: the train state is donated by the next step.
    self.sampler.publish(self._run.env.params_of(state["train"]), step)
    row["behavior_version"] = int(versions[mask > 0].min()) if mask.any() else fallback
    row.update(reward_stats)
    row["async_dropped_batches"] = self.sampler.stats["dropped_batches"]
    _add_timing(row, start)
    return state, row

  def close(self) -> None:
    self.sampler.close()


def _meta(step: int, config, data_iter, start_accuracy) -> dict[str, Any]:
  return {
    "step": step,
    "seed": config.seed,
    "data_state": data_iter.get_state(),
    "start_accuracy": start_accuracy,
  }


def _restore_or_init(run: _Run, ckpt, data_iter, workdir: str):
  """The run state, the step it is at and the starting accuracy (latest checkpoint or fresh)."""
  env, config = run.env, run.config
  if ckpt.latest_step():
    # The newest intact step: corrupt ones are reported and moved aside.
    template = run.fresh_state(env.init_params(config.seed))
    state, meta, start_step = ckpt.restore_latest(template)
    data_iter.set_state(meta["data_state"])
    print(f"resumed from step {start_step} in {workdir}", flush=True)
    return state, start_step, meta.get("start_accuracy")
  params = env.init_params(config.seed)
  if config.sft.enabled:
    params = env.warm_start(params, config.sft, config.seed)
  return run.fresh_state(params), 0, None


def _evaluate(run: _Run, state, step: int, writer, rows: list) -> dict[str, float]:
  """Evaluates the trainer's parameters at `step`, writing an eval row when there is one."""
  env, config = run.env, run.config
  ev = env.evaluate(
    env.params_of(state["train"]),
    step_key(config.seed, step, environment.EVAL),
    config.eval_prompts,
    config.eval_samples,
  )
  if ev:
    rows.append(writer.write(step, ev))
    writer.log_text(f"eval at step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in ev.items()))
  return ev


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
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  primary = jax.process_index() == 0
  with workdir_lib.lock(workdir) if primary else contextlib.nullcontext():
    return _train_and_evaluate(config, workdir, on_step, allow_config_change)


def _train_and_evaluate(config, workdir: str, on_step, allow_config_change: bool) -> list[dict]:
  ckpt = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    max_to_keep=config.keep_checkpoints,
    async_save=config.async_checkpoint,
  )
  try:
    latest = ckpt.latest_step()
    if latest and jax.process_index() == 0:
      workdir_lib.check_config(workdir, config, step=latest, allow_change=allow_config_change)
    run = _Run(get_environment(config), config)
    # Every prompt checked once (cached under the workdir), before anything compiles.
    validate_data(config, run.env.task, run.env.tokenizer, cache_dir=workdir)
    data_iter = _LockedIterator(run.env.prompt_iterator(config.seed, "train"))
    state, start_step, start_accuracy = _restore_or_init(run, ckpt, data_iter, workdir)
  except BaseException:
    ckpt.close()
    raise
  writer = _make_writer(config, workdir, start_step)
  rows: list[dict[str, Any]] = []
  try:
    if not start_step:
      start_accuracy = _evaluate(run, state, 0, writer, rows).get("eval/accuracy")
      if start_accuracy is not None:
        warm = "after the warm start" if config.sft.enabled else "(no warm start)"
        writer.log_text(f"starting accuracy {warm}: {start_accuracy:.3f}")
    loop_io = (data_iter, writer, ckpt, rows)
    _run_steps(run, state, start_step, start_accuracy, loop_io, on_step)
  finally:
    ckpt.close()
    writer.close()
  return rows


def _make_writer(config, workdir: str, start_step: int) -> metrics.MetricsWriter:
  return metrics.MetricsWriter(
    workdir,
    resume_step=start_step or None,
    total_steps=config.total_steps,
    config=config,
    tensorboard=config.tensorboard,
    wandb_project=config.wandb_project or None,
    progress=config.progress,
    primary=jax.process_index() == 0,
  )


def _run_steps(run: _Run, state, start_step: int, start_accuracy, loop_io, on_step) -> None:
  """Loop steps `start_step + 1 .. total_steps`, with their evaluations and checkpoints."""
  config = run.config
  data_iter, writer, ckpt, rows = loop_io
  producer = None
  if config.lag.mode == "async":
    producer = _AsyncProducer(run, run.env.params_of(state["train"]), start_step, data_iter)
  try:
    for step in range(start_step + 1, config.total_steps + 1):
      if producer is None:
        state, row = run.step(state, step, next(data_iter))
      else:
        state, row = producer.step(state, step)
      rows.append(writer.write(step, row))
      writer.progress(step, reward=row.get("reward_mean", float("nan")))
      if on_step is not None:
        on_step(step, row)
      last = step == config.total_steps
      if (config.eval_every and step % config.eval_every == 0) or last:
        _evaluate(run, state, step, writer, rows)
      if (config.checkpoint_every and step % config.checkpoint_every == 0) or last:
        # Rows up to this step reach the disk before the checkpoint that covers them.
        writer.sync()
        ckpt.save(step, state, _meta(step, config, data_iter, start_accuracy))
  finally:
    if producer is not None:
      producer.close()


def evaluate_checkpoint(config, workdir: str | None = None, step: int | None = None):
  """Evaluates a run's checkpoint (or, without `workdir`, the config's model as built).

  Args:
    config: the run's config (its model, task and eval settings are used).
    workdir: a run directory with checkpoints; None evaluates the model of
      `config.model` (a preset at its seed's initialisation, or an HF directory).
    step: checkpoint step; None for the latest.

  Returns:
    dict with `step` and the `eval/` metrics of `Environment.evaluate`.
  """
  validate_config(config)
  env = get_environment(config)
  validate_data(config, env.task, env.tokenizer)
  params = env.init_params(config.seed)
  step_done = 0
  if workdir is not None:
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
      state, meta = ckpt.restore(_Run(env, config).fresh_state(params), step)
    finally:
      ckpt.close()
    params, step_done = env.params_of(state["train"]), meta["step"]
  k = max(config.eval_samples, 1)
  ev = env.evaluate(
    params, step_key(config.seed, step_done, environment.EVAL), config.eval_prompts, k
  )
  return {"step": step_done, **ev}
