"""The rollout wing: what produces a step's finished rollout, from prompts to sampled rows.

  protocol      the `Rollout` protocol (init, advance -> Finished), `pi_old`, the one
                scorer of log pi_old, and `decode_waste`; its kinds:
  whole         static or continuous batching: every response to its end
  partial       APRIL partial rollouts: groups in flight across steps, on device
  episodes      multi-turn episodes: the sampler and the environment turn by turn
  episode_pool  episodes in flight across steps, paused mid-turn
  sampler_mesh  any rollout placed on a disaggregated sampler mesh (`OnSamplerMesh`)
  prompt_rows   the static batch shape (`Sizes`), prompt batches across processes
  data          grain prompt pipelines (deterministic, shardable, checkpointable)

The step that scores, packs and learns from a rollout is the step wing above this one.

May import: every wing below it (maths, scale, models, sampling, rewards, store, learn).
"""

from offpolicy_jax.rollout import (
  data,
  episode_pool,
  episodes,
  partial,
  prompt_rows,
  protocol,
  sampler_mesh,
  whole,
)

__all__ = [
  "data",
  "episode_pool",
  "episodes",
  "partial",
  "prompt_rows",
  "protocol",
  "sampler_mesh",
  "whole",
]
