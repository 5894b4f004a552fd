"""What a run builds from its config: the `Environment` of mesh, model and compiled functions.

An `Environment` holds the mesh, task, tokenizer, model constructor, loss spec,
optimizer and the jitted functions of the hot path (sampler, train step, batch
packing). It holds no run state: runs whose configs differ only in run fields
(seed, length, lag, warm start, evaluation, logging) share one through
`get_environment`, so sweeps, notebooks and tests compile once.

Multi-host data path: every process reads the same global prompt stream and
keeps its own block of rows of each batch (`prompts_per_step / process_count`
prompts, process `p` taking rows `[p * G_local, (p + 1) * G_local)`), and
`global_prompts` assembles the per-process blocks into global arrays with
`jax.make_array_from_process_local_data`, rows split over the mesh's
`(data, fsdp)` axes. So the global batch, and with it every number of the run,
does not depend on the number of processes, and the iterator state is the same
on every process. With one process the global batch is the local one.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from offpolicy_jax import (
  advantages,
  data,
  evaluation,
  losses,
  models,
  rewards,
  sampling,
  sft,
  sharding,
  tasks,
  tokenizers,
  train_step,
  validation,
)
from offpolicy_jax.types import TrainBatch

# Host reward statistics of a batch (every metrics row carries them; zero for device rewards).
REWARD_STATS = ("reward_failures", "reward_timeouts", "reward_worker_restarts", "reward_time_s")
_NO_REWARD_STATS = {
  "reward_failures": 0,
  "reward_timeouts": 0,
  "reward_worker_restarts": 0,
  "reward_time_s": 0.0,
}
# Streams of per-step randomness: key(seed, t, stream).
SAMPLE, ADV, REPLAY, TRAIN, EVAL, INIT = range(6)
# Prompt fields that become global device arrays (the rest stay host-side).
_DEVICE_FIELDS = ("prompt_tokens", "prompt_lengths", "answer_tokens")


def step_key(seed: int, step: int, stream: int) -> jax.Array:
  """The PRNG key of `stream` at optimizer step `step`: a pure function of (seed, step)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)


def make_mesh(config) -> jax.sharding.Mesh:
  """The `(data, fsdp, tensor)` mesh of `config.mesh` (-1 fills the remaining devices)."""
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


def assemble_global(mesh, local: dict[str, Any]) -> dict[str, Any]:
  """Per-process prompt batches -> global arrays with rows over `(data, fsdp)`.

  Device fields (`prompt_tokens`, `prompt_lengths`, `answer_tokens`) become
  global `jax.Array`s through `jax.make_array_from_process_local_data`; the
  host fields (`index`, `valid`) are gathered from every process in process
  order (the row order of the global arrays). With one process every value
  equals the local one. A global batch that does not split over
  `data * fsdp` devices is replicated (one process only).

  Args:
    mesh: the run's mesh.
    local: this process's batch, dict of numpy arrays with G_local rows.

  Returns:
    dict with the same keys and G_local * process_count rows.
  """
  procs = jax.process_count()
  rows = local["prompt_tokens"].shape[0] * procs
  split = rows % sharding.axis_size(mesh, sharding.BATCH_AXES) == 0
  if not split and procs > 1:
    raise ValueError(
      f"config.prompts_per_step: {rows} prompts do not split over data*fsdp = "
      f"{sharding.axis_size(mesh, sharding.BATCH_AXES)} devices across {procs} processes"
    )
  out = {}
  for k, v in local.items():
    if k in _DEVICE_FIELDS:
      spec = P(sharding.BATCH_AXES, *([None] * (v.ndim - 1))) if split else P()
      out[k] = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v)
    elif procs > 1 and isinstance(v, np.ndarray):
      out[k] = np.asarray(multihost_utils.process_allgather(v, tiled=True))
    else:
      out[k] = v
  return out


def batch_stats(batch: TrainBatch, group_size: int) -> dict[str, jax.Array]:
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


def _host_tokens(rollout) -> tuple[np.ndarray, np.ndarray]:
  """Rollout tokens and lengths on the host (gathered across processes)."""
  if jax.process_count() > 1:
    gather = functools.partial(multihost_utils.process_allgather, tiled=True)
    return np.asarray(gather(rollout.tokens)), np.asarray(gather(rollout.lengths))
  return jax.device_get((rollout.tokens, rollout.lengths))


