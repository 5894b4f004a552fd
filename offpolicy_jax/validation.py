"""Start-up checks of an experiment config: bad values fail naming the field.

`validate_config(config)` runs before anything is built (no model, no data,
no compilation), so a misspelt loss or an impossible batch split fails in
milliseconds with `ValueError("config.<field>: ...")`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax

from offpolicy_jax import advantages, losses, models, replay, tasks

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


def loss_overrides(config) -> dict[str, Any]:
  """The loss overrides set in `config.loss` (fields left at None are not overrides)."""
  return {k: config.loss[k] for k in LOSS_OVERRIDES if config.loss[k] is not None}


def advantage_name(config) -> str:
  """`config.advantage.name`, or the loss's natural estimator when it is empty."""
  if config.advantage.name:
    return config.advantage.name
  name = config.loss.name
  if name in ("grpo", "dapo", "gspo", "gspo_token", "gmpo", "ppo", "dual_clip", "sapo"):
    return "grpo"
  return "red_drop" if name == "red_drop" else "group_mean"


def updates_per_batch(config) -> int:
  """U: optimizer steps (parameter versions) taken per sampled batch."""
  return config.train.num_minibatches * config.train.num_epochs


def _need(ok: bool, field: str, msg: str) -> None:
  if not ok:
    raise ValueError(f"config.{field}: {msg}")


def _validate_rewards(c) -> None:
  for field in ("reward_timeout", "reward_batch_timeout"):
    v = c[field]
    ok = math.isfinite(v) and (v > 0 or (field == "reward_batch_timeout" and v == 0))
    _need(ok, field, f"must be a finite number of seconds > 0, got {v}")
  _need(c.reward_workers >= 0, "reward_workers", f"must be >= 0, got {c.reward_workers}")
  _need(c.reward_memory_mb >= 256, "reward_memory_mb", f"must be >= 256, got {c.reward_memory_mb}")
  _need(
    c.reward_sandbox in ("strict", "warn"),
    "reward_sandbox",
    f"must be 'strict' or 'warn', got {c.reward_sandbox!r}",
  )


def validate_config(config) -> None:
  """Checks a config before anything is built.

  Raises:
    ValueError: naming the offending field (unknown loss, eps < 0, group_size < 2,
      a batch that does not split into minibatches, a missing model directory or
      data file, ...).
  """
  c = config
  _need(c.total_steps >= 1, "total_steps", f"must be >= 1, got {c.total_steps}")
  _need(c.group_size >= 2, "group_size", f"must be >= 2 (group-relative), got {c.group_size}")
  _need(c.prompts_per_step >= 1, "prompts_per_step", f"must be >= 1, got {c.prompts_per_step}")
  _need(c.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {c.max_new_tokens}")
  _need(c.max_prompt_len >= 1, "max_prompt_len", f"must be >= 1, got {c.max_prompt_len}")
  _need(c.temperature > 0, "temperature", f"must be > 0 for RL sampling, got {c.temperature}")
  _validate_rewards(c)
  _need(0 <= c.seed < 2**31, "seed", f"must be in [0, 2**31), got {c.seed}")
  _validate_loss(c)
  _validate_lag(c)
  _validate_replay(c)
  _validate_train(c)
  _need(c.optimizer.learning_rate >= 0, "optimizer.learning_rate", "must be >= 0")
  for k in ("checkpoint_every", "eval_every", "eval_prompts", "eval_samples", "keep_checkpoints"):
    _need(c[k] >= 0, k, f"must be >= 0, got {c[k]}")
  _need(c.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
  _validate_sources(c)
  if c.sft.enabled:
    _need(c.sft.steps >= 1, "sft.steps", f"must be >= 1 when sft.enabled, got {c.sft.steps}")
    _need(c.sft.batch_size >= 1, "sft.batch_size", f"must be >= 1, got {c.sft.batch_size}")


def _validate_loss(c) -> None:
  _need(
    c.loss.name in losses.names(),
    "loss.name",
    f"unknown loss {c.loss.name!r}; known: {', '.join(losses.names())}",
  )
  for k in LOSS_OVERRIDES:
    v = c.loss[k]
    if isinstance(v, float):
      _need(v >= 0, f"loss.{k}", f"must be >= 0, got {v}")
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
  mode = c.lag.mode
  _need(mode in ("sync", "async"), "lag.mode", f"must be 'sync' or 'async', got {mode!r}")
  _need(c.lag.sync_interval >= 1, "lag.sync_interval", f"must be >= 1, got {c.lag.sync_interval}")
  _need(c.lag.sync_offset >= 0, "lag.sync_offset", f"must be >= 0, got {c.lag.sync_offset}")
  _need(c.lag.max_staleness >= 0, "lag.max_staleness", f"must be >= 0, got {c.lag.max_staleness}")


def _validate_replay(c) -> None:
  r = c.replay
  _need(
    r.capacity_batches >= 1, "replay.capacity_batches", f"must be >= 1, got {r.capacity_batches}"
  )
  _need(
    r.policy in replay.POLICIES,
    "replay.policy",
    f"must be one of {', '.join(replay.POLICIES)}, got {r.policy!r}",
  )
  _need(r.max_reuse >= 0, "replay.max_reuse", f"must be >= 0 (0 = unlimited), got {r.max_reuse}")
  _need(r.temperature > 0, "replay.temperature", f"must be > 0, got {r.temperature}")


def _validate_train(c) -> None:
  """The batch of G*K rows must split into minibatches, micro-batches and processes."""
  t = c.train
  rows = c.group_size * c.prompts_per_step
  _need(t.num_epochs >= 1, "train.num_epochs", f"must be >= 1, got {t.num_epochs}")
  _need(
    t.num_minibatches >= 1 and rows % t.num_minibatches == 0,
    "train.num_minibatches",
    f"must be >= 1 and divide the batch of {rows} rows, got {t.num_minibatches}",
  )
  mb_rows = rows // t.num_minibatches
  micro = c.optimizer.micro_batches
  if t.micro_batch_size:
    _need(
      micro == 1,
      "train.micro_batch_size",
      f"set either it or optimizer.micro_batches (= {micro}), not both",
    )
    _need(
      t.micro_batch_size >= 1 and mb_rows % t.micro_batch_size == 0,
      "train.micro_batch_size",
      f"must divide the minibatch of {mb_rows} rows, got {t.micro_batch_size}",
    )
  _need(
    micro >= 1 and mb_rows % micro == 0,
    "optimizer.micro_batches",
    f"must divide the minibatch of {mb_rows} rows, got {micro}",
  )
  _need(
    c.prompts_per_step % jax.process_count() == 0,
    "prompts_per_step",
    f"must divide by the number of processes ({jax.process_count()})",
  )


def _validate_sources(c) -> None:
  """Model, tokenizer, task and data files exist."""
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
