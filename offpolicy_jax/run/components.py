"""What a run is built from: `build_components(config) -> Components`.

`build_components` is the one function that reads the experiment ConfigDict
(with its cheap parts, which the planner and the study call too: `sizes`,
`step_options`, `replay_options`, `replay_capacity`, `snapshot_slots`). It validates the
config (and, once per workdir, the data), then returns a frozen `Components`
record: the mesh, the model's graph, tokenizer, task, loss, optimizer and the
jitted functions of the hot path (`run_state.StepFns`), plus the run's config
as typed records (`config_spec.RunSpec`, generated from the schema). Nothing
in it points back to the ConfigDict, and it holds no run state.

Compiled functions are shared: the part of a `Components` that compiles
(`StepFns` and the eval prompt batches) is cached under exactly the config
fields it is built from (those whose `config_schema` role is compiled), so
runs of a sweep, a notebook or the tests that differ only in seed, length,
lag, replay policy, warm start or logging compile once. The other fields are
the run's settings, read from `Components.run` at their dotted names
(`run.lag.sync_interval`); the cached part holds nothing built from them, so
it cannot go stale.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from offpolicy_jax import advantages, config_schema, errors, lag, losses
from offpolicy_jax.config_spec import RunSpec
from offpolicy_jax.learn import scorer, train_state
from offpolicy_jax.learn.step_options import LearnerParts, StepOptions
from offpolicy_jax.models import hub
from offpolicy_jax.models.parts import ModelParts
from offpolicy_jax.rewards import tasks
from offpolicy_jax.run import (
  components_rollout,
  critic_settings,
  data_checks,
  evaluation,
  model_build,
  validation,
)
from offpolicy_jax.sampling import continuous
from offpolicy_jax.sampling import partial as partial_rollouts
from offpolicy_jax.sampling import sampler as sampling
from offpolicy_jax.scale import disagg, sharding
from offpolicy_jax.step import run_state


@dataclasses.dataclass(frozen=True)
class Components:
  """Everything a run needs besides its state; built by `build_components`.

  Attributes:
    fns: the model, task, loss and jitted functions (`run_state.StepFns`).
    run: the run's config as typed records (`config_spec.RunSpec`); the fields
      that are not compiled (`config_schema` roles) are its settings.
    replay: how the buffer samples (`replay.*`).
    replay_capacity_batches: the buffer's capacity in batches (`replay_capacity`).
  """

  fns: run_state.StepFns
  run: RunSpec
  replay: run_state.ReplayOptions
  replay_capacity_batches: int

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self.fns.model.mesh

  @property
  def task(self) -> tasks.Task:
    return self.fns.task

  @property
  def tokenizer(self) -> Any:
    return self.fns.model.tokenizer


def trainer_mesh(config) -> jax.sharding.Mesh:
  """The trainer's `(data, fsdp, tensor)` mesh of `config.mesh` (-1 fills the remaining devices).

  With `mesh.sampler_devices > 0` it is the trainer's part of a
  disaggregated layout (`disagg.make_meshes`).
  """
  sizes = (config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  if config.mesh.sampler_devices:
    return sampler_and_trainer_meshes(config)[1]
  devices = None
  if -1 not in sizes:
    n = int(np.prod(sizes))
    if n > jax.device_count():
      raise ValueError(f"config.mesh: {sizes} needs {n} devices, have {jax.device_count()}")
    devices = jax.devices()[:n]
  try:
    return sharding.make_mesh(*sizes, devices=devices)
  except ValueError as e:
    raise ValueError(f"config.{e}") from e


def sampler_and_trainer_meshes(config) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
  """The disaggregated layout of `config.mesh` (`mesh.sampler_devices > 0`)."""
  sizes = (config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  try:
    return disagg.make_meshes(jax.devices(), config.mesh.sampler_devices, sizes)
  except ValueError as e:
    raise ValueError(f"config.{e}") from e


def optimizer(config):
  """The optax optimizer of `config.optimizer`."""
  opt = config.optimizer
  return train_state.make_optimizer(
    opt.learning_rate,
    warmup_steps=opt.warmup_steps,
    weight_decay=opt.weight_decay,
    max_grad_norm=opt.grad_clip or None,
    b1=opt.b1,
    b2=opt.b2,
    moment_dtype=opt.moment_dtype,
    head_learning_rate=_head_learning_rate(config),
    separate_critic=bool(critic_settings.separate_critic(config)),
  )


def _head_learning_rate(config) -> float | None:
  """The value head's own learning rate, or None: no critic, or the policy's rate."""
  scale = config.critic.lr_scale
  if not critic_settings.estimator(config) or scale == 1.0 or not config.optimizer.learning_rate:
    return None
  return config.optimizer.learning_rate * scale


def step_options(config) -> StepOptions:
  """The train step's static options: loss spec, batch splits, temperature."""
  micro_batches = validation.minibatch_rows(config) // validation.micro_batch_rows(config)
  return StepOptions(
    losses.get_spec(config.loss.name, **validation.loss_overrides(config)),
    num_micro_batches=micro_batches,
    num_minibatches=config.train.num_minibatches,
    num_epochs=config.train.num_epochs,
    temperature=config.temperature,
    group_size=config.group_size,
    shared_prefix=config.train.shared_prefix and _whole_groups(config),
    skip_zero_advantage=config.train.skip_zero_advantage,
    truncated=_scores_truncation(config),
    top_k=config.top_k if _scores_truncation(config) else 0,
    router_aux_coef=config.model_router_aux_coef,
    routing_replay=config.rollout.routing_replay,
    critic=critic_settings.critic_spec(config),
  )


