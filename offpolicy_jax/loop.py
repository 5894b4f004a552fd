"""The RL loop: `train_and_evaluate(config, workdir)`.

Per optimizer step `t = 1..T`, with the lag schedule of Yao et al., "Group-relative
REINFORCE is secretly an off-policy algorithm" (arXiv:2509.24203):

  prompts_t          = next(grain iterator)                       (host, static shapes)
  v(t)               = m * floor((t - n - 1) / m)  (0 if t <= n)   (lag.behavior_version)
  rollout            ~ pi_{theta_v(t)}(. | prompts_t)              (exact behaviour log-probs)
  r                  = reward(rollout)          (on device, or host with a timeout)
  A                  = advantages(r[G, K])
  buffer             = replay.add(buffer, batch);  batch = replay.sample(buffer)
  theta_t            = train_step(theta_{t-1}, batch)

In `lag.mode="sync"` the parameters of version v(t) come from the snapshot
store of `lag.py`, so the recorded staleness is exactly `t - 1 - v(t)`. Every
PRNG key derives from `(seed, t)`, and the checkpoint holds parameters,
optimizer state, the replay buffer, the parameter snapshots the schedule still
needs and the data iterator's state, so a run killed at any moment resumes from
its last checkpoint and reproduces the uninterrupted run's metrics exactly.

In `lag.mode="async"` a sampler thread (`lag.AsyncSampler`) runs ahead with the
latest published parameters and batches older than `lag.max_staleness` are
dropped; this mode is not bit-reproducible.

Runs whose configs differ only in run fields (seed, length, lag, warm start,
evaluation, logging) share one `Environment` of compiled functions, and runs
sharing a warm start compute it once (sweeps, notebooks, tests).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offpolicy_jax import (
  advantages,
  checkpointing,
  data,
  lag,
  losses,
  metrics,
  models,
  replay,
  rewards,
  sampling,
  sft,
  sharding,
  tasks,
  tokenizers,
  train_step,
)
from offpolicy_jax.types import TrainBatch

# Streams of per-step randomness: key(seed, t, stream).
_SAMPLE, _ADV, _REPLAY, _TRAIN, _EVAL, _INIT = range(6)

_LOSS_OVERRIDES = (
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


def step_key(seed: int, step: int, stream: int) -> jax.Array:
  """The PRNG key of `stream` at optimizer step `step`: a pure function of (seed, step)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)


def loss_overrides(config) -> dict[str, Any]:
  """The loss overrides set in `config.loss` (fields left at None are not overrides)."""
  return {k: config.loss[k] for k in _LOSS_OVERRIDES if config.loss[k] is not None}


def advantage_name(config) -> str:
  """`config.advantage.name`, or the loss's natural estimator when it is empty."""
  if config.advantage.name:
    return config.advantage.name
  name = config.loss.name
  if name in ("grpo", "dapo", "gspo", "gspo_token", "gmpo", "ppo", "dual_clip", "sapo"):
    return "grpo"
  return "red_drop" if name == "red_drop" else "group_mean"


