"""Whole responses: static or continuous batching, every response sampled to its end.

The rollout of a plain run (`protocol.Rollout`): the step's G prompts, K
responses each, all drawn by the behaviour parameters theta_v, so every token
records version v. The sampler is the static batch (`sampling.make_sampler`:
all B rows decode until the longest ends) or continuous batching
(`sampling.make_continuous_sampler`: row slots refilled as rows end); both
return the same `SampleOutput` with exact behaviour log-probs. With
`rollout.score_old` the learner also scores the tokens at theta_v
(`protocol.pi_old`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from offpolicy_jax.rollout import protocol
from offpolicy_jax.rollout.protocol import Finished, Rollout, Stateless, pi_old
from offpolicy_jax.sampling import Sampler


@dataclasses.dataclass(frozen=True, eq=False)
class Whole(Stateless, Rollout):
  """Every response of the step's prompts sampled to its end (module docstring).

  Attributes:
    sampler: `(params, prompt_tokens, prompt_lengths, key) -> SampleOutput`.
    score_old: the learner's scorer of log pi_old, or None (not scored).
  """

  sampler: Sampler
  score_old: Callable | None = None
  traced = True
  prefetch = True

  def with_sampler(self, sampler: Sampler) -> Whole:
    return dataclasses.replace(self, sampler=sampler)

  def advance(self, rstate, params, version, prompts: dict[str, Any], step, key, latest=None):
    """Samples K responses to each prompt under `params` (traceable); nothing is carried."""
    del step, latest
    out = self.sampler(params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)
    if self.score_old is not None:
      out = out._replace(old_logprobs=pi_old(self.score_old, [(params, version)], prompts, out, 0))
    info: dict[str, Any] = {"sampler/decode_waste": protocol.decode_waste(out.mask)}
    return rstate, Finished(prompts, out, version), info
