"""The rollout wing: from prompts to scored, packed `TrainBatch`es, and one RL step.

  protocol      the `Rollout` protocol (init, advance -> Finished) and `pi_old`, the one
                scorer of log pi_old; its kinds:
  whole         static or continuous batching: every response to its end
  partial       APRIL partial rollouts: groups in flight across steps, on device
  episodes      multi-turn episodes: the sampler and the environment turn by turn
  episode_pool  episodes in flight across steps, paused mid-turn
  sampler_mesh  any rollout placed on a disaggregated sampler mesh (`OnSamplerMesh`)
  pipeline      prompt batches across processes, score (device or sandboxed host), pack
  run_state     a run's static parts (`StepFns`), its carried state (`RunState`) and its items
  acting        the acting half of a step: behaviour parameters (lag), then the rollout
  learning      the learning half: pack, replay, train step, snapshots
  rl_step       one pure RL step: acting -> score -> learning (and chunks of them, scanned)
  host_step     the same step where it leaves the device, and over the study's seeds
  drivers       the loop's one step driver: scanned chunks, split host steps, or async
  programs      a run's named compiled programs
  producer      the async-mode sampler thread
  sampler_choice static or continuous batching, chosen from the measured decode waste
  data          grain prompt pipelines (deterministic, shardable, checkpointable)

May import: every wing below it (maths, scale, models, sampling, rewards, store, learn).
"""

from offpolicy_jax.rollout import (
  acting,
  data,
  drivers,
  episode_pool,
  episodes,
  host_step,
  learning,
  partial,
  pipeline,
  producer,
  programs,
  protocol,
  rl_step,
  run_state,
  sampler_choice,
  sampler_mesh,
  whole,
)

__all__ = [
  "acting",
  "data",
  "drivers",
  "episode_pool",
  "episodes",
  "host_step",
  "learning",
  "partial",
  "pipeline",
  "producer",
  "programs",
  "protocol",
  "rl_step",
  "run_state",
  "sampler_choice",
  "sampler_mesh",
  "whole",
]
