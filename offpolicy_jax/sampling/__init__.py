"""The sampling wing: turning parameters and prompts into responses with exact behaviour log-probs.

  sampler   the jitted KV-cache sampler (`generate`, `make_sampler`): prefill once per
            prompt, shared by its K samples, exact log-probs of the sampling distribution
  continuous  continuous batching: S * K row slots, a finished row's slot refilled with the
            next waiting row inside the compiled loop, groups kept whole in the output
            (`make_continuous_sampler`)
  multiturn multi-turn agent rollouts, token in / token out: one row per trajectory, policy
            turns interleaved with environment observations appended to the KV cache
            (`MultiTurnSampler`, `EpisodeInfo`): the host loop of turns, `respond`'s answers
  turn_pieces  the jitted device pieces of a multi-turn rollout (start, turn, extend,
            reencode) and the state they carry (`MultiTurnState`)
  partial   APRIL partial rollouts: a per-step token budget, unfinished responses resumed
            under newer parameters, a version and behaviour log-prob per token

May import: the maths modules, `scale`, `models`.
"""

from offpolicy_jax.sampling import continuous, multiturn, partial, sampler, turn_pieces
from offpolicy_jax.sampling.continuous import make_continuous_sampler
from offpolicy_jax.sampling.multiturn import EpisodeInfo, MultiTurnSampler
from offpolicy_jax.sampling.sampler import (
  SampleOutput,
  Sampler,
  generate,
  make_sampler,
  select_token,
)

__all__ = [
  "EpisodeInfo",
  "MultiTurnSampler",
  "SampleOutput",
  "Sampler",
  "continuous",
  "generate",
  "make_continuous_sampler",
  "make_sampler",
  "multiturn",
  "partial",
  "sampler",
  "select_token",
  "turn_pieces",
]