def _scores_truncation(config) -> bool:
  """Whether the learner scores the sampler's truncated distribution (docs/science.md s7)."""
  truncates = config.top_k > 0 or config.top_p < 1.0
  return truncates and config.rollout.behavior_logp == "sampled"


def _scores_old(config) -> bool:
  """Whether the pipeline scores log pi_old (asked for, or a loss that corrects pi_old / mu)."""
  spec = losses.get_spec(config.loss.name, **validation.loss_overrides(config))
  return config.rollout.score_old or spec.needs_old


def _whole_groups(config) -> bool:
  """Whether every micro-batch holds whole groups (what a shared prefix needs)."""
  return validation.micro_batch_rows(config) % config.group_size == 0


def sizes(config, model_config=None) -> run_state.Sizes:
  """The static batch shape of `config` (with its model's config: the recorded routing's too)."""
  routing = None
  if model_config is not None and config.rollout.routing_replay != "off":
    mc = model_config
    routing = (mc.num_layers, mc.num_experts_per_tok, mc.num_experts)
  return run_state.Sizes(
    config.prompts_per_step,
    config.group_size,
    config.max_prompt_len,
    config.max_new_tokens,
    token_advantages=bool(config.multiturn.max_turns) and config.multiturn.credit == "turn",
    token_rewards=critic_settings.turn_rewards(config),
    routing=routing,
  )


def snapshot_slots(lag_mode: str, sync_interval: int, sync_offset: int) -> int:
  """Snapshot slots a run keeps: none on-policy or in async mode (the sampler gets live params)."""
  if lag_mode != "sync" or (sync_interval, sync_offset) == (1, 0):
    return 0
  return lag.snapshot_capacity(sync_interval, sync_offset)


def replay_capacity(config) -> int:
  """Buffer capacity in batches: at least `steps_to_finish` with partial rollouts.

  Between emission and training, up to L = ceil(N / b) batches of finished
  groups wait in the buffer (`sampling.partial`); fewer slots would overwrite
  some before they are trained on.
  """
  c, budget = config, config.rollout.partial_budget
  if not budget:
    return c.replay.capacity_batches
  return max(c.replay.capacity_batches, partial_rollouts.steps_to_finish(c.max_new_tokens, budget))


