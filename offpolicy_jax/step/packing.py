"""Packing scored rows into a `TrainBatch`: the one packer of every rollout kind.

Advantages (per row, or per turn under `multiturn.credit = "turn"`),
per-token versions and the groups' buffer order are settled here; partial
rollouts and the episode pool pass the groups that finished (`valid`) and
their order (`order`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax import advantages, returns, types
from offpolicy_jax.rollout.prompt_rows import DEVICE_FIELDS
from offpolicy_jax.step.run_state import Packing
from offpolicy_jax.types import TrainBatch


def pack(
  packing: Packing, prompts: dict, rollout, rewards_b, version, key, valid=None, order=None
) -> TrainBatch:
  """Packs scored rows into a `TrainBatch` (traceable): the one packer of every rollout.

  Args:
    packing: group size, advantage estimator and turn discount (`StepFns.packing`).
    prompts: dict with `prompt_tokens` [G, P] and `prompt_lengths` [G].
    rollout: the sampler's output for the G * K rows.
    rewards_b: float32 [B]; a non-finite reward makes the loss non-finite and
      the train step skips that update (failing host rewards score 0). Or
      float32 [B, T], the rewards after each turn of multi-turn trajectories
      (`multiturn.credit = "turn"`): token advantages are then per turn
      (`advantages.per_turn`, turns = runs of policy tokens, `types.turn_ids`)
      and the batch's reward is their sum.
    version: the behaviour parameters' version, in optimizer steps (`fns.learner.version`),
      or int [B, N] per token (episodes whose turns were drawn by different versions).
    key: PRNG key of stochastic advantage estimators.
    valid: optional bool [G], the groups the advantages are computed over (the
      others get 0 and no say in batch-level estimators): the finished groups
      of a partial-rollout pool. Default: all.
    order: optional int [G], the order of the groups in the batch (a FIFO
      replay buffer trains them in that order): groups are permuted before
      anything else, so advantages and keys see them in that order. Default:
      as they are.
  """
  # G groups: the step's prompts, or the slots of a partial-rollout pool.
  g, k = jnp.shape(prompts["prompt_tokens"])[0], packing.group_size
  rewards_b = jnp.asarray(rewards_b, jnp.float32)
  prompt_experts = getattr(rollout, "prompt_experts", None)  # per group, not per row
  if prompt_experts is not None:
    rollout = rollout._replace(prompt_experts=None)
  if order is not None:
    rows = (jnp.asarray(order)[:, None] * k + jnp.arange(k)[None, :]).reshape(-1)
    prompts = {name: jnp.asarray(x)[order] for name, x in prompts.items() if name in DEVICE_FIELDS}
    rollout = jax.tree.map(lambda x: x[rows], rollout)
    rewards_b = rewards_b[rows]
    version = jnp.asarray(version)
    version = version[rows] if version.ndim else version
    valid = None if valid is None else jnp.asarray(valid)[order]
    prompt_experts = None if prompt_experts is None else prompt_experts[order]
  rows_valid = None if valid is None else jnp.repeat(jnp.asarray(valid, bool), k)
  token_rewards = None
  if rewards_b.ndim == 2:
    if rows_valid is not None:  # NaN: turns not taken (`advantages.per_turn`)
      rewards_b = jnp.where(rows_valid[:, None], rewards_b, jnp.nan)
    adv_bt = advantages.per_turn(
      packing.advantage, rewards_b.reshape(g, k, -1), key, gamma=packing.gamma
    ).reshape(g * k, -1)
    turn = jnp.minimum(types.turn_ids(rollout.mask), adv_bt.shape[1] - 1)
    adv = jnp.take_along_axis(adv_bt, turn, axis=1) * (rollout.mask > 0)
    if packing.token_rewards:  # NaN (a turn not taken, a group not finished) pays 0
      token_rewards = returns.token_rewards(rewards_b, rollout.mask)
    rewards_b = jnp.nansum(rewards_b, axis=1)
  else:
    valid_gk = None if rows_valid is None else rows_valid.reshape(g, k)
    adv = advantages.compute(packing.advantage, rewards_b.reshape(g, k), key=key, valid=valid_gk)
    adv = adv.reshape(g * k)
  versions = jnp.broadcast_to(jnp.asarray(version, jnp.int32), rollout.tokens.shape)
  batch = types.pack_groups(
    prompts["prompt_tokens"],
    prompts["prompt_lengths"],
    rollout.tokens,
    rollout.mask,
    rollout.logprobs,
    versions,
    rewards_b,
    adv,
    rollout.kept,
    rollout.old_logprobs,
    prompt_experts,
    getattr(rollout, "experts", None),
  )
  if token_rewards is not None:
    batch = batch._replace(token_rewards=token_rewards)
  if packing.advantage in advantages.GREEDY_FIRST:  # the greedy baseline is not trained on
    batch = batch._replace(weights=batch.weights * (jnp.arange(g * k) % k != 0))
  return batch


# `pack` jitted, for callers on the host (`learning.pack_finished` outside a jitted step).
pack_jit = jax.jit(pack, static_argnums=0)
