"""Records that flow through the RL loop, as NamedTuples of arrays.

The sampler's output is `sampling.SampleOutput`; the loop packs it with
rewards and advantages into a `TrainBatch`, which the replay buffer stores and
the train step consumes.

Shape letters: B batch (= G * K rows, group-major), G prompts, K responses per
prompt, P prompt length, N response length.
"""

from typing import NamedTuple

import jax


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
