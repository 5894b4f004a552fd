"""Start-up checks of an experiment: bad values fail naming the field, before anything compiles.

`validate_config(config)` runs before anything is built (no model, no data,
no compilation): every field of `configs/default.py` has a type, range,
finiteness or enum check (tests/test_validation.py lists the check of each
field), and the batch must split over the mesh. A misspelt loss or an
impossible batch split fails in milliseconds with
`ValueError("config.<field>: ...")`.

The data checks (`validate_data`) live in `data_checks` and are re-exported here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from offpolicy_jax import advantages, losses, models
from offpolicy_jax.rewards import tasks
from offpolicy_jax.run import replay
from offpolicy_jax.scale import disagg, sharding

LOSS_OVERRIDES = (
  "eps_low",
  "eps_high",
  "eps_low_prime",
  "eps_high_prime",
  "dual_clip_c",
  "reg_coef",
  "kl_coef",
  "entropy_coef",
  "temp",
  "agg",
)
MODEL_DTYPES = ("float32", "bfloat16")


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
  _need(
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
  _int(config, "train.micro_batch_size", 0, note=" (0 = the whole minibatch)")
  _need(
    size == 0 or rows % size == 0,
    "train.micro_batch_size",
    f"must divide the minibatch of {rows} rows, got {size}",
  )
  return size or rows


# ----------------------------------------------------------------- helpers


def _need(ok: bool, field: str, msg: str) -> None:
  if not ok:
    raise ValueError(f"config.{field}: {msg}")


def _get(c, field: str) -> Any:
  for part in field.split("."):
    c = c[part]
  return c


def _is_int(v) -> bool:
  return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


def _int(c, field: str, lo: int, hi: int | None = None, note: str = "") -> None:
  """`field` is an int >= lo (and < hi)."""
  v = _get(c, field)
  ok = _is_int(v) and v >= lo and (hi is None or v < hi)
  want = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
  _need(ok, field, f"must be an int {want}{note}, got {v!r}")


def _float(c, field: str, lo: float, hi: float = math.inf, *, lo_open=False, hi_open=False):
  """`field` is a finite number in the interval between lo and hi."""
  v = _get(c, field)
  ok = _is_num(v) and math.isfinite(v)
  ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
  if hi == math.inf:
    want = f"{'>' if lo_open else '>='} {lo}"
  else:
    want = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
  _need(ok, field, f"must be a finite number {want}, got {v!r}")


def _choice(c, field: str, choices) -> None:
  v = _get(c, field)
  _need(v in choices, field, f"must be one of {', '.join(map(repr, choices))}, got {v!r}")


def _bool(c, field: str) -> None:
  v = _get(c, field)
  _need(isinstance(v, bool | np.bool_), field, f"must be True or False, got {v!r}")


def _str(c, field: str) -> None:
  v = _get(c, field)
  _need(isinstance(v, str), field, f"must be a string, got {v!r}")


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
      _need(ok, name, f"must be finite in float32 (|x| <= {_FLOAT32_MAX:.4g}), got {v}")


# ----------------------------------------------------------------- the config


def validate_config(config) -> None:
  """Checks a config before anything is built.

  Raises:
    ValueError: `config.<field>: ...` naming the offending field (a non-finite
      float, an out-of-range value, an unknown name, a batch that does not
      split into minibatches, micro-batches, processes or the mesh's
      data * fsdp devices, a missing model directory or data file, ...).
  """
  c = config
  _validate_finite(c)
  _validate_run(c)
  _validate_sampling(c)
  _validate_rewards(c)
  _validate_loss(c)
  _validate_lag(c)
  _validate_replay(c)
  _validate_train(c)
  _validate_optimizer(c)
  _validate_mesh(c)
  _validate_sources(c)
  _validate_sft(c)


def _validate_run(c) -> None:
  _int(c, "seed", 0, 2**31)
  _int(c, "total_steps", 1)
  _int(c, "log_every", 1)
  _int(c, "profile_steps", 0)
  for k in ("checkpoint_every", "eval_every", "eval_prompts"):
    _int(c, k, 0)
  _int(c, "eval_samples", 1, note=" (1 = greedy accuracy only, no pass@k)")
  _int(c, "keep_checkpoints", 1)
  for k in ("async_checkpoint", "tensorboard", "progress"):
    _bool(c, k)
  _str(c, "wandb_project")


def _validate_sampling(c) -> None:
  _int(c, "max_prompt_len", 1)
  _int(c, "max_new_tokens", 1)
  _bool(c, "data.truncate_prompts")
  _float(c, "temperature", 0, lo_open=True)
  _float(c, "top_p", 0, 1, lo_open=True)
  _int(c, "top_k", 0, note=" (0 = off)")
  _int(c, "group_size", 2, note=" (group-relative advantages)")
  _int(c, "prompts_per_step", 1)
  _int(c, "rollout.partial_budget", 0, note=" (0 = off)")
  if c.rollout.partial_budget:
    _need(
      c.lag.mode == "sync",
      "rollout.partial_budget",
      f"partial rollouts run in lag.mode='sync' only, got {c.lag.mode!r}",
    )


def _validate_rewards(c) -> None:
  for field in ("reward_timeout", "reward_batch_timeout"):
    v = c[field]
    ok = _is_num(v) and math.isfinite(v)
    ok = ok and (v > 0 or (field == "reward_batch_timeout" and v == 0))
    zero = " (or 0: 2 * reward_timeout)" if field == "reward_batch_timeout" else ""
    _need(ok, field, f"must be a finite number of seconds > 0{zero}, got {v}")
  _int(c, "reward_workers", 0, note=" (0 = one per CPU)")
  _int(c, "reward_memory_mb", 256)
  _choice(c, "reward_sandbox", ("strict", "warn"))


def _validate_loss(c) -> None:
  _need(
    c.loss.name in losses.names(),
    "loss.name",
    f"unknown loss {c.loss.name!r}; known: {', '.join(losses.names())}",
  )
  for k in LOSS_OVERRIDES:
    v = c.loss[k]
    if k == "agg":
      if v is not None:
        _choice(c, "loss.agg", losses.AGG_MODES)
    elif v is not None:
      _float(c, f"loss.{k}", 0)
  try:
    losses.get_spec(c.loss.name, **loss_overrides(c))
  except (ValueError, TypeError) as e:
    raise ValueError(f"config.loss: {e}") from e
  _need(
    advantage_name(c) in advantages.names(),
    "advantage.name",
    f"unknown advantage {c.advantage.name!r}; known: {', '.join(advantages.names())}",
  )


def _validate_lag(c) -> None:
  _choice(c, "lag.mode", ("sync", "async"))
  _int(c, "lag.sync_interval", 1)
  _int(c, "lag.sync_offset", 0)
  _int(c, "lag.max_staleness", 0, note=" (0 = no bound)")


def _validate_replay(c) -> None:
  _int(c, "replay.capacity_batches", 1)
  _choice(c, "replay.policy", replay.POLICIES)
  _int(c, "replay.max_reuse", 0, note=" (0 = unlimited)")
  _float(c, "replay.temperature", 0, lo_open=True)


def _validate_train(c) -> None:
  """The batch of G*K rows must split into minibatches, micro-batches and processes."""
  _int(c, "train.num_epochs", 1)
  _bool(c, "train.shared_prefix")
  _bool(c, "train.skip_zero_advantage")
  micro_batch_rows(c)
  _need(
    c.prompts_per_step % jax.process_count() == 0,
    "prompts_per_step",
    f"must divide by the number of processes ({jax.process_count()})",
  )


def _validate_optimizer(c) -> None:
  _float(c, "optimizer.learning_rate", 0)
  _int(c, "optimizer.warmup_steps", 0)
  _float(c, "optimizer.b1", 0, 1, hi_open=True)
  _float(c, "optimizer.b2", 0, 1, hi_open=True)
  _float(c, "optimizer.weight_decay", 0)
  _float(c, "optimizer.grad_clip", 0)


def mesh_shape(config, device_count: int | None = None) -> tuple[int, int, int]:
  """`(data, fsdp, tensor)` sizes of `config.mesh`, with a -1 resolved.

  Mirrors `components.make_mesh`: a -1 axis takes the devices left by the
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
  for a, s in sizes.items():
    _need(_is_int(s) and (s >= 1 or s == -1), f"mesh.{a}", f"must be an int >= 1 or -1, got {s!r}")
  fill = [a for a, s in sizes.items() if s == -1]
  _need(len(fill) <= 1, "mesh", f"only one axis may be -1, got {', '.join(fill)}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    _need(
      n % fixed == 0,
      f"mesh.{fill[0]}",
      f"-1 fills the remaining devices, but {n} devices do not divide by the other axes' "
      f"product {fixed}",
    )
    sizes[fill[0]] = n // fixed
  else:
    _need(fixed <= n, "mesh", f"data * fsdp * tensor = {fixed} devices, but only {n} exist")
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


