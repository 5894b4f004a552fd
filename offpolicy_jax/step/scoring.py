"""Scoring a step's rows: on device, or on the host in the sandboxed verifier workers.

`score` is the one scorer of a step's rows (`rewards_of` takes a rollout's
own rewards when it earned them, e.g. an environment's). Device rewards are
traceable and run inside the jitted step; host rewards decode each process's
own rows (`prompt_rows.local_rows`), score them in its verifier workers, and
build one global array with rows over `(data, fsdp)` like the prompts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rollout import data, prompt_rows
from offpolicy_jax.rollout.protocol import Finished
from offpolicy_jax.step.run_state import StepFns

# Host reward statistics of a batch (every metrics row carries them; zero for device rewards).
REWARD_STATS = ("reward_failures", "reward_timeouts", "reward_worker_restarts", "reward_time_s")


def no_reward_stats() -> dict[str, Any]:
  return dict.fromkeys(REWARD_STATS[:3], 0) | {"reward_time_s": 0.0}


def _gather_stats(stats: dict[str, Any]) -> dict[str, Any]:
  """Reward statistics summed over processes (time: the slowest), with each process's time."""
  local = np.array([stats[k] for k in REWARD_STATS], np.float64)
  every = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(REWARD_STATS))
  out: dict[str, Any] = {k: int(every[:, i].sum()) for i, k in enumerate(REWARD_STATS[:3])}
  out["reward_time_s"] = float(every[:, 3].max())
  out |= {f"reward_time_s/process{p}": float(t) for p, t in enumerate(every[:, 3])}
  return out


def score_on_host(fns: StepFns, prompts: dict, rollout, *, split: str, group_size: int):
  """Host rewards [B] (a device array) and their statistics (`REWARD_STATS` keys).

  Each process scores the rows of its own prompts in its verifier workers; the
  scores become one global array with rows over `(data, fsdp)` like the
  prompts, and the statistics are summed over processes (`reward_time_s` is
  the slowest process's, `reward_time_s/process<i>` each one's).
  """
  reward, procs = fns.reward, jax.process_count()
  tokens, lo = (
    prompt_rows.local_rows(rollout.tokens) if procs > 1 else (np.asarray(rollout.tokens), 0)
  )
  lengths = prompt_rows.local_rows(rollout.lengths)[0] if procs > 1 else np.asarray(rollout.lengths)
  index = np.asarray(prompts["index"])[lo // group_size : (lo + len(tokens)) // group_size]
  examples = data.examples(fns.task, split, index.tolist())
  examples = [ex for ex in examples for _ in range(group_size)]
  texts = [fns.model.tokenizer.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]
  assert reward.host is not None, "score_on_host needs a host reward"
  res = rewards.score_batch(
    reward.host,
    examples,
    texts,
    timeout_s=reward.timeout_s,
    pool=reward.pool,
    batch_timeout_s=reward.batch_timeout_s,
  )
  stats = {
    "reward_failures": int(res.failed.sum()),
    "reward_timeouts": int(res.timed_out.sum()) if res.timed_out is not None else 0,
    "reward_worker_restarts": res.restarts,
    "reward_time_s": res.seconds,
  }
  if procs == 1:
    return jnp.asarray(res.scores), stats
  scores, rows = np.asarray(res.scores, np.float32), rollout.tokens.sharding
  if isinstance(rows, NamedSharding) and rows.spec and rows.spec[0] is not None:
    out = jax.make_array_from_process_local_data(
      NamedSharding(rows.mesh, P(rows.spec[0])), scores, (rollout.tokens.shape[0],)
    )
  else:  # rows not split over processes: every process passes all scores
    out = np.asarray(multihost_utils.process_allgather(scores, tiled=True))
  return out, _gather_stats(stats)


def score_on_device(
  fns: StepFns, prompts: dict, rollout, group_size: int | None = None
) -> jax.Array:
  """Rewards [B] of a device-reward task (traceable): each response against its prompt's answer."""
  k = group_size or fns.sizes.group_size
  answers = jnp.repeat(jnp.asarray(prompts["answer_tokens"]), k, axis=0)
  assert fns.reward.device is not None, "score_on_device needs a device reward"
  return fns.reward.device(answers, rollout.tokens, rollout.mask)


def score(
  fns: StepFns, prompts: dict, rollout, *, split: str = "train", group_size: int | None = None
):
  """Rewards [B] and the host reward statistics, on device or in the verifier workers."""
  k = group_size or fns.sizes.group_size
  if fns.reward.device is not None:
    return score_on_device(fns, prompts, rollout, k), no_reward_stats()
  return score_on_host(fns, prompts, rollout, split=split, group_size=k)


def rewards_of(fns: StepFns, fin: Finished):
  """The rewards of finished groups and the host reward statistics: the rollout's own (an
  environment's, with zero statistics), or scored (`score`)."""
  if fin.rewards is not None:
    return fin.rewards, no_reward_stats()
  return score(fns, fin.prompts, fin.out)
