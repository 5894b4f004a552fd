"""Held-out evaluation: greedy accuracy, mean reward and length, pass@k.

A response is correct when its reward exceeds 0.5 (exact match for the
synthetic tasks; a correct answer with or without the format bonus for GSM8K /
MATH). pass@k counts a prompt as solved when at least one of `k` samples at
the training temperature is correct (Chen et al., "Evaluating Large Language
Models Trained on Code", arXiv:2107.03374, with n = k).

Every process evaluates the same fixed prompts (the first `num_prompts` of the
eval split), so the numbers do not depend on the number of processes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from offpolicy_jax.run import rollouts


def eval_prompts(fns, num_prompts: int, batch_size: int = 0) -> list[dict[str, Any]]:
  """The first `num_prompts` eval prompts, in batches of `batch_size` (cached on `fns`).

  `batch_size` 0 means `prompts_per_step`. Rows past `num_prompts` (and filler
  rows of a final partial batch) have `valid=False`.
  """
  size = min(num_prompts, batch_size or fns.sizes.prompts_per_step)
  key = ("eval_prompts", num_prompts, size)
  if key not in fns.cache:
    it = rollouts.prompt_iterator(fns, 0, "eval", batch_size=size)
    batches, seen = [], 0
    for batch in it:
      keep = np.arange(size) < num_prompts - seen
      batches.append({**batch, "valid": batch["valid"] & keep})
      seen += size
      if seen >= num_prompts:
        break
    fns.cache[key] = batches
  return fns.cache[key]


def _pass_at_k(fns, params, prompts, key, k: int) -> tuple[float, float]:
  """(#prompts solved by one of k samples, sum of per-prompt sample accuracy), valid rows."""
  valid = np.asarray(prompts["valid"], np.float32)
  out = fns.pass_sampler(k)(params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)
  r, _ = rollouts.score(fns, prompts, out, split="eval", group_size=k)
  hit_gk = np.asarray(r).reshape(-1, k) > 0.5
  return float((hit_gk.any(axis=1) * valid).sum()), float((hit_gk.mean(axis=1) * valid).sum())


def evaluate(fns, params, key: jax.Array, num_prompts: int, k: int) -> dict[str, float]:
  """Greedy accuracy, mean reward and length, and pass@k, on fixed held-out prompts.

  Args:
    fns: the run's `rl_step.StepFns` (`Components.fns`).
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
  sums = dict.fromkeys(("n", "correct", "reward", "length", "pass", "sample_correct"), 0.0)
  fails = 0
  for i, prompts in enumerate(eval_prompts(fns, num_prompts)):
    valid = np.asarray(prompts["valid"], np.float32)
    out = fns.greedy(params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)
    r, stats = rollouts.score(fns, prompts, out, split="eval", group_size=1)
    r, lengths = np.asarray(r), np.asarray(out.lengths)
    sums["n"] += valid.sum()
    sums["correct"] += ((r > 0.5) * valid).sum()
    sums["reward"] += (r * valid).sum()
    sums["length"] += (lengths * valid).sum()
    fails += stats["reward_failures"]
    if k >= 2:
      solved, sample_correct = _pass_at_k(fns, params, prompts, jax.random.fold_in(key, i), k)
      sums["pass"] += solved
      sums["sample_correct"] += sample_correct
  n = max(sums["n"], 1.0)
  ev = {
    "eval/accuracy": float(sums["correct"] / n),
    "eval/reward_mean": float(sums["reward"] / n),
    "eval/response_len": float(sums["length"] / n),
    "eval/reward_failures": int(fails),
  }
  if k >= 2:
    ev[f"eval/pass@{k}"] = float(sums["pass"] / n)
    ev["eval/sample_accuracy"] = float(sums["sample_correct"] / n)
  return ev