def _build_fns(config) -> run_state.StepFns:
  c = config
  mesh, sampler_mesh = trainer_mesh(c), None
  if c.mesh.sampler_devices:
    sampler_mesh, mesh = sampler_and_trainer_meshes(c)
  task = tasks.get_task(c.task, **c.task_kwargs.to_dict())
  tokenizer = model_build.tokenizer(c)
  model_fn = model_build.model_constructor(c, mesh, tokenizer)
  abstract = nnx.eval_shape(lambda: model_fn(0))
  graphdef, _ = nnx.split(abstract)
  components_rollout.check_routing_replay(c, abstract.config)
  sampler_graphdef = graphdef
  if c.rollout.sampler_dtype and c.rollout.sampler_dtype != c.model_dtype:
    # The same float32 parameters, run by the sampler in another compute dtype.
    sampler_fn = model_build.model_constructor(c, mesh, tokenizer, c.rollout.sampler_dtype)
    sampler_graphdef, _ = nnx.split(nnx.eval_shape(lambda: sampler_fn(0)))
  options = step_options(c)
  # Before the reward pool starts.
  partial = components_rollout.partial_sampler(c, sampler_graphdef, task, tokenizer)
  score_old = scorer.make_scorer(graphdef, options) if _scores_old(c) else None
  sample_kw = dict(
    max_new_tokens=c.max_new_tokens, top_p=c.top_p, top_k=c.top_k, eos_id=tokenizer.eos_id
  )
  behaviour_kw = dict(
    group_size=c.group_size,
    temperature=c.temperature,
    behavior_logp=components_rollout.recorded_logp(c),
    decode_block=c.rollout.decode_block,
    **sample_kw,
  )
  record = c.rollout.routing_replay != "off"
  greedy_first = validation.advantage_name(c) in advantages.GREEDY_FIRST  # ReMax's baseline
  sampler = sampling.make_sampler(
    sampler_graphdef, **behaviour_kw, record_routing=record, greedy_first=greedy_first
  )
  continuous_sampler = None
  if c.rollout.continuous_slots:
    continuous_sampler = continuous.make_continuous_sampler(
      sampler_graphdef, slots=c.rollout.continuous_slots, **behaviour_kw
    )
    if not c.rollout.continuous_auto_steps:  # continuous from the start
      sampler = continuous_sampler
  eps = components_rollout.episodes_of(c, task, tokenizer, graphdef, sampler_graphdef)
  model = ModelParts(
    mesh,
    graphdef,
    model_fn,
    tokenizer,
    warm_start_key(c),
    model_build.lora_config(c),
    stacked=bool(abstract.config.scan_layers),
    critic=model_build.critic_start(c),
  )
  gamma = 1.0 if eps is None else eps.gamma
  eval_rows = (
    evaluation.sampled_rows if eps is None else functools.partial(evaluation.episode_rows, eps)
  )
  return run_state.StepFns(
    model=model,
    learner=LearnerParts(options, optimizer(c)),
    task=task,
    sizes=sizes(c, abstract.config),
    packing=run_state.Packing(
      c.group_size, validation.advantage_name(c), gamma, critic_settings.turn_rewards(c)
    ),
    reward=components_rollout.reward(c, task),
    truncate_prompts=c.data.truncate_prompts,
    rollout=components_rollout.rollout_kind(
      c, task, sampler, partial, eps, score_old, mesh, sizes(c, abstract.config)
    ),
    sampler=sampler,
    eval_sampler=functools.partial(
      components_rollout.eval_sampler, graphdef, sample_kw, c.temperature
    ),
    eval_rows=eval_rows,
    sampler_mesh=sampler_mesh,
    continuous=continuous_sampler,
    continuous_auto_steps=c.rollout.continuous_auto_steps,
    prompt_filter=critic_settings.prompt_filter(c),
  )


