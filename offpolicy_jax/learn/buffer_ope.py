"""Off-policy evaluation from the replay buffer: the current policy's worth, nothing sampled.

At every evaluation of a run (`config.eval_ope`) the loop scores the tokens the
replay buffer holds (every slot written so far, groups already trained on
included) under the trainer's current parameters pi, as the train step scores
them (its temperature, truncation, shared prefix), and estimates pi's expected
reward from those lagged rows with the estimators of `ope` (docs/ope.md): for
each name, `ope/<name>`, its 95% interval `ope/<name>_low` / `_high` and its
effective sample size `ope/<name>_ess`. With a critic (`learn.critic`) the
doubly robust `dr` and `wdr` read its values V(s_t) from the same forward
pass (the value at the prompt and at the last token). Beside them: what the rows' own
samplers earned (`ope/behavior_reward`), how far they are from pi
(`ope/staleness_mean`, in versions) and how many rows were used (`ope/rows`).

The estimate is of pi's expected training reward on the training prompts, at
the sampling temperature: in an on-policy run (lag.sync_interval 1) the next
step's `reward_mean` is an unbiased sample of the same value, so the two can
be compared row by row (docs/ope.md). The intervals treat the rows as
independent; the K rows of a group share a prompt and the buffer mixes
several behaviour versions, so they are narrower than the truth.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from offpolicy_jax import ope
from offpolicy_jax.learn.replay import ReplayState
from offpolicy_jax.learn.scorer import step_logprobs
from offpolicy_jax.learn.step_options import StepOptions

# The estimators that read a critic's values (`ope.doubly_robust`, `weighted_doubly_robust`).
_DOUBLY_ROBUST = ("dr", "wdr")


def parse(spec: str) -> tuple[str, ...]:
  """`"is,wis"` -> ("is", "wis"); "" -> () (`config.eval_ope`, checked by its schema)."""
  return tuple(n.strip() for n in spec.split(",") if n.strip())


def estimate(
  graphdef,
  options: StepOptions,
  groups_per_batch: int,
  params,
  replay: ReplayState,
  version,
  names: tuple[str, ...],
) -> dict[str, jax.Array]:
  """The `ope/` metrics of `replay`'s rows under `params` at trainer version `version`
  (module docstring; traceable, `names` static). The rows are scored in chunks of at most
  `groups_per_batch` groups (a training batch), not in one forward pass over the buffer."""
  k, c = options.group_size, replay.valid.shape[0]
  rows = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), replay.data)  # [C K, ...]
  # Every slot written so far (a FIFO buffer retires the groups it trained on; their rows stay).
  written = jnp.arange(replay.valid.shape[0]) < replay.num_added
  live = jnp.repeat(written, k) & (rows.weights > 0)
  mask = rows.mask * live[:, None]
  chunk = math.gcd(c, groups_per_batch)
  chunks = jax.tree.map(lambda x: x.reshape(c // chunk, chunk * k, *x.shape[2:]), replay.data)

  critic = any(name in _DOUBLY_ROBUST for name in names)

  def score(part):
    scored = step_logprobs(graphdef, options, params, part, full=True)
    if critic and scored.values is None:
      raise ValueError(f"eval_ope: {names} need a critic's values; the model has no value head")
    return scored.logp, scored.values if critic else jnp.zeros_like(scored.logp)

  logp, values = jax.lax.map(score, chunks)
  logp, values = logp.reshape(c * k, -1), values.reshape(c * k, -1)
  out: dict[str, jax.Array] = {}
  for name in names:
    v = values if name in _DOUBLY_ROBUST else None
    est = ope.estimate(name, logp, rows.behavior_logp, mask, rows.rewards, values=v)
    out[f"ope/{name}"] = est.value
    out[f"ope/{name}_low"] = est.ci_low
    out[f"ope/{name}_high"] = est.ci_high
    out[f"ope/{name}_ess"] = est.ess
  used = (mask.sum(axis=1) > 0).astype(jnp.float32)
  n = used.sum()
  out["ope/rows"] = n
  out["ope/behavior_reward"] = jnp.sum(rows.rewards * used) / jnp.maximum(n, 1.0)
  tokens = jnp.maximum(mask.sum(), 1.0)
  out["ope/staleness_mean"] = jnp.sum((version - rows.versions) * mask) / tokens
  return out
