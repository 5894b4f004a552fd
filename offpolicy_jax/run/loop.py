"""The RL loop: `train_and_evaluate(config, workdir)`.

The loop only restores, iterates and writes: `components.build_components`
builds what the run needs from the config, `rl_step` holds the pure step
(see its docstring for the lag schedule and versions), and this module feeds
it prompts, writes a metrics row per loop step, evaluates and checkpoints.

Steps run through one driver (`step.drivers`). Chunks: with a traced
rollout and a device reward, a chunk of steps runs as one jitted `lax.scan`
and its metrics reach the host once per chunk; the chunk length is
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
prompt rows (`prompt_rows.assemble_global`); every process saves and restores
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

from offpolicy_jax import errors
from offpolicy_jax.config_spec import RunSpec
from offpolicy_jax.learn import buffer_ope
from offpolicy_jax.rollout import prompt_filter, prompt_rows
from offpolicy_jax.run import evaluation, observability, stopping, validation
from offpolicy_jax.run import start as start_lib
from offpolicy_jax.run.components import Components, build_components
from offpolicy_jax.step import costs, drivers, producer, sampler_choice
from offpolicy_jax.step.run_state import EVAL, RunState, step_key, weights
from offpolicy_jax.step.seeds import Seeds
from offpolicy_jax.store import checkpointing, metrics
from offpolicy_jax.store import workdir as workdir_lib


def train_and_evaluate(
  config,
  workdir: str,
  *,
  on_step: Callable[[int, dict[str, Any]], None] | None = None,
  allow_config_change: bool = False,
  spec: RunSpec | None = None,
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
    spec: `config`'s spec from `validation.validate_config` when the caller has
      validated it already (`experiments.train`); None: it is checked here.

  Returns:
    The metric rows written by this call (train and eval rows).

  Raises:
    workdir.WorkdirLocked: another run holds `workdir`.
    workdir.ConfigChanged: a resume with a changed config, not allowed.
  """
  began = time.perf_counter()  # this command's part of the run's wall time
  # A refused config leaves no trace in the workdir.
  spec = validation.validate_config(config) if spec is None else spec
  primary = jax.process_index() == 0
  created = workdir_lib.create(workdir)
  started = False
  try:
    held = workdir_lib.lock(workdir) if primary else contextlib.nullcontext()
    with held, stopping.Stop() as stop:
      comps, ckpt, writer, data_iter, begin = _start(config, spec, workdir, allow_config_change)
      started = True
      clock = _RunClock(began, begin.wall_s)
      return _run(comps, ckpt, writer, data_iter, begin, clock, workdir, on_step, stop)
  except errors.UserError:
    if created and not started and primary:
      workdir_lib.remove_created(workdir)  # a refused start leaves no empty workdir behind
    raise


def _start(config, spec: RunSpec, workdir: str, allow_config_change: bool):
  """Builds the run and restores its state (or a fresh one): everything before the first step."""
  primary = jax.process_index() == 0
  comps = build_components(config, data_cache_dir=workdir, spec=spec)
  if primary and config.sft.enabled and not comps.run.sft.enabled:
    print(
      f"config.model {comps.run.model} is loaded with weights: RL starts from it as it is, "
      "without the warm start (config.sft.on_loaded_model=True runs it)",
      flush=True,
    )
  ckpt = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    max_to_keep=comps.run.keep_checkpoints,
    async_save=comps.run.async_checkpoint,
  )
  try:
    latest = ckpt.latest_step()
    if latest:  # before the config check records an allowed change
      start_lib.check_rollout(ckpt, comps.fns.rollout)
      start_lib.check_carried(ckpt, comps)
    if latest and primary:
      workdir_lib.check_config(workdir, config, step=latest, allow_change=allow_config_change)
    data_iter = producer.LockedIterator(comps.fns.prompts(comps.run.seed))
    begin = start_lib.restore_or_init(comps, ckpt, data_iter, workdir, comps.run.model)
    if primary and begin.step:
      print(_resume_line(workdir, begin.step, comps.run.total_steps), flush=True)
    writer = _make_writer(comps, config, workdir, begin.step)
  except BaseException:
    ckpt.close()
    raise
  return comps, ckpt, writer, data_iter, begin


