"""The run wing: from a config to a trained policy.

  components    build_components(config): the only reader of the config
  validation    start-up checks of every config field;  data_checks: of every prompt
  data          grain prompt pipelines (deterministic, shardable, checkpointable)
  pipeline      the one path from prompts to a scored, packed TrainBatch: prompt batches
                across processes, sample, score (device or sandboxed host), pack
  rl_step       RunState, one pure RL step, and the run's named compiled `Programs`
  train_step    the pure sharded train step;  batch_splits: how it cuts a batch;
                train_state: TrainState and the optimizer
  replay        device-resident ring buffer of rollout groups
  loop          train_and_evaluate(config, workdir): restore, iterate chunks, write rows
  producer      the async-mode sampler thread;  sampler_mesh: the disaggregated sampler's rollouts
  evaluation    greedy accuracy and pass@k on held-out prompts (the loop's and the study's)
  export        a run's checkpoint as a PEFT adapter or an HF checkpoint
  sft           supervised warm start
  observability compile counter, jax.profiler traces
  planner       per-device memory of a config on any mesh, before allocating

May import: every wing below it (maths, scale, models, sampling, rewards, store).
"""

from offpolicy_jax.run import (
  batch_splits,
  components,
  data,
  data_checks,
  evaluation,
  export,
  loop,
  observability,
  pipeline,
  planner,
  producer,
  replay,
  rl_step,
  sampler_mesh,
  sft,
  train_state,
  train_step,
  validation,
)

__all__ = [
  "batch_splits",
  "components",
  "data",
  "data_checks",
  "evaluation",
  "export",
  "loop",
  "observability",
  "planner",
  "producer",
  "replay",
  "rl_step",
  "pipeline",
  "sampler_mesh",
  "sft",
  "train_state",
  "train_step",
  "validation",
]