def validate_config(config) -> None:
  """Checks a config before anything is built.

  Raises:
    ValueError: naming the offending field (unknown loss, eps < 0, group_size < 2,
      a missing model directory or data file, ...).
  """
  c = config

  def need(ok: bool, field: str, msg: str):
    if not ok:
      raise ValueError(f"config.{field}: {msg}")

  need(c.total_steps >= 1, "total_steps", f"must be >= 1, got {c.total_steps}")
  need(c.group_size >= 2, "group_size", f"must be >= 2 (group-relative), got {c.group_size}")
  need(c.prompts_per_step >= 1, "prompts_per_step", f"must be >= 1, got {c.prompts_per_step}")
  need(c.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {c.max_new_tokens}")
  need(c.max_prompt_len >= 1, "max_prompt_len", f"must be >= 1, got {c.max_prompt_len}")
  need(c.temperature > 0, "temperature", f"must be > 0 for RL sampling, got {c.temperature}")
  need(c.reward_timeout > 0, "reward_timeout", f"must be > 0, got {c.reward_timeout}")
  need(0 <= c.seed < 2**31, "seed", f"must be in [0, 2**31), got {c.seed}")
  need(
    c.loss.name in losses.names(),
    "loss.name",
    f"unknown loss {c.loss.name!r}; known: {', '.join(losses.names())}",
  )
  for k in _LOSS_OVERRIDES:
    v = c.loss[k]
    if isinstance(v, float):
      need(v >= 0, f"loss.{k}", f"must be >= 0, got {v}")
  try:
    losses.get_spec(c.loss.name, **loss_overrides(c))
  except (ValueError, TypeError) as e:
    raise ValueError(f"config.loss: {e}") from e
  need(
    advantage_name(c) in advantages.names(),
    "advantage.name",
    f"unknown advantage {c.advantage.name!r}; known: {', '.join(advantages.names())}",
  )
  need(
    c.lag.mode in ("sync", "async"), "lag.mode", f"must be 'sync' or 'async', got {c.lag.mode!r}"
  )
  need(c.lag.sync_interval >= 1, "lag.sync_interval", f"must be >= 1, got {c.lag.sync_interval}")
  need(c.lag.sync_offset >= 0, "lag.sync_offset", f"must be >= 0, got {c.lag.sync_offset}")
  need(c.lag.max_staleness >= 0, "lag.max_staleness", f"must be >= 0, got {c.lag.max_staleness}")
  need(
    c.replay.capacity_batches >= 1,
    "replay.capacity_batches",
    f"must be >= 1, got {c.replay.capacity_batches}",
  )
  rows = c.group_size * c.prompts_per_step
  need(
    c.optimizer.micro_batches >= 1 and rows % c.optimizer.micro_batches == 0,
    "optimizer.micro_batches",
    f"must divide the batch of {rows} rows",
  )
  need(c.optimizer.learning_rate >= 0, "optimizer.learning_rate", "must be >= 0")
  for k in ("checkpoint_every", "eval_every", "eval_prompts", "eval_samples", "keep_checkpoints"):
    need(c[k] >= 0, k, f"must be >= 0, got {c[k]}")
  need(c.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
  if os.path.sep in c.model or os.path.isdir(c.model):
    need(
      os.path.isfile(os.path.join(c.model, "config.json")),
      "model",
      f"{c.model!r} is not a Hugging Face directory with config.json",
    )
  else:
    need(
      c.model in models.preset_names(),
      "model",
      f"unknown preset {c.model!r} (and not a local directory); presets: "
      f"{', '.join(models.preset_names())}",
    )
  if c.tokenizer:
    need(
      os.path.isfile(os.path.join(c.tokenizer, "tokenizer.json")),
      "tokenizer",
      f"{c.tokenizer!r} has no tokenizer.json",
    )
  for k, v in c.task_kwargs.items():
    if isinstance(v, str) and (k.endswith("_path") or k.endswith("_file")):
      need(os.path.exists(v), f"task_kwargs.{k}", f"data file not found: {v}")
  known = tasks.task_names()
  need(
    c.task in known or c.task.startswith("reasoning_gym:"),
    "task",
    f"unknown task {c.task!r}; known: {', '.join(known)}",
  )
  if c.sft.enabled:
    need(c.sft.steps >= 1, "sft.steps", f"must be >= 1 when sft.enabled, got {c.sft.steps}")
    need(c.sft.batch_size >= 1, "sft.batch_size", f"must be >= 1, got {c.sft.batch_size}")


def _make_mesh(config):
  sizes = (config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
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


def _batch_stats(batch: TrainBatch, group_size: int) -> dict[str, jax.Array]:
  """Reward and length statistics of a batch's rows (filler rows, weight 0, excluded)."""
  w = (batch.weights > 0).astype(jnp.float32)
  n = jnp.maximum(w.sum(), 1.0)
  r = batch.rewards
  mean = (r * w).sum() / n
  r_gk = r.reshape(-1, group_size)
  return {
    "reward_mean": mean,
    "reward_std": jnp.sqrt(((r - mean) ** 2 * w).sum() / n),
    "accuracy": ((r > 0.5) * w).sum() / n,
    "response_len": (batch.mask.sum(1) * w).sum() / n,
    "response_tokens": (batch.mask.sum(1) * w).sum(),
    "groups_all_equal": (r_gk.max(1) == r_gk.min(1)).mean(),
    "adv_abs_mean": (jnp.abs(batch.advantages.reshape(r.shape[0], -1)).mean(1) * w).sum() / n,
  }


class Environment:
  """Everything a run builds from its config: mesh, task, tokenizer, model, jitted functions.

  Args:
    config: the experiment config (validated by `validate_config`).
  """

  def __init__(self, config):
    c = self.config = config
    self.mesh = _make_mesh(c)
    self.task = tasks.get_task(c.task, **c.task_kwargs.to_dict())
    if c.tokenizer:
      self.tokenizer = tokenizers.HFTokenizer.from_pretrained(c.tokenizer)
    elif os.path.isdir(c.model):
      self.tokenizer = tokenizers.HFTokenizer.from_pretrained(c.model)
    else:
      self.tokenizer = tokenizers.CharTokenizer()
    if os.path.isdir(c.model):
      self._model_fn = lambda seed: models.from_pretrained(
        c.model,
        jnp.float32,
        compute_dtype=jnp.dtype(c.model_dtype),
        mesh=self.mesh,
        rules=sharding.LOGICAL_AXIS_RULES,
      )
    else:
      mcfg = models.get_config(c.model, vocab_size=self.tokenizer.vocab_size, dtype=c.model_dtype)
      self._model_fn = lambda seed: models.Decoder(
        mcfg, rngs=nnx.Rngs(params=step_key(seed, 0, _INIT))
      )
    self.graphdef, _ = nnx.split(nnx.eval_shape(lambda: self._model_fn(0)))
    self.spec = losses.get_spec(c.loss.name, **loss_overrides(c))
    self.adv_name = advantage_name(c)
    opt = c.optimizer
    self.optimizer = train_step.make_optimizer(
      opt.learning_rate,
      warmup_steps=opt.warmup_steps,
      weight_decay=opt.weight_decay,
      max_grad_norm=opt.grad_clip or None,
      b1=opt.b1,
      b2=opt.b2,
    )
    self.train_step = train_step.make_train_step(
      self.graphdef,
      self.optimizer,
      self.spec,
      num_micro_batches=opt.micro_batches,
      temperature=c.temperature,
      mesh=self.mesh,
    )
    sample_kw = dict(
      max_new_tokens=c.max_new_tokens, top_p=c.top_p, top_k=c.top_k, eos_id=self.tokenizer.eos_id
    )
    self.sampler = sampling.make_sampler(
      self.graphdef, group_size=c.group_size, temperature=c.temperature, **sample_kw
    )
    self.greedy = sampling.make_sampler(self.graphdef, group_size=1, temperature=0.0, **sample_kw)
    self._pass_sampler = functools.lru_cache(maxsize=4)(
      lambda k: sampling.make_sampler(
        self.graphdef, group_size=k, temperature=c.temperature, **sample_kw
      )
    )
    self._make_batch = jax.jit(self._make_batch_impl)
    self.batch_stats = jax.jit(functools.partial(_batch_stats, group_size=c.group_size))
    self._device_reward = (
      None if self.task.device_reward is None else jax.jit(self.task.device_reward)
    )
    self._eval_batches: dict[int, dict] = {}

  # ----------------------------------------------------------------- params

  def init_params(self, seed: int):
    """Freshly initialised (from `seed`) or loaded parameters, placed on the mesh."""
    _, params = nnx.split(self._model_fn(seed))
    return sharding.shard_params(params, self.mesh)

  def init_train_state(self, params):
    return train_step.init_train_state(params, self.optimizer, mesh=self.mesh)

  @staticmethod
  def params_of(train_state):
    return train_state.params

  # ----------------------------------------------------------------- data

  def prompt_iterator(self, seed: int, split: str = "train", batch_size: int | None = None):
    """The grain iterator over tokenized prompts (shuffled by `seed` for training)."""
    c = self.config
    return data.prompt_iterator(
      self.task,
      self.tokenizer,
      batch_size=batch_size or c.prompts_per_step,
      max_prompt_len=c.max_prompt_len,
      seed=seed,
      split=split,
    )

  # ----------------------------------------------------------------- rollouts

  def sample(self, params, prompts: dict, key):
    return self.sampler(params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)

  def score(self, prompts: dict, rollout, *, split: str = "train", group_size: int | None = None):
    """Rewards [B] (device) and the number of failed host rewards."""
    k = group_size or self.config.group_size
    if self._device_reward is not None:
      answers = jnp.repeat(jnp.asarray(prompts["answer_tokens"]), k, axis=0)
      return self._device_reward(answers, rollout.tokens, rollout.mask), 0
    examples = data.examples(self.task, split, prompts["index"])
    examples = [ex for ex in examples for _ in range(k)]
    tokens, lengths = jax.device_get((rollout.tokens, rollout.lengths))
    texts = [self.tokenizer.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]
    result = rewards.score_batch(
      self.task.reward, examples, texts, timeout_s=self.config.reward_timeout
    )
    return jnp.asarray(result.scores), int(result.failed.sum())

  def _make_batch_impl(self, prompt_tokens, prompt_lengths, rollout, rewards, version, key):
    c = self.config
    g, k = c.prompts_per_step, c.group_size
    p = prompt_tokens.shape[1]
    # A non-finite reward makes the loss non-finite: the train step skips that
    # update and counts it (host rewards that fail are already scored 0).
    rewards = jnp.asarray(rewards, jnp.float32)
    adv = advantages.compute(self.adv_name, rewards.reshape(g, k), key=key).reshape(g * k)
    prompt_mask = (jnp.arange(p)[None, :] >= p - prompt_lengths[:, None]).astype(jnp.float32)
    batch = TrainBatch(
      prompt_tokens=jnp.repeat(prompt_tokens, k, axis=0),
      prompt_mask=jnp.repeat(prompt_mask, k, axis=0),
      tokens=rollout.tokens,
      mask=rollout.mask,
      behavior_logp=rollout.logprobs,
      advantages=adv,
      rewards=rewards,
      versions=jnp.full(rollout.tokens.shape, version, jnp.int32),
      weights=jnp.ones((g * k,), jnp.float32),
    )
    return batch

  def make_batch(self, prompts, rollout, rewards, version: int, key):
    return self._make_batch(
      jnp.asarray(prompts["prompt_tokens"]),
      jnp.asarray(prompts["prompt_lengths"]),
      rollout,
      rewards,
      jnp.int32(version),
      key,
    )

  def empty_batch(self) -> TrainBatch:
    c = self.config
    b, n, p = c.prompts_per_step * c.group_size, c.max_new_tokens, c.max_prompt_len
    f = lambda *s: jnp.zeros(s, jnp.float32)
    i = lambda *s: jnp.zeros(s, jnp.int32)
    return TrainBatch(i(b, p), f(b, p), i(b, n), f(b, n), f(b, n), f(b), f(b), i(b, n), f(b))

  # ----------------------------------------------------------------- eval

  def _eval_prompts(self, num_prompts: int) -> list[dict]:
    """The first `num_prompts` eval prompts, in batches of `prompts_per_step` (cached)."""
    if num_prompts not in self._eval_batches:
      size = min(num_prompts, self.config.prompts_per_step)
      it = self.prompt_iterator(0, "eval", batch_size=size)
      batches, seen = [], 0
      for batch in it:
        keep = np.arange(size) < num_prompts - seen  # rows past num_prompts do not count
        batches.append({**batch, "valid": batch["valid"] & keep})
        seen += size
        if seen >= num_prompts:
          break
      self._eval_batches[num_prompts] = batches
    return self._eval_batches[num_prompts]

  def evaluate(self, params, key, num_prompts: int, k: int) -> dict[str, float]:
    """Greedy accuracy, mean reward and length, and pass@k, on fixed held-out prompts.

    Accuracy counts a response as correct when its reward exceeds 0.5 (exact
    match for synthetic tasks; a correct answer with or without the format
    bonus for GSM8K / MATH). pass@k: at least one of k samples (at the
    training temperature) is correct.

    Args:
      params: parameters to evaluate.
      key: PRNG key for the pass@k samples.
      num_prompts: the first `num_prompts` prompts of the eval split (0: skip),
        fewer if the split is smaller.
      k: samples per prompt for pass@k (< 2: skip pass@k).

    Returns:
      dict of `eval/...` metrics (empty when `num_prompts` is 0).
    """
    if not num_prompts:
      return {}
    sums = {
      "n": 0.0,
      "correct": 0.0,
      "reward": 0.0,
      "length": 0.0,
      "fails": 0,
      "pass": 0.0,
      "sample_correct": 0.0,
    }
    for i, prompts in enumerate(self._eval_prompts(num_prompts)):
      valid = np.asarray(prompts["valid"], np.float32)
      args = (params, prompts["prompt_tokens"], prompts["prompt_lengths"])
      out = self.greedy(*args, key)
      r, fails = self.score(prompts, out, split="eval", group_size=1)
      r, lengths = np.asarray(r), np.asarray(out.lengths)
      sums["n"] += valid.sum()
      sums["correct"] += ((r > 0.5) * valid).sum()
      sums["reward"] += (r * valid).sum()
      sums["length"] += (lengths * valid).sum()
      sums["fails"] += fails
      if k >= 2:
        out = self._pass_sampler(k)(*args, jax.random.fold_in(key, i))
        r, _ = self.score(prompts, out, split="eval", group_size=k)
        hit_gk = np.asarray(r).reshape(-1, k) > 0.5
        sums["pass"] += (hit_gk.any(axis=1) * valid).sum()
        sums["sample_correct"] += (hit_gk.mean(axis=1) * valid).sum()
    n = max(sums["n"], 1.0)
    ev = {
      "eval/accuracy": float(sums["correct"] / n),
      "eval/reward_mean": float(sums["reward"] / n),
      "eval/response_len": float(sums["length"] / n),
      "eval/reward_failures": int(sums["fails"]),
    }
    if k >= 2:
      ev[f"eval/pass@{k}"] = float(sums["pass"] / n)
      ev["eval/sample_accuracy"] = float(sums["sample_correct"] / n)
    return ev

  # ----------------------------------------------------------------- warm start

  def warm_start(self, params, sft_config, seed: int, log_fn: Callable[[str], None] = print):
    """Supervised phase on the task's reference answers (see `sft.run`).

    Results are cached per (model, task, shapes, seed, settings), so the runs of
    a sweep or notebook that share a warm start (whatever their loss, optimizer
    or lag) compute it once.

    Args:
      params: initial parameters (those of `init_params(seed)`).
      sft_config: `config.sft` (steps, batch_size, learning_rate).
      seed: seed of the supervised prompt stream.
      log_fn: receives progress lines.

    Returns:
      The warm-started parameters.
    """
    c = self.config
    if self.task.answer is None:
      raise ValueError(f"config.sft.enabled: task {c.task!r} has no reference answers")
    fields = ("model", "model_dtype", "tokenizer", "task", "max_prompt_len", "max_new_tokens")
    cache_key = json.dumps(
      [
        {f: c[f] for f in fields},
        c.task_kwargs.to_dict(),
        c.mesh.to_dict(),
        seed,
        sft_config.to_dict(),
      ],
      sort_keys=True,
      default=str,
    )
    if cache_key in _SFT_CACHE:
      return jax.tree.map(jnp.copy, _SFT_CACHE[cache_key])
    # Its own prompt stream (seed + 1): the RL iterator still starts from the beginning.
    it = self.prompt_iterator(seed + 1, "train", batch_size=sft_config.batch_size)
    batches = sft.reference_batches(self.task, self.tokenizer, it, c.max_new_tokens)
    every = max(1, sft_config.steps // 5)
    params, _ = sft.run(
      self.graphdef,
      params,
      batches,
      steps=sft_config.steps,
      learning_rate=sft_config.learning_rate,
      log_fn=lambda i, loss: log_fn(f"sft step {i}: loss {loss:.4f}") if i % every == 0 else None,
    )
    if len(_SFT_CACHE) >= 2:
      _SFT_CACHE.pop(next(iter(_SFT_CACHE)))
    _SFT_CACHE[cache_key] = params
    return jax.tree.map(jnp.copy, params)


# Config fields a run reads directly; everything else shapes what Environment compiles.
_RUN_FIELDS = (
  "seed",
  "total_steps",
  "lag",
  "sft",
  "eval_every",
  "eval_prompts",
  "eval_samples",
  "checkpoint_every",
  "keep_checkpoints",
  "async_checkpoint",
  "tensorboard",
  "wandb_project",
  "progress",
)
_ENV_CACHE: dict[str, Environment] = {}
_SFT_CACHE: dict[str, Any] = {}
_ENV_CACHE_SIZE = 4


def get_environment(config) -> Environment:
  """An `Environment` for `config`, reused across runs that differ only in run fields.

  Runs of a sweep (or of a test suite) that differ only in seed, length, lag
  schedule, warm start or logging share one set of compiled functions.
  """
  d = config.to_dict()
  key = json.dumps(
    {k: v for k, v in d.items() if k not in _RUN_FIELDS}, sort_keys=True, default=str
  )
  if key not in _ENV_CACHE:
    if len(_ENV_CACHE) >= _ENV_CACHE_SIZE:
      _ENV_CACHE.pop(next(iter(_ENV_CACHE)))
    _ENV_CACHE[key] = Environment(config)
  return _ENV_CACHE[key]


class _Run:
  """Mutable state of a training run (the loop's bookkeeping, not a public type)."""

  def __init__(self, env: Environment, config):
    self.env = env
    self.config = config
    c = config
    self.groups = c.prompts_per_step
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
    """Parameters of version v(step); the trainer holds version step - 1."""
    v = lag.behavior_version(step, self.m, self.n)
    params = self.env.params_of(state["train"])
    if v == step - 1:  # on-policy for this step: the trainer's own parameters
      return params, v
    found_params, found = lag.snapshot_get(state["snapshots"], v)
    if not bool(found):
      raise RuntimeError(f"lag: snapshot of version {v} missing at step {step}")
    return found_params, v

  def produce(self, params, step: int, version: int, prompts: dict) -> tuple[TrainBatch, int]:
    """Samples, scores and packs the batch of `step` with `params` (of `version`)."""
    env, seed = self.env, self.config.seed
    rollout = env.sample(params, prompts, step_key(seed, step, _SAMPLE))
    rewards, failures = env.score(prompts, rollout)
    return env.make_batch(prompts, rollout, rewards, version, step_key(seed, step, _ADV)), failures

  def consume(self, state, step: int, batch: TrainBatch) -> tuple[dict, dict]:
    """Buffers `batch`, draws the step's training batch and takes one optimizer step."""
    env, c = self.env, self.config
    replay_state = replay.add(state["replay"], batch)
    replay_state, sampled, info = replay.sample(
      replay_state,
      step_key(c.seed, step, _REPLAY),
      batch_size=self.groups,
      policy="fifo",
      max_reuse=1,
      current_version=step - 1,
    )
    extra = {}
    if env.spec.needs_ref:
      extra["ref_params"] = state["ref"]
    if env.spec.needs_proximal:
      # Proximal anchor = the trainer's parameters before this update (a copy: the
      # state is donated).
      extra["proximal_params"] = jax.tree.map(jnp.copy, env.params_of(state["train"]))
    stats = env.batch_stats(sampled)
    train_state, train_metrics = env.train_step(
      state["train"], sampled, step_key(c.seed, step, _TRAIN), **extra
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
    batch, failures = self.produce(params, step, version, prompts)
    state, row = self.consume(state, step, batch)
    row["behavior_version"] = version
    row["reward_failures"] = failures
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

  Batches older than `lag.max_staleness` versions are dropped (and counted).
  Not bit-reproducible (thread timing decides versions), and on resume the
  batches that were queued when the checkpoint was taken are not replayed.
  """

  def __init__(self, run: _Run, params, version: int, data_iter: _LockedIterator):
    self._run = run
    self._data = data_iter
    self._produced = version
    self._failures = 0
    bound = run.config.lag.max_staleness or 2**30
    self.sampler = lag.AsyncSampler(
      self._sample, jax.tree.map(jnp.copy, params), version, max_staleness=bound
    )

  def _sample(self, params, version: int) -> TrainBatch:
    self._produced += 1
    batch, failures = self._run.produce(params, self._produced, version, next(self._data))
    self._failures += failures
    return batch

  def step(self, state, step: int) -> tuple[dict, dict]:
    start = time.perf_counter()
    batch = self.sampler.get(current_version=step - 1, timeout=600.0)
    versions, mask = jax.device_get((batch.versions, batch.mask))
    state, row = self._run.consume(state, step, batch)
    # Publish a copy: the train state is donated by the next step.
    self.sampler.publish(jax.tree.map(jnp.copy, self._run.env.params_of(state["train"])), step)
    row["behavior_version"] = int(versions[mask > 0].min()) if mask.any() else step - 1
    row["reward_failures"], self._failures = self._failures, 0
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


def train_and_evaluate(
  config,
  workdir: str,
  *,
  on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
  """Trains with off-policy RL per `config`, writing metrics and checkpoints to `workdir`.

  Resumes from the latest checkpoint in `workdir` if there is one.

  Args:
    config: an experiment ConfigDict (see configs/default.py for every field).
    workdir: run directory: metrics.jsonl, config.json, tb/, checkpoints/.
    on_step: optional callback `(step, row)` called right after each optimizer
      step's row is written, before any evaluation or checkpoint of that step.

  Returns:
    The metric rows written by this call (train and eval rows).
  """
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  env = get_environment(config)
  run = _Run(env, config)
  ckpt = checkpointing.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    max_to_keep=config.keep_checkpoints,
    async_save=config.async_checkpoint,
  )
  data_iter = _LockedIterator(env.prompt_iterator(config.seed, "train"))
  start_step = ckpt.latest_step() or 0
  start_accuracy = None
  if start_step:
    template = run.fresh_state(env.init_params(config.seed))
    state, meta = ckpt.restore(template, start_step)
    data_iter.set_state(meta["data_state"])
    start_accuracy = meta.get("start_accuracy")
    print(f"resumed from step {start_step} in {workdir}", flush=True)
  else:
    params = env.init_params(config.seed)
    if config.sft.enabled:
      params = env.warm_start(params, config.sft, config.seed)
    state = run.fresh_state(params)

  writer = metrics.MetricsWriter(
    workdir,
    resume_step=start_step or None,
    total_steps=config.total_steps,
    config=config,
    tensorboard=config.tensorboard,
    wandb_project=config.wandb_project or None,
    progress=config.progress,
  )
  rows: list[dict[str, Any]] = []

  def evaluate(step: int):
    ev = env.evaluate(
      env.params_of(state["train"]),
      step_key(config.seed, step, _EVAL),
      config.eval_prompts,
      config.eval_samples,
    )
    if ev:
      rows.append(writer.write(step, ev))
      writer.log_text(f"eval at step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in ev.items()))
    return ev

  producer = None
  try:
    if not start_step:
      start_accuracy = evaluate(0).get("eval/accuracy")
      if start_accuracy is not None:
        warm = "after the warm start" if config.sft.enabled else "(no warm start)"
        writer.log_text(f"starting accuracy {warm}: {start_accuracy:.3f}")
    if config.lag.mode == "async":
      producer = _AsyncProducer(run, env.params_of(state["train"]), start_step, data_iter)
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
        evaluate(step)
      if (config.checkpoint_every and step % config.checkpoint_every == 0) or last:
        ckpt.save(step, state, _meta(step, config, data_iter, start_accuracy))
  finally:
    if producer is not None:
      producer.close()
    ckpt.close()
    writer.close()
  return rows


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
  ev = env.evaluate(params, step_key(config.seed, step_done, _EVAL), config.eval_prompts, k)
  return {"step": step_done, **ev}