def _resume_line(workdir: str, step: int, total: int) -> str:
  """What a command that resumes the run in `workdir` says first."""
  line = f"resumed from step {step} of {total} in {workdir}"
  if step >= total:
    line += (
      ": that run is finished, so this command trains nothing (a larger "
      "--config.total_steps goes on; a new --workdir starts a new run)"
    )
  return line


class _RunClock:
  """The run's wall time: this command's, plus what the checkpoint it resumed from had counted.

  Time a command spent after its last checkpoint is not counted again: the
  steps it ran then are run again by the command that resumes.
  """

  def __init__(self, began: float, before_s: float | None):
    self.began, self.before_s = began, before_s

  def run_s(self, at: float | None = None) -> float | None:
    """The run's seconds at `at` (a `time.perf_counter()`; default now).

    None when the checkpoint resumed from predates the count.
    """
    if self.before_s is None:
      return None
    return self.before_s + (time.perf_counter() if at is None else at) - self.began


def _run(comps, ckpt, writer, data_iter, begin, clock, workdir: str, on_step, stop) -> list[dict]:
  """Runs the loop from the restored state to `total_steps` (or a signal), then closes."""
  loop = _Loop(comps, ckpt, writer, data_iter, workdir, on_step, stop)
  loop.base_record, loop.clock, loop.costs = begin.base, clock, begin.costs
  loop.resume_choice(begin.choice)
  start_accuracy = begin.start_accuracy
  try:
    if not begin.step:
      start_accuracy = loop.evaluate(begin.state, 0).get("eval/accuracy")
      if start_accuracy is not None:
        warm = "after the warm start" if comps.run.sft.enabled else "(no warm start)"
        writer.log_text(f"starting accuracy {warm}: {start_accuracy:.3f}")
    loop.start_accuracy = start_accuracy
    loop.run(begin.state, begin.step)
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


