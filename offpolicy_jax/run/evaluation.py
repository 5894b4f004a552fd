"""Held-out evaluation: greedy accuracy, mean reward and length, pass@k.

One evaluator serves the loop (one set of parameters, `evaluate`) and the
study (parameters stacked over seeds, every sampler `jax.vmap`ped over the
seed axis): `evaluate_seeds` reads which from its `step.seeds.Seeds`, as
the step's halves do.

A response is correct when its reward exceeds 0.5 (exact match for the
synthetic tasks; a correct answer with or without the format bonus for GSM8K /
MATH). pass@k counts a prompt as solved when at least one of `k` samples at
the training temperature is correct (Chen et al., "Evaluating Large Language
Models Trained on Code", arXiv:2107.03374, with n = k). The samples of eval
batch `i` use the evaluation key itself for `i = 0` and `fold_in(key, i)` after.

Every process evaluates the same fixed prompts (the first `num_prompts` of the
eval split), so the numbers do not depend on the number of processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import models
from offpolicy_jax.learn import buffer_ope
from offpolicy_jax.rollout import episodes
from offpolicy_jax.rollout.protocol import EvalRows
from offpolicy_jax.step import scoring
from offpolicy_jax.step.run_state import RunState, StepFns
from offpolicy_jax.step.seeds import Seeds
from offpolicy_jax.store import metrics


def _memo(fns: StepFns, key, build: Callable) -> Any:
  """The eval prompt batches and eval samplers of `fns`, built once (kept in `fns.memo`)."""
  memo = fns.memo.setdefault("eval", {})
  if key not in memo:
    memo[key] = build()
  return memo[key]


def eval_prompts(
  fns: StepFns, num_prompts: int, batch_size: int = 0, split: str = "eval"
) -> list[dict[str, Any]]:
  """The first `num_prompts` prompts of `split` (held-out by default), in batches of
  `batch_size` (built once per `fns`).

  `batch_size` 0 means `prompts_per_step`. Rows past `num_prompts` (and filler
  rows of a final partial batch) have `valid=False`.
  """
  size = min(num_prompts, batch_size or fns.sizes.prompts_per_step)

  def build():
    it = fns.prompts(0, split, batch_size=size)
    batches, seen = [], 0
    for batch in it:
      keep = np.arange(size) < num_prompts - seen
      batches.append({**batch, "valid": batch["valid"] & keep})
      seen += size
      if seen >= num_prompts:
        break
    return batches

  return _memo(fns, ("prompts", num_prompts, size, split), build)


def _sampler(fns: StepFns, k: int, stacked: bool) -> Callable:
  """Greedy (k = 1) or k samples per prompt at the training temperature; vmapped over seeds.

  `(base, params, tokens, lengths, key)`: with adapters, vmapped over the
  seeds' adapters only (the base is shared).
  """

  def build():
    fn = fns.eval_sampler(k)
    with_base = lambda base, p, *args: fn(models.lora.join(base, p), *args)
    if stacked:
      return jax.jit(jax.vmap(with_base, in_axes=(None, 0, None, None, 0)))
    return with_base

  return _memo(fns, ("sampler", k, stacked), build)


def evaluate_seeds(
  fns: StepFns,
  params,
  keys: jax.Array,
  num_prompts: int,
  k: int = 0,
  *,
  seeds: Seeds,
  batch_size: int = 0,
  base=None,
  split: str = "eval",
) -> dict[str, np.ndarray]:
  """Evaluation of parameters stacked over S seeds (or of one run's, `Seeds.one`).

  Args:
    fns: the run's `run_state.StepFns` (`Components.fns`).
    params: parameters with a leading seed axis [S, ...] (one run's: none).
    keys: PRNG keys [S] (one run's: one key) of the pass@k samples.
    num_prompts: the first `num_prompts` prompts of the eval split, fewer if
      the split is smaller.
    k: samples per prompt for pass@k (< 2: skip pass@k).
    seeds: the runs `params` hold: `Seeds.many` (a seed axis) or `Seeds.one`.
    batch_size: prompts per eval batch (0: `prompts_per_step`).
    base: the frozen base (no seed axis) of adapter `params`, or None.
    split: the prompts: "eval" (held out), or "train" (the first of the
      training split: what the replay buffer's rows are drawn from).

  Returns:
    float64 arrays [S] (one run's: [1]): `accuracy`, `reward_mean`, `response_len`,
    `reward_failures`, with k >= 2 `pass@k`, `sample_accuracy` and
    `sample_reward` (the samples' mean reward), and for
    episodes (rows with turns) `turns` and `tool_calls_per_solved`.
  """
  keys_s = keys if seeds.stacked else jnp.asarray(keys)[None]
  s = len(seeds.ids)
  assert keys_s.shape[0] == s, (keys_s.shape, seeds)
  names: tuple[str, ...] = ("correct", "reward", "length", "fails", "pass", "sample")
  names += ("sample_reward",)
  names += ("turns", "calls", "solved")
  sums = {m: np.zeros(s) for m in names}
  n, episodic = 0.0, False
  for i, prompts in enumerate(eval_prompts(fns, num_prompts, batch_size, split)):
    valid = np.asarray(prompts["valid"], np.float64)
    keys_i = keys_s if i == 0 else jax.vmap(lambda key, i=i: jax.random.fold_in(key, i))(keys_s)
    n += valid.sum()
    rows_of = functools.partial(fns.eval_rows, fns, params, base, prompts, keys_i, split=split)
    for seed, r in enumerate(rows_of(1, seeds)):
      sums["correct"][seed] += ((r.rewards > 0.5) * valid).sum()
      sums["reward"][seed] += (r.rewards * valid).sum()
      sums["length"][seed] += (r.lengths * valid).sum()
      sums["fails"][seed] += r.failures
      if r.turns is not None and r.tool_calls is not None:
        episodic = True
        solved = (r.rewards > 0.5) * valid
        sums["turns"][seed] += (r.turns * valid).sum()
        sums["calls"][seed] += (r.tool_calls * solved).sum()
        sums["solved"][seed] += solved.sum()
    if k >= 2:
      for seed, r in enumerate(rows_of(k, seeds)):
        hit_gk = r.rewards.reshape(-1, k) > 0.5
        sums["pass"][seed] += (hit_gk.any(axis=1) * valid).sum()
        sums["sample"][seed] += (hit_gk.mean(axis=1) * valid).sum()
        sums["sample_reward"][seed] += (r.rewards.reshape(-1, k).mean(axis=1) * valid).sum()
  n = max(n, 1.0)
  ev = {
    "accuracy": sums["correct"] / n,
    "reward_mean": sums["reward"] / n,
    "response_len": sums["length"] / n,
    "reward_failures": sums["fails"],
  }
  if episodic:
    ev["turns"] = sums["turns"] / n
    ev["tool_calls_per_solved"] = sums["calls"] / np.maximum(sums["solved"], 1.0)
  if k >= 2:
    ev[f"pass@{k}"] = sums["pass"] / n
    ev["sample_accuracy"] = sums["sample"] / n
    ev["sample_reward"] = sums["sample_reward"] / n
  return ev


def sampled_rows(
  fns: StepFns, params, base, prompts, keys, k: int, seeds: Seeds, split: str = "eval"
) -> list[EvalRows]:
  """Greedy (k = 1) or k sampled responses per prompt, scored (device or sandboxed host reward).

  Args:
    fns: the run's step functions.
    params: the parameters, stacked over seeds when `seeds.stacked`.
    base: their frozen base (adapters), or None.
    prompts: one batch of eval prompts (`eval_prompts`).
    keys: PRNG keys [S] of the samples (unused by greedy rows; [1] for one run).
    k: rows per prompt (1: greedy).
    seeds: the runs `params` hold (`evaluate_seeds`).
    split: the split the prompts come from (the host reward reads its examples).

  Returns:
    one `EvalRows` per seed.
  """
  fn = _sampler(fns, k, seeds.stacked)
  tokens, lengths = prompts["prompt_tokens"], prompts["prompt_lengths"]
  out = fn(base, params, tokens, lengths, keys if seeds.stacked else keys[0])
  rows = []
  for seed in range(len(seeds.ids)):
    one = seeds.take(out, seed)
    r, stats = scoring.score(fns, prompts, one, split=split, group_size=k)
    rows.append(EvalRows(np.asarray(r), np.asarray(one.lengths), stats["reward_failures"]))
  return rows


def episode_rows(
  eps: episodes.Episodes,
  fns: StepFns,
  params,
  base,
  prompts,
  keys,
  k: int,
  seeds: Seeds,
  split: str = "eval",
) -> list[EvalRows]:
  """Greedy (k = 1) or k sampled episodes per prompt, one seed at a time (a host loop).

  `eps` is the run's multi-turn episodes; the rest as in `sampled_rows`.
  """
  rows = []
  for seed in range(len(seeds.ids)):
    one = seeds.take(params, seed)
    played = episodes.play(
      eps,
      models.lora.join(base, one),
      prompts,
      keys[seed],
      task=fns.task,
      split=split,
      group_size=k,
      greedy=k == 1,
    )
    lengths = np.asarray(played.out.mask).sum(axis=1)  # policy tokens
    failures = int(played.failures.sum())
    rows.append(EvalRows(played.rewards, lengths, failures, played.turns, played.tool_calls))
  return rows


def evaluate(
  fns: StepFns, params, key: jax.Array, num_prompts: int, k: int, seed: int = 0
) -> dict[str, float]:
  """The loop's evaluation of one run's parameters: `eval/` metrics (empty if no prompts).

  See `evaluate_seeds` for the arguments; `seed` is the run's (`Seeds.one`).
  """
  if not num_prompts:
    return {}
  ev = evaluate_seeds(fns, params, key, num_prompts, k, seeds=Seeds.one(seed))
  out = {f"eval/{m}": float(v[0]) for m, v in ev.items()}
  out["eval/reward_failures"] = int(out["eval/reward_failures"])
  return out


def ope_program(fns: StepFns, names: tuple[str, ...], seeds: Seeds) -> Callable:
  """`(state) -> ope/ metrics` of the run's replay buffer under its current parameters
  (`learn.buffer_ope.estimate`, jitted once per `fns`); over a study's seed axis when
  `seeds.stacked` (each metric [S])."""

  def build():
    estimate = functools.partial(
      buffer_ope.estimate, fns.model.graphdef, fns.learner.options, fns.sizes.prompts_per_step
    )

    def one(params, replay, version):
      return estimate(params, replay, version, names)

    def program(params, base, replay, version):  # arrays only: not the rollout's state
      if not seeds.stacked:
        return one(models.lora.join(base, params), replay, version)
      whole = jax.vmap(lambda p: models.lora.join(base, p))(params)
      return jax.vmap(one)(whole, replay, version)

    jitted = jax.jit(program)
    return lambda state: jitted(state.train.params, state.base, state.replay, state.train.version)

  return _memo(fns, ("ope", names, seeds.stacked), build)


def ope_from_buffer(
  fns: StepFns, state: RunState, names: tuple[str, ...], seed: int
) -> dict[str, Any]:
  """`learn.buffer_ope`'s `ope/` metrics of run `seed`'s replay buffer under its current
  parameters: nothing before the buffer holds a row, or without `names`."""
  if not names or not int(jax.device_get(state.replay.num_added)):
    return {}
  with jax.set_mesh(fns.model.mesh):
    out = ope_program(fns, names, Seeds.one(seed))(state)
  return {k: metrics.to_python(v) for k, v in jax.device_get(out).items()}
