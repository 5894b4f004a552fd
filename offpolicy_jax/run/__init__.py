"""The run wing: from a config to a trained policy.

  components    build_components(config): the only reader of the config;
                components_rollout: its rollout half (reward, episodes, the rollout kind)
  validation    start-up checks of every config field;  data_checks: of every prompt
  loop          train_and_evaluate(config, workdir): iterate chunks, write rows, checkpoint
  start         how a run starts: fresh (warm start) or from its latest checkpoint;
                evaluate_checkpoint
  evaluation    greedy accuracy and pass@k on held-out prompts (the loop's and the study's)
  export        a run's checkpoint as a PEFT adapter or an HF checkpoint
  sft           supervised warm start
  observability compile counter, jax.profiler traces
  planner       per-device memory of a config on any mesh, before allocating

May import: every wing below it (maths, scale, models, sampling, rewards, store, learn, rollout).
"""

from offpolicy_jax.run import (
  components,
  components_rollout,
  data_checks,
  evaluation,
  export,
  loop,
  observability,
  planner,
  sft,
  start,
  validation,
)

__all__ = [
  "components",
  "components_rollout",
  "data_checks",
  "evaluation",
  "export",
  "loop",
  "observability",
  "planner",
  "sft",
  "start",
  "validation",
]
