"""How a run starts: fresh (initialised, warm-started) or from its latest checkpoint.

`restore_or_init` is the loop's start: the run state, its step and what the
checkpoint's meta recorded (starting accuracy, a LoRA run's base, the sampler
choice); `save` writes the checkpoint it starts from next time.
`check_rollout` refuses, before anything is recorded, a checkpoint whose
rollout state (episodes or groups in flight) no longer fits the run.
`evaluate_checkpoint` evaluates a run's parameters without its state.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax

from offpolicy_jax import errors, models
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.run import evaluation, relayout, sft
from offpolicy_jax.run.components import Components, build_components, snapshot_slots
from offpolicy_jax.step import costs as costs_lib
from offpolicy_jax.step.run_state import (
  EVAL,
  RunState,
  init_state,
  state_from_items,
  state_items,
  state_meta,
  step_key,
)
from offpolicy_jax.store import checkpointing
from offpolicy_jax.store import workdir as workdir_lib


def fresh_state(comps: Components, params, base=None) -> RunState:
  run = comps.run
  slots = snapshot_slots(run.lag.mode, run.lag.sync_interval, run.lag.sync_offset)
  return init_state(
    comps.fns, params, capacity_batches=comps.replay_capacity_batches, snapshots=slots, base=base
  )


def initial_weights(comps: Components, *, warm_start: bool = True, log_fn=print):
  """`(base, params)` a run starts from: the model (warm-started), split by `StepFns.model.split`.

  With adapters, the warm start trains the base under the fresh adapters (B =
  0), and the adapters are what RL trains; without, `base` is None.
  """
  fns, run = comps.fns, comps.run
  base, params = fns.model.split(fns.model.init_params(run.seed))
  if warm_start and run.sft.enabled:
    kw = dict(
      steps=run.sft.steps,
      batch_size=run.sft.batch_size,
      learning_rate=run.sft.learning_rate,
      distractor=run.sft.distractor,
      seed=run.seed,
      log_fn=log_fn,
    )
    if base is None:
      params = sft.warm_start(fns, params, **kw)
    else:
      base = sft.warm_start(fns, base, frozen=params, **kw)
  return base, fns.model.with_critic(params, run.seed)


def save(ckpt, state: RunState, rollout: Rollout, step: int, meta: dict[str, Any]) -> None:
  """Checkpoints `state` after loop step `step`: its items by name, `meta` and the rollout's.

  `rollout` is the one whose carried state `state` holds (placed or not); its
  signature goes into the meta, so that a resume it no longer fits is refused
  (`check_rollout`).
  """
  layers = {"layers": relayout.layout_of(state.train.params)}
  carried = {"carried": carried_record(state.train.params, state.train.reward_stats is not None)}
  meta = meta | state_meta(state, rollout) | layers | carried
  ckpt.save(step, state_items(state, rollout), meta)


# What a checkpoint's train state holds beyond the policy, each with the field that decides
# it; checkpoints written before the record hold neither.
_CARRIED_FIELDS = {"critic_params": "critic.model", "reward_stats": "critic.reward_norm"}
_CARRIED_BEFORE = {"critic_params": 0, "reward_stats": False}


def carried_record(params, reward_stats: bool) -> dict[str, Any]:
  """A train state's separate critic (its parameter count; 0: none) and reward statistics."""
  critic = params["critic"] if "critic" in params else None
  count = 0 if critic is None else sum(int(x.size) for x in jax.tree.leaves(critic))
  return {"critic_params": count, "reward_stats": bool(reward_stats)}


