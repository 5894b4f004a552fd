"""The sampling wing: turning parameters and prompts into responses with exact behaviour log-probs.

  sampler   the jitted KV-cache sampler (`generate`, `make_sampler`): prefill once per
            prompt, shared by its K samples, exact log-probs of the sampling distribution
  partial   APRIL partial rollouts: a per-step token budget, unfinished responses resumed
            under newer parameters, a version and behaviour log-prob per token

May import: the maths modules, `scale`, `models`.
"""

from offpolicy_jax.sampling import partial, sampler
from offpolicy_jax.sampling.sampler import SampleOutput, generate, make_sampler, select_token

__all__ = ["SampleOutput", "generate", "make_sampler", "partial", "sampler", "select_token"]
