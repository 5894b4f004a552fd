"""Start-up checks of an experiment: bad values fail naming the field, before anything compiles.

`validate_config(config)` runs before anything is built (no model, no data,
no compilation): every float is finite, every field's own check declared
beside it in `config_schema` runs (type, range, a fixed set of words), then
the checks here that need a registry (loss, advantage, replay policy, task and
model names), a file or other fields: the batch must split into minibatches,
micro-batches, processes and the mesh. tests/test_validation.py lists a bad
value of every field. A misspelt loss or an impossible batch split fails in
milliseconds with `ValueError("config.<field>: ...")`. `validate_settings` is
the part that reads the config alone, not this machine's devices or files:
what a sweep checks before it writes commands that run elsewhere.

The data checks (`validate_data`) live in `data_checks` and are re-exported here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from offpolicy_jax import advantages, config_fields, config_schema, errors, losses, models
from offpolicy_jax.config_spec import RunSpec
from offpolicy_jax.learn import replay
from offpolicy_jax.models import hub
from offpolicy_jax.rewards import tasks
from offpolicy_jax.run import critic_settings, sampling_settings
from offpolicy_jax.scale import disagg, sharding

# The overrides of the loss preset: every `loss.*` field of the schema but `loss.name`.
LOSS_OVERRIDES = tuple(
  f.name.removeprefix("loss.")
  for f in config_schema.RUN_FIELDS
  if f.name.startswith("loss.") and f.name != "loss.name"
)


def loss_overrides(config) -> dict[str, Any]:
  """The loss overrides set in `config.loss` (fields left at None are not overrides)."""
  return {k: config.loss[k] for k in LOSS_OVERRIDES if config.loss[k] is not None}


def advantage_name(config) -> str:
  """`config.advantage.name`, or the loss preset's default (`losses.default_advantage`)."""
  if config.advantage.name:
    return config.advantage.name
  return losses.default_advantage(config.loss.name)


def updates_per_batch(config) -> int:
  """U: optimizer steps (parameter versions) taken per sampled batch."""
  return config.train.num_minibatches * config.train.num_epochs


def minibatch_rows(config) -> int:
  """Rows of one minibatch: G * K / train.num_minibatches.

  Raises:
    ValueError: naming `train.num_minibatches` when it does not divide G * K.
  """
  rows, n = config.group_size * config.prompts_per_step, config.train.num_minibatches
  errors.need(
    _is_int(n) and n >= 1 and rows % n == 0,
    "train.num_minibatches",
    f"must be >= 1 and divide the batch of {rows} rows, got {n}",
  )
  return rows // n


def micro_batch_rows(config) -> int:
  """Rows of one gradient-accumulation micro-batch (the one rule of `train.micro_batch_size`).

  `train.micro_batch_size` rows, or the whole minibatch when it is 0; the
  train step accumulates `minibatch_rows // micro_batch_rows` micro-batches
  per optimizer step. Components and the planner both read it from here.

  Raises:
    ValueError: naming the field when the minibatch does not split.
  """
  rows, size = minibatch_rows(config), config.train.micro_batch_size
  _check(config, "train.micro_batch_size")
  errors.need(
    size == 0 or rows % size == 0,
    "train.micro_batch_size",
    f"must divide the minibatch of {rows} rows, got {size}",
  )
  return size or rows


# ----------------------------------------------------------------- helpers


def _is_int(v) -> bool:
  return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _check(c, field: str, check: config_fields.Check | None = None) -> None:
  """`field` passes `check` (default: the one declared beside it in `config_schema`)."""
  if check is None:
    declared = config_schema.field(field)
    assert declared is not None and declared.check is not None, field
    check = declared.check
  complaint = check(config_schema.get(c, field))
  errors.need(complaint is None, field, complaint or "")


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _validate_finite(c, prefix: str = "") -> None:
  """Every float anywhere in the config (task_kwargs included) is finite in float32.

  The hot path computes in float32: a learning rate of 1e39 is finite in
  Python but inf on the device.
  """
  items = c.items() if isinstance(c, Mapping) or hasattr(c, "items") else enumerate(c)
  for k, v in items:
    name = f"{prefix}{k}"
    if hasattr(v, "items") or isinstance(v, list | tuple):
      _validate_finite(v, f"{name}.")
    elif isinstance(v, float | np.floating):
      ok = math.isfinite(v) and abs(float(v)) <= _FLOAT32_MAX
      errors.need(ok, name, f"must be finite in float32 (|x| <= {_FLOAT32_MAX:.4g}), got {v}")


# ----------------------------------------------------------------- the config


def validate_config(config) -> RunSpec:
  """Checks a config before anything is built; returns its `RunSpec`.

  `validate_settings`, then what depends on this machine: the processes, the
  mesh's devices, the model, tokenizer and data files. Runs once per run, at
  its edge (`experiments.train`, `loop.train_and_evaluate` or
  `components.build_components`, whichever the caller enters by): each hands
  the spec it returns to the next (`spec=`), which then does not check again.

  Raises:
    ValueError: `config.<field>: ...` naming the offending field (a non-finite
      float, an out-of-range value, an unknown name, a batch that does not
      split into minibatches, micro-batches, processes or the mesh's
      data * fsdp devices, a missing model directory or data file, ...).
  """
  c = config
  validate_settings(c)
  with errors.as_user_error():
    _validate_processes(c)
    _validate_mesh(c)
    _validate_files(c)
  return RunSpec.from_config(c)