def check_carried(ckpt, comps: Components) -> None:
  """Refuses, naming the field, a latest checkpoint whose train state holds another separate
  critic or no reward statistics where this run keeps them (or the other way round): its
  items could not be restored, so not even `--allow_config_change` resumes it.

  Raises:
    workdir.ConfigChanged: naming `config.critic.model` or `config.critic.reward_norm`.
  """
  try:
    meta = ckpt.restore_meta()
  except checkpointing.CheckpointError:
    return  # `restore_latest` reports it and falls back to an older step
  had = meta.get("carried", _CARRIED_BEFORE)
  model = comps.fns.model
  params = {}  # no separate critic: nothing to build
  if model.critic:
    params = jax.eval_shape(lambda: model.init_params(comps.run.seed))
  has = carried_record(params, comps.fns.learner.reward_stats)
  for key, field in _CARRIED_FIELDS.items():
    if had.get(key, _CARRIED_BEFORE[key]) != has[key]:
      raise workdir_lib.ConfigChanged(
        f"config.{field}: the checkpoint of step {meta.get('step')} holds {key} "
        f"{had.get(key)!r}, this run's would be {has[key]!r}; its train state cannot be "
        f"restored into this one, not even with --allow_config_change (restore {field} "
        "or use a new workdir)"
      )


def base_record(base, model: str) -> dict[str, str] | None:
  """What a checkpoint records of a LoRA run's frozen base: its source and fingerprint."""
  return None if base is None else {"model": model, "fingerprint": models.lora.fingerprint(base)}


def _same_base(want, record, base, stacked: bool) -> bool:
  """Whether a checkpoint's base record `want` names this run's base (`record`) in either
  layout of the decoder blocks."""
  if want is None or record is None or want.get("model") != record["model"]:
    return False
  return relayout.fingerprint_matches(want.get("fingerprint"), base, stacked, record["fingerprint"])


def _signature(meta: dict[str, Any]) -> dict[str, Any] | None:
  """The signature of the rollout state a checkpoint holds (`Rollout.signature`)."""
  if "rollout" in meta:
    return meta["rollout"]
  old = meta.get("episode_pool")  # checkpoints written before the rollout protocol
  if old is None:
    return None
  return {"item": "episode_pool", "slots": old.get("slots"), "budget": old.get("budget")}


def check_rollout(ckpt, rollout: Rollout) -> None:
  """Refuses, naming the field, a latest checkpoint whose rollout state does not fit `rollout`.

  Raises:
    workdir.ConfigChanged: the carried state's shape changed (or it was turned on or off).
  """
  try:
    meta = ckpt.restore_meta()
  except checkpointing.CheckpointError:
    return  # `restore_latest` reports it and falls back to an older step
  had, has = _signature(meta), rollout.signature()
  if had != has:  # not allowed by allow_config_change: the carried state cannot be taken back
    raise workdir_lib.ConfigChanged(
      f"config.rollout.partial_budget: the checkpoint of step {meta.get('step')} holds "
      f"a rollout in flight {had or 'that does not exist'}, this run's is "
      f"{has or 'none'}; refusing to resume (restore the budget or use a new workdir)"
    )


class Begin(NamedTuple):
  """Where a run begins: its state and step, and what the checkpoint's meta recorded.

  Attributes:
    state: the run state (restored, or fresh).
    step: the loop step `state` is after (0 for a fresh run).
    start_accuracy: the accuracy after the warm start (None until evaluated).
    base: a LoRA run's base record (`base_record`), else None.
    choice: the automatic sampler choice (`sampler_choice.SamplerChoice.state`), or None.
    wall_s: the run's wall time up to the checkpoint, every command's included
      (0 for a fresh run; None for a checkpoint written before it was recorded).
    costs: the run's cost totals up to the checkpoint (`step.costs`; zero for a
      fresh run, None for a checkpoint written before they were recorded).
  """

  state: RunState
  step: int
  start_accuracy: float | None
  base: dict[str, str] | None
  choice: dict[str, Any] | None
  wall_s: float | None
  costs: costs_lib.Costs | None