class _Loop:
  """Iterates chunks of loop steps, writing rows, evaluating and checkpointing at boundaries.

  How the steps themselves run (one scanned program, two halves around the
  host, or an async sampler thread) is the driver's (`step.drivers`).
  """

  def __init__(self, comps: Components, ckpt, writer, data_iter, workdir: str, on_step, stop):
    self.comps, self.fns, self.run_cfg = comps, comps.fns, comps.run
    self.stop: stopping.Stop = stop
    self.stopping: int | None = None  # the signal all processes agreed to stop on
    self.ckpt, self.writer, self.data = ckpt, writer, data_iter
    self.on_step = on_step
    self.rows: list[dict[str, Any]] = []
    self.start_accuracy = None
    self.base_record: dict[str, str] | None = None  # a LoRA run's base (checkpoint meta)
    self.clock = _RunClock(time.perf_counter(), 0.0)
    # The run's cost totals (`step.costs`); None when its checkpoint predates them.
    self.costs: costs.Costs | None = costs.Costs()
    self._first_rows: list[dict[str, Any]] | None = []  # until `_check_signal` has looked
    self.compiles = observability.CompileCounter()
    self.profiler = observability.Profiler(
      os.path.join(workdir, "profile"), comps.run.profile_steps
    )
    self.choice = sampler_choice.SamplerChoice(
      comps.fns, comps.run.rollout.continuous_waste_threshold
    )
    self.driver: drivers.Driver | None = None

  def resume_choice(self, saved: dict[str, Any] | None) -> None:
    """Takes up the automatic sampler choice saved in the checkpoint the run resumes from."""
    self.choice = sampler_choice.SamplerChoice(
      self.comps.fns, self.run_cfg.rollout.continuous_waste_threshold, saved
    )
    self.fns = self.choice.fns(self.comps.fns)

  def close(self) -> None:
    if self.driver is not None:
      self.driver.close()
    self.profiler.stop()
    self.compiles.close()

  def evaluate(self, state: RunState, step: int) -> dict[str, float]:
    """Evaluates the trainer's parameters at `step`, writing an eval row when there is one."""
    run = self.run_cfg
    key = step_key(run.seed, step, EVAL)
    # The run as built: evaluation does not use the sampler a switch replaces (no recompile).
    fns = self.comps.fns
    ev = evaluation.evaluate(fns, weights(state), key, run.eval_prompts, run.eval_samples, run.seed)
    if ev:  # with the current policy's worth estimated from the buffer's lagged rows
      ev |= evaluation.ope_from_buffer(fns, state, buffer_ope.parse(run.eval_ope), run.seed)
      self.rows.append(self.writer.write(step, ev))
      text = ", ".join(f"{k}={v:.3f}" for k, v in ev.items() if k.startswith("eval/"))
      self.writer.log_text(f"eval at step {step}: {text}")
    return ev

  def _chunk(self, step: int, driver: drivers.Driver) -> int:
    """Steps in the chunk after `step`.

    One length for the whole run, `gcd(log_every, eval_every, checkpoint_every)`,
    so that evaluations and checkpoints fall on chunk ends and one scan
    program serves every chunk (only a shorter last chunk compiles another);
    at most the driver's `max_chunk`. One step when prompts are chosen by their
    values, so that each step's are chosen with the parameters it starts from.
    """
    run = self.run_cfg
    length = math.gcd(run.log_every, run.eval_every, run.checkpoint_every)
    length = 1 if self.fns.prompt_filter is not None else length
    return self.choice.chunk(step, min(driver.max_chunk, length, run.total_steps - step))

  def run(self, state: RunState, start: int) -> None:
    run = self.run_cfg
    self.driver = driver = drivers.make(
      self.fns,
      lag_mode=run.lag.mode,
      replay=self.comps.replay,
      read=self._prompts,
      seeds=Seeds.one(run.seed),
      sync=(run.lag.sync_interval, run.lag.sync_offset),
      may_prefetch=self._may_prefetch,
      data=self.data,
      max_staleness=run.lag.max_staleness,
      sampler_threads=run.lag.sampler_threads,
    )
    step = start
    # A step's wall time runs from the end of the previous chunk's row writing
    # (evaluations and checkpoints excluded) to the end of its own jitted work.
    begin = time.perf_counter()
    while step < run.total_steps:
      n = self._chunk(step, driver)
      self.stop.chunk = max(n, self.stop.chunk or 0)
      self.profiler.before(step + 1, n, first=step == start)
      state, rows = driver.steps(state, step, n)
      self.profiler.after(step + n)
      done = time.perf_counter()
      per_step = (done - begin) / n
      continuous = int(sampler_choice.is_continuous(self.fns))
      for i, row in enumerate(rows):
        row["sampler/continuous"] = continuous
        if self.choice.observe(step + i + 1, row):
          self.fns = self.choice.fns(self.comps.fns)
          driver.switch(self.fns)
        self._write(step + i + 1, row, per_step, at=begin + per_step * (i + 1))
      step += n
      writing = time.perf_counter() - done  # charged to the next chunk
      self._boundary(state, step)
      begin = time.perf_counter() - writing

  def _write(self, step: int, row: dict[str, Any], per_step: float, at: float) -> None:
    """Writes loop step `step`'s row; `at` is when (perf_counter) its share of the chunk ended."""
    if row.pop("snapshot_missing", 0):
      raise RuntimeError(f"lag: the behaviour snapshot of step {step} is missing")
    row["step_time_s"] = per_step
    row["tokens_per_s"] = row.get("response_tokens", 0.0) / max(per_step, 1e-9)
    known = sum(v for k, v in row.items() if k.startswith("time/") and k != "time/other_s")
    row["time/other_s"] = max(per_step - known, 0.0)
    run_s = self.clock.run_s(at)  # cumulative: not one of the step's phases above
    if run_s is not None:
      row["time/run_wall_s"] = run_s
    if self.costs is not None:
      self.costs = costs.add(self.costs, costs.of_row(row))
      row.update(costs.fields(self.costs, run_s))
    row["compiles"] = self.compiles.count
    self.rows.append(self.writer.write(step, row))
    self._check_signal(self.rows[-1])
    self.writer.progress(step, reward=row.get("reward_mean", float("nan")))
    if self.on_step is not None:
      self.on_step(step, row)

  def _check_signal(self, row: dict[str, Any]) -> None:
    """Warns once, after the run's first steps, when its groups carry no learning signal."""
    if self._first_rows is None:
      return
    self._first_rows.append(row)
    if (
      len(self._first_rows) < observability.SIGNAL_STEPS and row["step"] < self.run_cfg.total_steps
    ):
      return
    warning = observability.no_signal_warning(self._first_rows, self.run_cfg.sft)
    if warning:
      self.writer.log_text(warning)
    self._first_rows = None

  def _boundary(self, state: RunState, step: int) -> None:
    """After the chunk that ends at `step`: evaluate and checkpoint when due, stop on a signal.

    A signal (`stopping`) ends the run after `step`, saved: `errors.Interrupted`.
    A step sampled ahead (prefetch) is trained first, so that the checkpoint's
    data state holds no prompts the next run would skip.
    """
    run = self.run_cfg
    if (run.eval_every and step % run.eval_every == 0) or step == run.total_steps:
      self.evaluate(state, step)
    if self.stopping is None:
      self.stopping = self.stop.agreed()
    prefetched = self.driver is not None and self.driver.prefetched
    stopping = self.stopping if step < run.total_steps and not prefetched else None
    if self.stopping is not None and prefetched and step < run.total_steps:
      self.writer.log_text(f"step {step + 1} was already sampled: training it before saving")
    if self._checkpoints(step) or stopping is not None:
      # Rows up to this step reach the disk before the checkpoint that covers them.
      self.writer.sync()
      rollout = self.driver.rollout if self.driver is not None else self.fns.rollout
      start_lib.save(self.ckpt, state, rollout, step, self._meta(step))
    if stopping is not None:
      self.writer.sync()
      raise errors.Interrupted(f"stopped at step {step}; the same command resumes", 128 + stopping)

  def _checkpoints(self, step: int) -> bool:
    run = self.run_cfg
    every = run.checkpoint_every
    return bool(every and step % every == 0) or step == run.total_steps

  def _meta(self, step: int) -> dict[str, Any]:
    """What a checkpoint after `step` records of the loop: its data state, start, base, choice."""
    run = self.run_cfg
    meta = {
      "step": step,
      "seed": run.seed,
      "data_state": self.data.get_state(),
      "start_accuracy": self.start_accuracy,
      "wall_s": self.clock.run_s(),
    }
    if self.costs is not None:
      meta["costs"] = costs.to_meta(self.costs)
    if self.base_record is not None:
      meta["base"] = self.base_record
    if self.choice.auto:
      meta["sampler_choice"] = self.choice.state()
    return meta

  def _prompts(self, n: int, state: RunState) -> tuple[list[dict], list[dict[str, Any]]]:
    """The local prompt batches of the next `n` steps, read under `state`, and their row fields.

    With `critic.prompt_pool` each batch is chosen among its candidates by the
    critic's values at `state`'s parameters (`rollout.prompt_filter`).
    """
    local, rows = [], []
    for _ in range(n):
      batch, fields = next(self.data), {}
      if (filt := self.fns.prompt_filter) is not None:
        memo = self.fns.memo
        if "prompt_values" not in memo:
          memo["prompt_values"] = prompt_filter.values_program(self.fns.model.graphdef)
        program, mesh = memo["prompt_values"], self.fns.model.mesh
        batch, fields = prompt_filter.select(filt, program, weights(state), mesh, batch)
      fields["prompts_truncated"] = prompt_rows.truncated(batch)
      local.append(batch)
      rows.append(fields)
    return local, rows

  def _may_prefetch(self, step: int) -> bool:
    """Whether the loop allows step `step + 1` to sample before step `step` has trained.

    Not after a signal, not when `step` ends in a checkpoint (the checkpoint's
    data state must not include a prefetched batch), not into the step
    where the sampler choice may switch, and not when prompts are chosen by
    the values of the parameters the step starts from.
    """
    run = self.run_cfg
    if self.stopping is not None or self.fns.prompt_filter is not None:
      return False
    if step >= run.total_steps or (run.checkpoint_every and step % run.checkpoint_every == 0):
      return False
    return not (self.choice.pending(step) and step == self.choice.steps)
