"""Supervised warm start: teacher-forced cross-entropy on reference answers.

  L(theta) = - sum_{b,t} m_{b,t} log pi_theta(y_{b,t} | x_b, y_{b,<t}) / sum_{b,t} m_{b,t}

RL from a random tiny model on a synthetic task rarely sees a reward; a short
supervised phase on the task's reference answers (ending in EOS) gives a policy
with non-trivial success, as a pretrained instruct model would on a real task.
The step is one jitted pure function over `(params, opt_state)`, guarded like
the RL train step: a step whose loss, gradient norm, new parameters or new
optimizer state is non-finite keeps the old ones and counts as skipped. A warm
start that skipped every step, or ends with non-finite parameters, raises
instead of handing RL a broken policy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.typing import ArrayLike

from offpolicy_jax import models, types
from offpolicy_jax.learn import train_state
from offpolicy_jax.models import tokenizers
from offpolicy_jax.rewards import tasks, text_episodes
from offpolicy_jax.rollout import data
from offpolicy_jax.step.run_state import StepFns


class SFTBatch(NamedTuple):
  """A supervised batch.

  Attributes:
    prompt_tokens: int32 [B, P] left-padded prompts.
    prompt_mask: float32 [B, P] 1 on real prompt tokens.
    tokens: int32 [B, N] target response tokens (reference answer + EOS, right-padded).
    mask: float32 [B, N] 1 on target tokens.
  """

  # Host numpy arrays when built, device arrays inside the jitted step.
  prompt_tokens: ArrayLike
  prompt_mask: ArrayLike
  tokens: ArrayLike
  mask: ArrayLike


def encode_targets(tokenizer: Any, texts: Sequence[str], max_len: int) -> tuple[np.ndarray, ...]:
  """Encodes reference answers followed by EOS, right-padded/truncated to `max_len`.

  Args:
    tokenizer: has encode(str) -> list[int], pad_id, eos_id.
    texts: B reference answers.
    max_len: N, target length.

  Returns:
    (tokens int32 [B, N], mask float32 [B, N]).
  """
  tokens = np.full((len(texts), max_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(texts), max_len), np.float32)
  for i, text in enumerate(texts):
    ids = list(tokenizer.encode(text))
    if tokenizer.eos_id is not None:
      ids.append(tokenizer.eos_id)
    ids = ids[:max_len]
    tokens[i, : len(ids)] = ids
    mask[i, : len(ids)] = 1.0
  return tokens, mask


def encode_episodes(
  tokenizer: Any,
  episodes: Sequence[Sequence[tuple[str, str]]],
  max_len: int,
  policy_only: bool = False,
) -> tuple[np.ndarray, ...]:
  """Encodes demonstrated episodes as one trajectory each.

  A multi-turn task's demonstration is `[(role, text), ...]` with role
  "policy" or "env"; the trajectory is the turns encoded one by one, the
  token boundaries the multi-turn sampler produces
  (`text_episodes.encode_turns`). The warm start's targets are the whole
  transcript by default: on `calculator`, a warm start that also predicts the
  observation tokens copies the tool's value into its answer (greedy success
  0.75 after 220 steps), one whose loss covers the policy's tokens only
  (`policy_only`) does not (0.00 after 220 steps; docs/results/multiturn.md). The RL
  steps never train on observation tokens.

  Returns:
    (tokens int32 [B, N], mask float32 [B, N]), right-padded / truncated to `max_len`.
  """
  tokens = np.full((len(episodes), max_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(episodes), max_len), np.float32)
  for i, turns in enumerate(episodes):
    ids, on = text_episodes.encode_turns(tokenizer.encode, turns)
    ids, on = ids[:max_len], on[:max_len]
    tokens[i, : len(ids)] = ids
    mask[i, : len(ids)] = on if policy_only else 1.0
  return tokens, mask


def shows_distractor(index: int, fraction: float) -> bool:
  """Whether training example `index` shows its distractor (a fixed draw per example)."""
  return fraction > 0 and np.random.default_rng([0x5F7, int(index)]).random() < fraction


def reference_batches(
  task: tasks.Task,
  tokenizer: tokenizers.Tokenizer,
  prompts: Iterator[dict],
  max_len: int,
  distractor: float = 0.0,
) -> Iterator[SFTBatch]:
  """Supervised batches: each prompt of a `data.prompt_iterator` with its reference answer.

  Args:
    task: a `tasks.Task` with `answer(example) -> str`; the batches' `index`
      field points into `task.train_source`.
    tokenizer: the tokenizer the prompts were encoded with.
    prompts: a training prompt iterator (dicts with prompt_tokens [G, P],
      prompt_lengths [G], index [G]).
    max_len: N, target length (reference answer + EOS, right-padded).
    distractor: the fraction of examples (a fixed draw per example index,
      `shows_distractor`) whose target is `task.distractor(example)` instead:
      imperfect demonstrations, a mix of right and wrong behaviour.

  Yields:
    SFTBatch of G rows.
  """
  answer, wrong = task.answer, task.distractor
  if answer is None:
    raise ValueError(f"task {task.name!r} has no reference answers for supervised warm start")
  if distractor and wrong is None:
    raise ValueError(f"config.sft.distractor: task {task.name!r} has no distractor answers")
  for batch in prompts:
    examples = data.examples(task, "train", batch["index"])
    if task.demonstration is not None:
      demos = [task.demonstration(ex) for ex in examples]
      tokens, mask = encode_episodes(tokenizer, demos, max_len)
    else:
      texts = [
        wrong(ex) if wrong is not None and shows_distractor(i, distractor) else answer(ex)
        for i, ex in zip(np.asarray(batch["index"]).tolist(), examples, strict=True)
      ]
      tokens, mask = encode_targets(tokenizer, texts, max_len)
    p = batch["prompt_tokens"].shape[1]
    prompt_mask = np.asarray(types.prompt_mask(batch["prompt_lengths"], p), np.float32)
    yield SFTBatch(batch["prompt_tokens"], prompt_mask, tokens, mask)


class SFTResult(NamedTuple):
  """The outcome of `run`.

  Attributes:
    params: the trained parameters (a skipped step leaves them as they were).
    losses: the loss of every step, skipped ones included.
    skipped_steps: 1-based indices of the steps skipped for non-finite values.
  """

  params: Any
  losses: list[float]
  skipped_steps: list[int]


def make_sft_step(graphdef: Any, optimizer: optax.GradientTransformation) -> Callable:
  """Builds the jitted step `(params, opt_state, batch) -> (params, opt_state, loss, skipped)`.

  When the loss, the gradient norm, the new parameters or the new optimizer
  state is non-finite, the step keeps `params` and `opt_state` and `skipped`
  (int32 []) is 1; otherwise it is 0.
  """

  def loss_fn(params, frozen, batch: SFTBatch):
    model = nnx.merge(graphdef, models.lora.join(frozen, params))
    logp, _ = models.sequence_logprobs(
      model, batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask
    )
    return -jnp.sum(logp * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)

  @jax.jit
  def step(params, opt_state, batch: SFTBatch, frozen=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, frozen, batch)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    ok = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    ok &= train_state.all_finite((new_params, new_opt_state))
    params, opt_state = train_state.keep_if(ok, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss, (~ok).astype(jnp.int32)

  return step


@functools.lru_cache(maxsize=2)
def _optimizer_and_step(graphdef: Any, steps: int, learning_rate: float) -> tuple[Any, Callable]:
  """AdamW (cosine decay to 10%, global-norm clip 1) and its jitted step, built once per setting.

  The runs of a sweep, a study or a test session that warm-start the same
  model with the same settings (other seeds) share one compiled step instead of
  compiling it again each (~5 s for the tiny model on CPU); two settings kept.
  """
  schedule = optax.cosine_decay_schedule(learning_rate, max(steps, 1), alpha=0.1)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
  return optimizer, make_sft_step(graphdef, optimizer)


def run(
  graphdef: Any,
  params: Any,
  batches: Iterator[SFTBatch],
  *,
  steps: int,
  learning_rate: float,
  log_fn: Callable[[int, float], None] | None = None,
  frozen: Any = None,
) -> SFTResult:
  """Runs `steps` supervised AdamW steps (global-norm clip 1) from `params`.

  Steps with non-finite values are skipped (see `make_sft_step`); `run` does
  not raise for them: `warm_start` decides what a run can start from.

  Args:
    graphdef: the model's graph definition (`nnx.split(model)[0]`).
    params: the model's parameter state.
    batches: yields SFTBatch (static shapes, so the step compiles once).
    steps: number of steps.
    learning_rate: AdamW learning rate (cosine decay to 10%).
    log_fn: optional callback `(step, loss)`.
    frozen: the rest of the model's state, held fixed (the fresh adapters of
      a LoRA run, whose base `params` is then what the warm start trains).

  Returns:
    An `SFTResult`: trained params, per-step losses, skipped steps.
  """
  optimizer, step_fn = _optimizer_and_step(graphdef, steps, learning_rate)
  opt_state = optimizer.init(params)
  losses: list[float] = []
  skipped: list[int] = []
  for i in range(steps):
    params, opt_state, loss, skip = step_fn(params, opt_state, next(batches), frozen)
    loss, skip = jax.device_get((loss, skip))
    losses.append(float(loss))
    if skip:
      skipped.append(i + 1)
    if log_fn is not None:
      log_fn(i + 1, losses[-1])
  return SFTResult(params, losses, skipped)


def _check_warm_start(result: SFTResult, lr: float, log_fn: Callable) -> None:
  """Raises unless `result` is a warm start RL can start from; logs skipped steps."""
  steps, skipped = len(result.losses), result.skipped_steps
  if not bool(train_state.all_finite(result.params)):
    raise FloatingPointError(
      f"config.sft: the parameters are non-finite after supervised step {steps} "
      f"({len(skipped)} of {steps} steps skipped; config.sft.learning_rate={lr}); "
      "refusing to start RL from a broken warm start"
    )
  if steps and len(skipped) == steps:
    raise FloatingPointError(
      f"config.sft: every supervised step (1 to {steps}) was skipped: the loss, gradient, "
      f"update or optimizer state was non-finite (last loss {result.losses[-1]}, "
      f"config.sft.learning_rate={lr}); refusing to start RL from a failed warm start"
    )
  if skipped:
    shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
    log_fn(f"sft: skipped {len(skipped)} of {steps} steps with non-finite values (step {shown})")


_WARM_START_CACHE: dict[str, Any] = {}


def warm_start(
  fns: StepFns,
  params: Any,
  *,
  steps: int,
  batch_size: int,
  learning_rate: float,
  seed: int,
  log_fn: Callable = print,
  frozen: Any = None,
  distractor: float = 0.0,
) -> Any:
  """Supervised phase of a run on its task's reference answers (see `run`).

  Results are cached per (model, task, shapes, mesh: `fns.model.key`), seed
  and settings, so the runs of a sweep or notebook that share a warm start
  (whatever their loss, optimizer or lag) compute it once.

  Args:
    fns: the run's `run_state.StepFns` (task, tokenizer, graph, sizes).
    params: initial parameters (those of `fns.model.init_params(seed)`).
    steps, batch_size, learning_rate: the `config.sft` settings.
    seed: seed of the supervised prompt stream.
    log_fn: receives progress lines.
    frozen: state held fixed (`run`): with adapters, `params` is the base
      and `frozen` the fresh adapters (B = 0, so they do not change the model).
    distractor: `config.sft.distractor` (`reference_batches`).

  Returns:
    The warm-started parameters (a copy the caller may donate).

  Raises:
    FloatingPointError: naming `config.sft` when every supervised step was
      skipped for non-finite values or the final parameters are non-finite.
  """
  if fns.task.answer is None:
    raise ValueError("config.sft.enabled: the task has no reference answers")
  cache_key = json.dumps([fns.model.key, seed, steps, batch_size, learning_rate, distractor])
  if cache_key not in _WARM_START_CACHE:
    # Its own prompt stream (seed + 1): the RL iterator still starts from the beginning.
    it = fns.prompts(seed + 1, "train", batch_size=batch_size)
    batches = reference_batches(
      fns.task, fns.model.tokenizer, it, fns.sizes.max_new_tokens, distractor
    )
    every = max(1, steps // 5)
    result = run(
      fns.model.graphdef,
      params,
      batches,
      steps=steps,
      learning_rate=learning_rate,
      log_fn=lambda i, loss: log_fn(f"sft step {i}: loss {loss:.4f}") if i % every == 0 else None,
      frozen=frozen,
    )
    _check_warm_start(result, learning_rate, log_fn)
    if len(_WARM_START_CACHE) >= 2:
      _WARM_START_CACHE.pop(next(iter(_WARM_START_CACHE)))
    _WARM_START_CACHE[cache_key] = result.params
  return jax.tree.map(jnp.copy, _WARM_START_CACHE[cache_key])