def restore_or_init(comps: Components, ckpt, data_iter, workdir: str, model: str) -> Begin:
  """Where the run begins: from the latest checkpoint, or fresh.

  The rollout's carried state (episodes or groups in flight) is restored by its item name.

  Raises:
    ValueError: the checkpoint's adapters were trained on another base.
  """
  fns = comps.fns
  if ckpt.latest_step():
    # The base is rebuilt (loaded, warm-started) as at the start; only adapters are saved.
    base, params = initial_weights(comps, warm_start=fns.model.lora is not None)
    record = base_record(base, model)
    template = fresh_state(comps, params, base)
    # The newest intact step (corrupt ones are reported and moved aside), in either layout.
    templates = state_items(template, fns.rollout)
    stacked = fns.model.stacked
    items, meta, start = relayout.restore(
      ckpt, templates, step=None, stacked=stacked, workdir=workdir, latest=True
    )
    want = meta.get("base")
    if want != record and not _same_base(want, record, base, stacked):
      layers = meta.get("layers", relayout.PER_LAYER)
      why = "config.model, the warm start or the checkpoint's files changed"
      if layers != (relayout.STACKED if stacked else relayout.PER_LAYER):  # a warm start
        why = (
          f"the checkpoint's base stores its blocks {layers}: a warm start rebuilt with "
          "config.model_scan_layers changed differs in the last bits; resume in the "
          "checkpoint's layout"
        )
      raise ValueError(
        f"{workdir}: the checkpoint of step {start} holds adapters of the base "
        f"{meta.get('base')}, but this run's base is {record} ({why}); refusing to resume on "
        "another base"
      )
    try:
      costs = costs_lib.from_meta(meta.get("costs"))
    except ValueError as e:
      raise errors.WorkdirError(
        f"{workdir}: the checkpoint of step {start}: {e}",
        "the record is written by the run itself: restore the checkpoint's files, or start "
        "the run afresh in another workdir",
      ) from None
    data_iter.set_state(meta["data_state"])
    state = state_from_items(items, template, fns.rollout, meta)
    return Begin(
      state,
      start,
      meta.get("start_accuracy"),
      record,
      meta.get("sampler_choice"),
      meta.get("wall_s"),
      costs,
    )
  base, params = initial_weights(comps)
  fresh = fresh_state(comps, params, base)
  return Begin(fresh, 0, None, base_record(base, model), None, 0.0, costs_lib.Costs())


def require_step(workdir: str, step: int | None) -> None:
  """Reads checkpoint `step`'s (None: the latest's) metadata: before anything is built.

  Raises:
    checkpointing.MissingCheckpoint: the run has no checkpoint, or not that step.
  """
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), create=False)
  try:
    ckpt.restore_meta(step)
  finally:
    ckpt.close()


def evaluate_checkpoint(config, workdir: str | None = None, step: int | None = None):
  """Evaluates a run's checkpoint (or, without `workdir`, the config's model as built).

  Only the parameters are read from the checkpoint (by name).

  Args:
    config: the config to evaluate with; with `workdir`, None means the run's
      recorded config, and a given one must agree with it (`workdir.eval_config`).
    workdir: a run directory with checkpoints; None evaluates the model of
      `config.model` (a preset at its seed's initialisation, or an HF directory).
    step: checkpoint step; None for the latest.

  Returns:
    dict with `step` and the `eval/` metrics of `evaluation.evaluate`.

  Raises:
    errors.UserError: a workdir that is not a run or has no such checkpoint,
      or a config the run does not agree with.
  """
  if workdir is not None:
    config = workdir_lib.eval_config(config, workdir)
    require_step(workdir, step)
  comps = build_components(config)
  fns, run = comps.fns, comps.run
  # Without adapters the checkpoint holds the whole model: no warm start needed.
  base, params = initial_weights(comps, warm_start=fns.model.lora is not None)
  step_done = 0
  if workdir is not None:
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), create=False)
    try:
      stacked = fns.model.stacked
      items, meta, _ = relayout.restore(
        ckpt, {"params": params}, step=step, stacked=stacked, workdir=workdir
      )
    finally:
      ckpt.close()
    params, step_done = items["params"], meta["step"]
  k = max(run.eval_samples, 1)
  key = step_key(run.seed, step_done, EVAL)
  full = models.lora.join(base, params)
  return {"step": step_done, **evaluation.evaluate(fns, full, key, run.eval_prompts, k, run.seed)}