class _ProcessRows:
  """This process's block of rows of every batch of a global prompt iterator.

  Process `index` of `count` keeps rows `[index * n, (index + 1) * n)`, `n =
  G / count`; the state is the global iterator's, the same on every process.
  """

  def __init__(self, it, index: int, count: int):
    self._it, self._index, self._count = it, index, count

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, Any]:
    batch = next(self._it)
    n = len(batch["index"]) // self._count
    lo = self._index * n
    return {k: v[lo : lo + n] for k, v in batch.items()}

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state) -> None:
    self._it.set_state(state)


class Environment:
  """Everything a run builds from its config: mesh, task, tokenizer, model, jitted functions.

  Args:
    config: the experiment config (validated by `validation.validate_config`).
  """

  def __init__(self, config):
    c = self.config = config
    self.mesh = make_mesh(c)
    self.task = tasks.get_task(c.task, **c.task_kwargs.to_dict())
    self.tokenizer = self._make_tokenizer()
    self._model_fn = self._model_constructor()
    self.graphdef, _ = nnx.split(nnx.eval_shape(lambda: self._model_fn(0)))
    self.spec = losses.get_spec(c.loss.name, **validation.loss_overrides(c))
    self.adv_name = validation.advantage_name(c)
    self.updates_per_batch = validation.updates_per_batch(c)
    self._build_train_step()
    sample_kw = dict(
      max_new_tokens=c.max_new_tokens, top_p=c.top_p, top_k=c.top_k, eos_id=self.tokenizer.eos_id
    )
    self.sampler = sampling.make_sampler(
      self.graphdef, group_size=c.group_size, temperature=c.temperature, **sample_kw
    )
    self.greedy = sampling.make_sampler(self.graphdef, group_size=1, temperature=0.0, **sample_kw)
    self.pass_sampler = functools.lru_cache(maxsize=4)(
      lambda k: sampling.make_sampler(
        self.graphdef, group_size=k, temperature=c.temperature, **sample_kw
      )
    )
    self._make_batch = jax.jit(self._make_batch_impl)
    self.batch_stats = jax.jit(functools.partial(batch_stats, group_size=c.group_size))
    self._device_reward = (
      None if self.task.device_reward is None else jax.jit(self.task.device_reward)
    )
    self.verifier_pool = None
    if self._device_reward is None:
      self.verifier_pool = rewards.get_pool(
        c.reward_workers or None, c.reward_memory_mb, c.reward_sandbox
      )
      self.verifier_pool.check(self.task.reward, c.task)  # fails here if it cannot reach a worker
    self.eval_batches: dict[int, list[dict]] = {}

  def _make_tokenizer(self):
    c = self.config
    if c.tokenizer:
      return tokenizers.HFTokenizer.from_pretrained(c.tokenizer)
    if os.path.isdir(c.model):
      return tokenizers.HFTokenizer.from_pretrained(c.model)
    return tokenizers.CharTokenizer()

  def _model_constructor(self):
    """`seed -> model`: an HF checkpoint loaded onto the mesh, or a fresh preset."""
    c = self.config
    if os.path.isdir(c.model):
      return lambda seed: models.from_pretrained(
        c.model,
        jnp.float32,
        compute_dtype=jnp.dtype(c.model_dtype),
        mesh=self.mesh,
        rules=sharding.LOGICAL_AXIS_RULES,
      )
    mcfg = models.get_config(c.model, vocab_size=self.tokenizer.vocab_size, dtype=c.model_dtype)
    return lambda seed: models.Decoder(mcfg, rngs=nnx.Rngs(params=step_key(seed, 0, INIT)))

  def _build_train_step(self):
    c, opt = self.config, self.config.optimizer
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
      micro_batch_size=c.train.micro_batch_size or None,
      num_minibatches=c.train.num_minibatches,
      num_epochs=c.train.num_epochs,
      temperature=c.temperature,
      mesh=self.mesh,
    )

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
    """The grain iterator over tokenized prompts (shuffled by `seed` for training).

    Training batches are this process's block of rows of the global batch
    (`prompts_per_step / process_count` prompts, see `global_prompts`); an
    explicit `batch_size` (evaluation, warm start) reads the whole split on
    every process.
    """
    c = self.config
    rows = batch_size is None and jax.process_count() > 1
    it = data.prompt_iterator(
      self.task,
      self.tokenizer,
      batch_size=c.prompts_per_step if batch_size is None else batch_size,
      max_prompt_len=c.max_prompt_len,
      seed=seed,
      split=split,
      truncate=c.data.truncate_prompts,
    )
    return _ProcessRows(it, jax.process_index(), jax.process_count()) if rows else it

  def global_prompts(self, local: dict[str, Any]) -> dict[str, Any]:
    """This process's prompt batch -> the global batch on the mesh (`assemble_global`)."""
    return assemble_global(self.mesh, local)

  # ----------------------------------------------------------------- rollouts

  def sample(self, params, prompts: dict, key):
    return self.sampler(params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)

  def score(self, prompts: dict, rollout, *, split: str = "train", group_size: int | None = None):
    """Rewards [B] (device) and the host reward statistics (`REWARD_STATS` keys)."""
    c = self.config
    k = group_size or c.group_size
    if self._device_reward is not None:
      answers = jnp.repeat(jnp.asarray(prompts["answer_tokens"]), k, axis=0)
      return self._device_reward(answers, rollout.tokens, rollout.mask), dict(_NO_REWARD_STATS)
    examples = data.examples(self.task, split, prompts["index"])
    examples = [ex for ex in examples for _ in range(k)]
    tokens, lengths = _host_tokens(rollout)
    texts = [self.tokenizer.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]
    res = rewards.score_batch(
      self.task.reward,
      examples,
      texts,
      timeout_s=c.reward_timeout,
      pool=self.verifier_pool,
      batch_timeout_s=c.reward_batch_timeout or None,
    )
    stats = {
      "reward_failures": int(res.failed.sum()),
      "reward_timeouts": int(res.timed_out.sum()) if res.timed_out is not None else 0,
      "reward_worker_restarts": res.restarts,
      "reward_time_s": res.seconds,
    }
    return jnp.asarray(res.scores), stats

  def _make_batch_impl(self, prompt_tokens, prompt_lengths, rollout, rewards, version, key):
    c = self.config
    g, k = c.prompts_per_step, c.group_size
    p = prompt_tokens.shape[1]
    # A non-finite reward makes the loss non-finite: the train step skips that
    # update and counts it (host rewards that fail are already scored 0).
    rewards = jnp.asarray(rewards, jnp.float32)
    adv = advantages.compute(self.adv_name, rewards.reshape(g, k), key=key).reshape(g * k)
    prompt_mask = (jnp.arange(p)[None, :] >= p - prompt_lengths[:, None]).astype(jnp.float32)
    return TrainBatch(
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

  def make_batch(self, prompts, rollout, rewards, version: int, key) -> TrainBatch:
    """Packs a scored rollout; `version` is the behaviour parameters' optimizer-step count."""
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

  # ----------------------------------------------------------------- eval, warm start

  def evaluate(self, params, key, num_prompts: int, k: int) -> dict[str, float]:
    """Greedy accuracy and pass@k on held-out prompts (`evaluation.evaluate`)."""
    return evaluation.evaluate(self, params, key, num_prompts, k)

  def warm_start(self, params, sft_config, seed: int, log_fn=print):
    """Supervised phase on the task's reference answers (`sft.warm_start`)."""
    return sft.warm_start(self, params, sft_config, seed, log_fn)


# Config fields a run reads directly; everything else shapes what Environment compiles.
RUN_FIELDS = (
  "seed",
  "total_steps",
  "lag",
  "replay",
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
_ENV_CACHE_SIZE = 4


def get_environment(config) -> Environment:
  """An `Environment` for `config`, reused across runs that differ only in run fields.

  Runs of a sweep (or of a test suite) that differ only in seed, length, lag
  schedule, warm start or logging share one set of compiled functions.
  """
  d = config.to_dict()
  key = json.dumps({k: v for k, v in d.items() if k not in RUN_FIELDS}, sort_keys=True, default=str)
  if key not in _ENV_CACHE:
    if len(_ENV_CACHE) >= _ENV_CACHE_SIZE:
      _ENV_CACHE.pop(next(iter(_ENV_CACHE)))
    _ENV_CACHE[key] = Environment(config)
  return _ENV_CACHE[key]