def validate_settings(config) -> None:
  """The checks of `validate_config` that read the config alone, not this machine.

  Values, names (loss, advantage, replay policy, task, model preset) and how
  the fields fit together; not the devices, the processes or the files. What
  a sweep checks before it writes commands that run elsewhere (a cluster's
  model paths and devices need not exist here). Imports JAX but starts no
  backend: no device is touched, nothing compiles.

  Raises:
    ValueError: `config.<field>: ...` naming the offending field.
  """
  c = config
  with errors.as_user_error():
    _validate_finite(c)
    config_schema.check(c)
    _validate_loss(c)  # names the loss and the advantage before they are read
    sampling_settings.validate(c, advantage_name(c))
    _validate_replay(c)
    micro_batch_rows(c)  # the batch splits into minibatches and micro-batches
    _validate_names(c)
    _validate_sft(c)
    _validate_lora(c)
    critic_settings.validate(c)
    _validate_multiturn(c)


def _validate_loss(c) -> None:
  _need_known(c.loss.name, losses.names(), "loss.name", "loss", "docs/losses.md")
  if c.loss.agg is not None:
    _check(c, "loss.agg", config_fields.Choice(tuple(losses.AGG_MODES)))
  try:
    losses.get_spec(c.loss.name, **loss_overrides(c))
  except (ValueError, TypeError) as e:
    raise ValueError(f"config.loss: {e}") from e
  if c.advantage.name:  # else the preset's own, a known one
    _need_known(
      c.advantage.name, advantages.names(), "advantage.name", "advantage", "docs/losses.md"
    )


def _need_known(value: str, known, field: str, what: str, listed: str) -> None:
  """`value` is a name in `known`; else the error suggests the nearest and says where they are."""
  if value in known:
    return
  near = errors.did_you_mean(value, known)
  where = f"{listed} lists every name"
  raise errors.ConfigError(
    f"config.{field}: unknown {what} {value!r}", f"{near} {where}" if near else where
  )


def _validate_replay(c) -> None:
  _check(c, "replay.policy", config_fields.Choice(tuple(replay.POLICIES)))


def _validate_processes(c) -> None:
  """The G prompts of a step split over the processes."""
  errors.need(
    c.prompts_per_step % jax.process_count() == 0,
    "prompts_per_step",
    f"must divide by the number of processes ({jax.process_count()})",
  )


def mesh_shape(config, device_count: int | None = None) -> tuple[int, int, int]:
  """`(data, fsdp, tensor)` sizes of `config.mesh`, with a -1 resolved.

  Mirrors `components.trainer_mesh`: a -1 axis takes the devices left by the
  others; without one the mesh uses the first data * fsdp * tensor devices.
  With `mesh.sampler_devices = k > 0` these are the trainer's sizes, over
  the devices the sampler leaves.

  Args:
    config: the experiment config.
    device_count: devices available (sampler's included); default `jax.device_count()`.

  Returns:
    The three axis sizes.

  Raises:
    ValueError: naming the mesh field that is invalid or does not fit the devices.
  """
  n = jax.device_count() if device_count is None else device_count
  n -= config.mesh.get("sampler_devices", 0) or 0
  sizes = {a: config.mesh[a] for a in sharding.MESH_AXES}
  for a in sizes:
    _check(config, f"mesh.{a}")
  fill = [a for a, s in sizes.items() if s == -1]
  errors.need(len(fill) <= 1, "mesh", f"only one axis may be -1, got {', '.join(fill)}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    errors.need(
      n % fixed == 0,
      f"mesh.{fill[0]}",
      f"-1 fills the remaining devices, but {n} devices do not divide by the other axes' "
      f"product {fixed}",
    )
    sizes[fill[0]] = n // fixed
  else:
    errors.need(fixed <= n, "mesh", f"data * fsdp * tensor = {fixed} devices, but only {n} exist")
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


def _validate_mesh(c) -> None:
  """The G*K training rows (and, across processes, the G prompts) split over data * fsdp."""
  if c.mesh.sampler_devices:
    _validate_disaggregated(c)
  data_size, fsdp_size, _ = mesh_shape(c)
  n = data_size * fsdp_size
  rows = c.prompts_per_step * c.group_size
  errors.need(
    rows % n == 0,
    "prompts_per_step",
    f"the batch of prompts_per_step * group_size = {rows} rows must divide over the "
    f"mesh's data * fsdp = {n} devices (or change config.mesh)",
  )
  procs = jax.process_count()
  errors.need(
    procs == 1 or c.prompts_per_step % n == 0,
    "prompts_per_step",
    f"{c.prompts_per_step} prompts must divide over the mesh's data * fsdp = {n} devices "
    f"when {procs} processes assemble the batch",
  )


