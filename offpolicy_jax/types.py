"""Records that flow through the RL loop, as NamedTuples of arrays.

Shape letters: B batch (= G * K rows, group-major), G prompts, K responses per
prompt, P prompt length, N response length.
"""

from typing import NamedTuple

import jax
from jax.typing import ArrayLike

Array = jax.Array
PRNGKey = jax.Array
Scalar = ArrayLike


class Rollout(NamedTuple):
  """What the sampler produced for a batch of prompts.

  Attributes:
    tokens: int32 [B, N] sampled response tokens, padding after EOS.
    logprobs: float32 [B, N] log-prob of each sampled token under the
      distribution it was sampled from (the behaviour policy mu).
    mask: float32 [B, N] 1 for response tokens up to and including EOS.
    lengths: int32 [B] number of valid response tokens.
    versions: int32 [B, N] parameter version that produced each token.
  """

  tokens: Array
  logprobs: Array
  mask: Array
  lengths: Array
  versions: Array


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

  prompt_tokens: Array
  prompt_mask: Array
  tokens: Array
  mask: Array
  behavior_logp: Array
  advantages: Array
  rewards: Array
  versions: Array
  weights: Array
