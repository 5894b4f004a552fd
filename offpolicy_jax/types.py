"""Records that flow through the RL loop, as NamedTuples of arrays.

The sampler's output is `sampling.SampleOutput`; the loop packs it with
rewards and advantages into a `TrainBatch`, which the replay buffer stores and
the train step consumes.

Shape letters: B batch (= G * K rows, group-major), G prompts, K responses per
prompt, P prompt length, N response length.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


class TrainBatch(NamedTuple):
  """One optimizer batch: prompt, response, behaviour log-probs and advantages.

  Attributes:
    prompt_tokens: int32 [B, P] left-padded prompts.
    prompt_mask: float32 [B, P] 1 on real prompt tokens.
    tokens: int32 [B, N] response tokens.
    mask: float32 [B, N] 1 on valid response tokens.
    behavior_logp: float32 [B, N] recorded log-probs of the sampler (mu).
    advantages: float32 [B] or [B, N] advantages.
    rewards: float32 [B] scalar rewards, for metrics.
    versions: int32 [B, N] version that produced each token.
    weights: float32 [B] per-sequence sample weights (1 = keep; 0 = dropped by
      data shaping such as a staleness bound).
    behavior_kept: int32 [B, N] size of the top-k / top-p set each token was
      drawn from (V without truncation; `sampling.SampleOutput.kept`), with
      which the learner scores the truncated distribution mu was taken from
      (`models.logprobs`, docs/science.md s7).
    old_logp: float32 [B, N] log pi_old: the behaviour version's parameters
      scored by the learner (`rollout.score_old`), so that pi / mu factors
      into staleness pi / pi_old and engine mismatch pi_old / mu (docs/science.md
      s7); equal to `behavior_logp` when not scored.
    prompt_experts: int [B, P, L, k] the experts the sampler's prefill routed
      each prompt token to in each block (routing replay, `models.moe`), or None.
    experts: int [B, N, L, k] the same for each response token, or None.
    values: float32 [B, N] the critic's values V_old at the train step's
      starting parameters, or None: set inside the train step only
      (`learn.critic.with_gae`), never stored.
    returns: float32 [B, N] the critic's value targets, or None (as `values`).
    token_rewards: float32 [B, N] each turn's reward at that turn's last policy
      token (`returns.token_rewards`: per-turn rewards of multi-turn episodes,
      `multiturn.credit = "turn"`, kept for a critic's returns), or None: the
      critic pays `rewards` at the row's last policy token.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  mask: jax.Array
  behavior_logp: jax.Array
  advantages: jax.Array
  rewards: jax.Array
  versions: jax.Array
  weights: jax.Array
  behavior_kept: jax.Array
  old_logp: jax.Array
  prompt_experts: jax.Array | None = None
  experts: jax.Array | None = None
  values: jax.Array | None = None
  returns: jax.Array | None = None
  token_rewards: jax.Array | None = None


def turn_ids(mask_bn: ArrayLike) -> jax.Array:
  """int32 [B, N]: the turn of each response token, turns being runs of policy tokens (mask 1).

  A multi-turn trajectory (`rollout.episodes`) interleaves policy turns with
  observation tokens of mask 0; turn j is the j-th run of mask-1 tokens. A
  single-turn row is one turn (0). Observation tokens get the turn they answer.
  """
  on = jnp.asarray(mask_bn) > 0
  starts = on & ~jnp.pad(on, ((0, 0), (1, 0)))[:, :-1]
  return jnp.maximum(jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, 0)


def prompt_mask(prompt_lengths: ArrayLike, width: int) -> jax.Array:
  """bool [G, P]: True on the real tokens of left-padded prompts of `prompt_lengths` [G]."""
  return jnp.arange(width)[None, :] >= width - jnp.asarray(prompt_lengths)[:, None]


def pack_groups(
  prompt_tokens_gp: ArrayLike,
  prompt_lengths_g: ArrayLike,
  tokens_bn: ArrayLike,
  mask_bn: ArrayLike,
  logprobs_bn: ArrayLike,
  versions_bn: ArrayLike,
  rewards_b: ArrayLike,
  advantages_b: ArrayLike,
  kept_bn: ArrayLike,
  old_logp_bn: ArrayLike | None = None,
  prompt_experts_gp: ArrayLike | None = None,
  experts_bn: ArrayLike | None = None,
) -> TrainBatch:
  """The `TrainBatch` of G prompts and their K responses each (B = G * K rows, group-major).

  Args:
    prompt_tokens_gp: int32 [G, P] left-padded prompts.
    prompt_lengths_g: int32 [G] their lengths.
    tokens_bn: int32 [B, N] response tokens.
    mask_bn: [B, N] 1 on valid response tokens.
    logprobs_bn: float32 [B, N] behaviour log-probs recorded by the sampler.
    versions_bn: int32 [B, N] parameter version of each token (optimizer steps).
    rewards_b: float32 [B] rewards.
    advantages_b: float32 [B] or [B, N] advantages.
    kept_bn: int32 [B, N] kept-set size of each token (`sampling.SampleOutput.kept`).
    old_logp_bn: float32 [B, N] the learner's log-probs at the behaviour's
      parameters (`TrainBatch.old_logp`); None: `logprobs_bn`.
    prompt_experts_gp: int [G, P, L, k] the prompts' recorded experts
      (`TrainBatch.prompt_experts`, repeated per row), or None.
    experts_bn: int [B, N, L, k] the responses' (`TrainBatch.experts`), or None.
  """
  prompt_tokens_gp = jnp.asarray(prompt_tokens_gp)
  g, p = prompt_tokens_gp.shape
  b = jnp.shape(tokens_bn)[0]
  k = b // g
  mask_gp = prompt_mask(prompt_lengths_g, p).astype(jnp.float32)
  return TrainBatch(
    prompt_tokens=jnp.repeat(prompt_tokens_gp, k, axis=0),
    prompt_mask=jnp.repeat(mask_gp, k, axis=0),
    tokens=jnp.asarray(tokens_bn),
    mask=jnp.asarray(mask_bn, jnp.float32),
    behavior_logp=jnp.asarray(logprobs_bn),
    advantages=jnp.asarray(advantages_b, jnp.float32),
    rewards=jnp.asarray(rewards_b, jnp.float32),
    versions=jnp.asarray(versions_bn, jnp.int32),
    weights=jnp.ones((b,), jnp.float32),
    behavior_kept=jnp.asarray(kept_bn, jnp.int32),
    old_logp=jnp.asarray(logprobs_bn if old_logp_bn is None else old_logp_bn, jnp.float32),
    prompt_experts=None
    if experts_bn is None or prompt_experts_gp is None
    else jnp.repeat(jnp.asarray(prompt_experts_gp), k, axis=0),
    experts=None if experts_bn is None else jnp.asarray(experts_bn),
  )