def _validate_disaggregated(c) -> None:
  """A sampler mesh of `mesh.sampler_devices` devices beside a trainer mesh using all the rest."""
  k = c.mesh.sampler_devices
  try:
    disagg.split_devices(jax.devices(), k)
  except ValueError as e:
    raise ValueError(f"config.{e}") from e
  trainer = jax.device_count() - k
  shape = mesh_shape(c)
  errors.need(
    math.prod(shape) == trainer,
    "mesh",
    f"with mesh.sampler_devices = {k} the trainer's data * fsdp * tensor = {math.prod(shape)} "
    f"must use exactly the other {trainer} devices (or set one axis to -1)",
  )
  errors.need(
    c.prompts_per_step % k == 0,
    "prompts_per_step",
    f"{c.prompts_per_step} prompts must divide over the sampler's mesh.sampler_devices = {k}",
  )
  errors.need(
    c.lag.mode == "sync" or jax.process_count() == 1,
    "lag.mode",
    "'async' with mesh.sampler_devices > 0 runs in one process only (each process's "
    "sampler thread would pick its own parameter version)",
  )


def _is_preset(model: str) -> bool:
  """Whether `config.model` names a preset: not a directory, a path or a repo id."""
  return not (os.path.isdir(model) or os.path.sep in model or hub.is_repo_id(model))


def _models(c) -> list[tuple[str, str]]:
  """(field, name) of each model a run builds: the policy, and a separate critic's own."""
  critic = c.critic.model
  own = critic and critic != critic_settings.FROM_POLICY
  return [("model", c.model)] + ([("critic.model", critic)] if own else [])


def _validate_names(c) -> None:
  """The task and the model presets are known (a model directory or repo is `_validate_files`')."""
  for field, name in _models(c):
    errors.need(
      not _is_preset(name) or name in models.preset_names(),
      field,
      f"unknown preset {name!r} (and not a local directory); presets: "
      f"{', '.join(models.preset_names())}",
    )
  known = tasks.task_names()
  errors.need(
    c.task in known or c.task.startswith("reasoning_gym:"),
    "task",
    f"unknown task {c.task!r}; known: {', '.join(known)}",
  )


def _validate_files(c) -> None:
  """The model directories or Hugging Face repos, the tokenizer and the data files exist."""
  for field, name in _models(c):
    if os.path.isdir(name) or (os.path.sep in name and not hub.is_repo_id(name)):
      errors.need(
        os.path.isdir(name), field, f"{name!r}: no such directory (nor a preset or a repo id)"
      )
      errors.need(
        os.path.isfile(os.path.join(name, "config.json")),
        field,
        f"{name!r} is not a Hugging Face directory with config.json",
      )
    elif hub.is_repo_id(name):
      local = hub.model_dir(name, field)  # downloads, or finds it in the cache
      errors.need(
        local is not None and os.path.isfile(os.path.join(local, "config.json")),
        field,
        f"the Hugging Face repo {name!r} has no config.json",
      )
  if c.tokenizer:
    errors.need(
      os.path.isfile(os.path.join(c.tokenizer, "tokenizer.json")),
      "tokenizer",
      f"{c.tokenizer!r} has no tokenizer.json",
    )
  for k, v in c.task_kwargs.items():
    if isinstance(v, str) and (k.endswith("_path") or k.endswith("_file")):
      errors.need(os.path.exists(v), f"task_kwargs.{k}", f"data file not found: {v}")


def _validate_lora(c) -> None:
  msg = f"adapter dropout {c.lora.dropout} needs adapters: set lora.rank > 0 (0: full fine-tuning)"
  errors.need(not c.lora.dropout or c.lora.rank > 0, "lora.dropout", msg)


def _validate_multiturn(c) -> None:
  mt = c.multiturn
  errors.need(
    mt.gamma == 1.0 or mt.credit == "turn",
    "multiturn.gamma",
    "a turn discount needs multiturn.credit = 'turn'",
  )
  if not mt.max_turns:
    errors.need(
      mt.credit == "trajectory",
      "multiturn.credit",
      "turn-level credit needs multi-turn episodes (multiturn.max_turns > 0)",
    )
    return
  errors.need(
    mt.turn_tokens <= c.max_new_tokens,
    "multiturn.turn_tokens",
    f"a turn of {mt.turn_tokens} tokens does not fit the trajectory's max_new_tokens = "
    f"{c.max_new_tokens}",
  )
  # Each of these samples whole single-turn responses without stopping for the environment
  # (partial rollouts of episodes are `rollout.episode_pool`; under lag.mode='async' an episode
  # in flight continues under the parameters published while it runs, `episodes.WholeEpisodes`).
  for field, on in (
    ("rollout.continuous_slots", c.rollout.continuous_slots),
    ("mesh.sampler_devices", c.mesh.sampler_devices),
  ):
    errors.need(not on, field, f"multi-turn episodes (multiturn.max_turns > 0) do not take {field}")


def _validate_sft(c) -> None:
  if c.sft.enabled:
    _check(c, "sft.steps", config_fields.Int(1, note=" when sft.enabled"))
    _check(c, "sft.batch_size", config_fields.Int(1, note=" when sft.enabled"))
