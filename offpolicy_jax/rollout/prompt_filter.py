"""Prompt values (V_0): the critic's prediction of a prompt's reward chooses the prompts sampled.

A group whose K rewards are all equal (every response right, or every one
wrong) has zero group advantage and teaches nothing; sampling it is wasted.
With a critic (`learn.critic`) the value head at a prompt's last token is
V_0(x), the predicted reward of a response to x (the first response token's
V(s_0), which the value loss trains). With `critic.prompt_pool` m > 1 each
step reads m x G candidate prompts and keeps G of them: from every run of m
consecutive candidates, the one whose predicted group is most likely to be
informative. With rewards in [r_wrong, r_right] (`critic.prompt_wrong`,
`critic.prompt_right`; the critic must predict the reward undiscounted,
`critic.gamma` = 1; a KL penalty in its rewards, `critic.kl_coef`, shifts V_0
by the expected penalty),
p = clip((V_0 - r_wrong) / (r_right - r_wrong), 0, 1) is the predicted
success rate and

  P(the K rewards are all equal) = p^K + (1 - p)^K          (K = group_size)

is read as if the K responses were independent Bernoulli(p) draws; the
candidate with the smallest such probability is kept (ties: the first). The
m - 1 others are never sampled: the saving is m - 1 prompts of K samples for
every kept prompt against sampling all candidates and dropping all-equal
groups afterwards (DAPO's dynamic sampling), and the cost is one prompt-only
forward of the m x G candidates.

The values are computed with the trainer's parameters at the start of the
step the prompts are for: the loop then runs one step per chunk and samples
no step ahead (`run.loop`), so the choice does not depend on how often a run
logs, evaluates or checkpoints.

Candidates are chosen within runs of m consecutive rows, so under several
processes (each holding a block of whole runs) the kept prompts, and every
number of the run, do not depend on the process count. Rows report
`v0/predicted_all_equal` (the formula's mean over the kept prompts, beside the
measured `groups_all_equal`), `v0/predicted_all_equal_pool` (over all
candidates: what sampling them unchosen would have given, predicted) and
`v0/value_mean` (the kept prompts' mean V_0, beside `reward_mean`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from offpolicy_jax.models import value
from offpolicy_jax.rollout import prompt_rows


@dataclasses.dataclass(frozen=True)
class PromptFilter:
  """How prompts are chosen by their values (module docstring).

  Attributes:
    pool: m, candidates read per kept prompt (> 1).
    wrong, right: the rewards of a wrong and of a right response.
    group_size: K, responses per prompt.
  """

  pool: int
  wrong: float
  right: float
  group_size: int

  def __post_init__(self):
    if self.pool < 2:
      raise ValueError(f"critic.prompt_pool must be >= 2 to choose, got {self.pool}")
    if not self.right > self.wrong:
      raise ValueError(
        f"critic.prompt_right: a right response's reward must exceed a wrong one's "
        f"(critic.prompt_wrong), got ({self.wrong}, {self.right})"
      )

  def all_equal(self, values: np.ndarray) -> np.ndarray:
    """The predicted probability that a prompt's K rewards are all equal, per value."""
    p = np.clip((np.asarray(values, np.float64) - self.wrong) / (self.right - self.wrong), 0, 1)
    return p**self.group_size + (1 - p) ** self.group_size


def prompt_values(model, prompt_tokens: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
  """float32 [B] V_0: the value head at the last token of left-padded prompts [B, P]."""
  p = prompt_tokens.shape[1]
  mask = jnp.arange(p)[None, :] >= p - prompt_lengths[:, None]
  last = lambda m: m.hidden_states(prompt_tokens, attention_mask=mask)[0][:, -1]
  values = value.values_of(model, None if value.has_separate_critic(model) else last(model), last)
  if values is None:
    raise ValueError("prompt values need a model with a value head (a critic)")
  return values


def values_program(graphdef):
  """`(params, prompt_tokens, prompt_lengths) -> V_0 [B]`, jitted, for the whole model's state."""

  @jax.jit
  def run(params, tokens, lengths):
    return prompt_values(nnx.merge(graphdef, params), tokens, lengths)

  return run


def choose(filt: PromptFilter, values: np.ndarray, valid: np.ndarray) -> np.ndarray:
  """Rows kept from candidates [m * G']: per run of m, the least likely all-equal (ties: first).

  An invalid row (the padding of a finite split's last batch) is kept only from a run
  with no valid row.
  """
  m = filt.pool
  if values.shape[0] % m:
    raise ValueError(f"{values.shape[0]} candidate prompts are not runs of {m}")
  score = np.where(valid, filt.all_equal(values), 2.0).reshape(-1, m)
  return np.arange(score.shape[0]) * m + np.argmin(score, axis=1)  # argmin takes the first


def select(filt: PromptFilter, program, params, mesh, batch: dict[str, Any]):
  """`(kept batch, row fields)`: this process's candidates [m * G_local] -> [G_local] rows.

  `program` is `values_program`'s; `params` the whole model's state on `mesh`. The
  choice and the row fields are computed from every process's candidates alike.
  """
  fields = ("prompt_tokens", "prompt_lengths", "valid")
  device = prompt_rows.assemble_global(mesh, {k: batch[k] for k in fields})
  with jax.set_mesh(mesh):  # the model's activation constraints, as in the step's programs
    values = program(params, device["prompt_tokens"], device["prompt_lengths"])
  if jax.process_count() > 1:
    values = multihost_utils.process_allgather(values, tiled=True)
  values = np.asarray(values, np.float64)
  valid = np.asarray(device["valid"], bool)
  kept = choose(filt, values, valid)
  rows = len(batch["valid"])
  lo = jax.process_index() * rows
  local = kept[(kept >= lo) & (kept < lo + rows)] - lo
  out = {k: v[local] for k, v in batch.items()}
  return out, {
    "v0/predicted_all_equal": _mean(filt.all_equal(values[kept]), valid[kept]),
    "v0/predicted_all_equal_pool": _mean(filt.all_equal(values), valid),
    "v0/value_mean": _mean(values[kept], valid[kept]),
  }


def _mean(x: np.ndarray, valid: np.ndarray) -> float:
  return float(x[valid].mean()) if valid.any() else 0.0