def _validate_mesh(c) -> None:
  """The G*K training rows (and, across processes, the G prompts) split over data * fsdp."""
  _int(c, "mesh.sampler_devices", 0, note=" (0 = the sampler shares the trainer's mesh)")
  if c.mesh.sampler_devices:
    _validate_disaggregated(c)
  data_size, fsdp_size, _ = mesh_shape(c)
  n = data_size * fsdp_size
  rows = c.prompts_per_step * c.group_size
  _need(
    rows % n == 0,
    "prompts_per_step",
    f"the batch of prompts_per_step * group_size = {rows} rows must divide over the "
    f"mesh's data * fsdp = {n} devices (or change config.mesh)",
  )
  procs = jax.process_count()
  _need(
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
  _need(
    math.prod(shape) == trainer,
    "mesh",
    f"with mesh.sampler_devices = {k} the trainer's data * fsdp * tensor = {math.prod(shape)} "
    f"must use exactly the other {trainer} devices (or set one axis to -1)",
  )
  _need(
    c.prompts_per_step % k == 0,
    "prompts_per_step",
    f"{c.prompts_per_step} prompts must divide over the sampler's mesh.sampler_devices = {k}",
  )
  _need(
    c.lag.mode == "sync" or jax.process_count() == 1,
    "lag.mode",
    "'async' with mesh.sampler_devices > 0 runs in one process only (each process's "
    "sampler thread would pick its own parameter version)",
  )


def _validate_sources(c) -> None:
  """Model, tokenizer, task and data files exist."""
  _str(c, "model")
  _choice(c, "model_dtype", MODEL_DTYPES)
  _bool(c, "model_scan_layers")
  if os.path.sep in c.model or os.path.isdir(c.model):
    _need(
      os.path.isfile(os.path.join(c.model, "config.json")),
      "model",
      f"{c.model!r} is not a Hugging Face directory with config.json",
    )
  else:
    _need(
      c.model in models.preset_names(),
      "model",
      f"unknown preset {c.model!r} (and not a local directory); presets: "
      f"{', '.join(models.preset_names())}",
    )
  _str(c, "tokenizer")
  if c.tokenizer:
    _need(
      os.path.isfile(os.path.join(c.tokenizer, "tokenizer.json")),
      "tokenizer",
      f"{c.tokenizer!r} has no tokenizer.json",
    )
  for k, v in c.task_kwargs.items():
    if isinstance(v, str) and (k.endswith("_path") or k.endswith("_file")):
      _need(os.path.exists(v), f"task_kwargs.{k}", f"data file not found: {v}")
  known = tasks.task_names()
  _need(
    c.task in known or c.task.startswith("reasoning_gym:"),
    "task",
    f"unknown task {c.task!r}; known: {', '.join(known)}",
  )


def _validate_sft(c) -> None:
  _bool(c, "sft.enabled")
  _float(c, "sft.learning_rate", 0)
  if c.sft.enabled:
    _int(c, "sft.steps", 1, note=" when sft.enabled")
    _int(c, "sft.batch_size", 1, note=" when sft.enabled")