def replay_options(config) -> run_state.ReplayOptions:
  """How the replay buffer samples, from the `replay.*` fields."""
  c = config.replay
  return run_state.ReplayOptions(c.policy, c.max_reuse or None, float(c.temperature))


_FNS_CACHE: dict[str, run_state.StepFns] = {}
_FNS_CACHE_SIZE = 4


def compile_key(config) -> str:
  """The config fields the compiled part is built from (role compiled), as canonical JSON."""
  return _key(config, lambda name: config_schema.role_of(name).compiled)


def warm_start_key(config) -> str:
  """The config fields a supervised warm start depends on (`Field.warm_start`), as JSON.

  And the parameters' structure: whether the model has a critic's value head,
  and how its blocks are stored (`model_scan_layers`). The head is drawn from
  no key and the warm start's loss does not reach it, so the trunk of a warm
  start is the same with or without it, up to float rounding (the programs
  differ by the head).
  """
  head = bool(critic_settings.estimator(config))
  # A separate critic is part of the graph the warm start trains (keys of earlier runs kept).
  extra = {"critic": True} if critic_settings.separate_critic(config) else {}
  return _key(config, _warm_start, value_head=head, scan_layers=config.model_scan_layers, **extra)


def _key(config, keeps: Callable[[str], bool], **extra) -> str:
  leaves = config_schema.flatten(config.to_dict())
  kept = {k: v for k, v in leaves.items() if keeps(k)} | extra
  return json.dumps(kept, sort_keys=True, default=str)


def _warm_start(name: str) -> bool:
  f = config_schema.field(name)
  return True if f is None else f.warm_start  # an undeclared field: taken to matter


def _with_warm_start(run: RunSpec) -> RunSpec:
  """`run` whose `sft.enabled` says whether the warm start runs.

  A model loaded with weights (`config.model` an HF directory or repo id) skips
  it unless `sft.on_loaded_model`: a few supervised steps on the task's
  demonstrations undo what a trained model learned.
  """
  if not run.sft.enabled or run.sft.on_loaded_model or hub.model_dir(run.model) is None:
    return run
  return dataclasses.replace(run, sft=dataclasses.replace(run.sft, enabled=False))


def build_components(
  config, *, data_cache_dir: str | None = None, spec: RunSpec | None = None
) -> Components:
  """Validates `config` and its data, and builds the run's `Components`.

  Args:
    config: an experiment ConfigDict (configs/default.py lists every field).
    data_cache_dir: where the data scan caches its result (e.g. the workdir).
    spec: `config`'s spec from `validation.validate_config` when the caller has
      validated it already (the config is then not checked again); None: it is
      checked here.

  Raises:
    ValueError: naming the config field (or data file and row) that is wrong.
  """
  spec = validation.validate_config(config) if spec is None else spec
  key = compile_key(config)
  if key not in _FNS_CACHE:
    if len(_FNS_CACHE) >= _FNS_CACHE_SIZE:
      _FNS_CACHE.pop(next(iter(_FNS_CACHE)))
      gc.collect()  # the evicted StepFns and its programs are a reference cycle (its memo)
    # What fails here is the config's: a model directory, a tokenizer, a task's files.
    with errors.as_user_error():
      _FNS_CACHE[key] = _build_fns(config)
  fns = _FNS_CACHE[key]
  # Every prompt checked once (cached under `data_cache_dir`), before anything compiles.
  with errors.as_user_error():
    data_checks.validate_data(spec, fns.task, fns.model.tokenizer, cache_dir=data_cache_dir)
  return Components(
    fns=fns,
    run=_with_warm_start(spec),
    replay=replay_options(config),
    replay_capacity_batches=replay_capacity(config),
  )


def clear_cache() -> None:
  """Drops the cached compiled parts (e.g. after monkeypatching a task in a test)."""
  _FNS_CACHE.clear()
