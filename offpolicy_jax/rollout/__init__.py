"""The rollout wing: from prompts to scored, packed `TrainBatch`es, and one RL step.

  data          grain prompt pipelines (deterministic, shardable, checkpointable)
  pipeline      prompt batches across processes, sample, score (device or sandboxed host), pack
  rl_step       RunState, one pure RL step, and the run's named compiled `Programs`
  episodes      multi-turn rollouts: the sampler and the environment turn by turn
  episode_pool  partial rollouts of episodes: trajectories in flight across steps
  producer      the async-mode sampler thread
  sampler_mesh  the disaggregated sampler's rollouts
  sampler_choice static or continuous batching, chosen from the measured decode waste

May import: every wing below it (maths, scale, models, sampling, rewards, store, learn).
"""

from offpolicy_jax.rollout import (
  data,
  episode_pool,
  episodes,
  pipeline,
  producer,
  rl_step,
  sampler_choice,
  sampler_mesh,
)

__all__ = [
  "data",
  "episode_pool",
  "episodes",
  "pipeline",
  "producer",
  "rl_step",
  "sampler_choice",
  "sampler_mesh",
]
