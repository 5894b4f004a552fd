"""offpolicy_jax: JAX-native off-policy reinforcement learning for language models.

Submodules, one topic each:
  losses        composable policy losses and every named preset
  advantages    group-relative advantage estimators over [G, K] rewards
  models        Flax NNX decoder, size presets, HF safetensors import/export
  sampling      jitted KV-cache sampler with exact behaviour log-probs
  partial_rollouts  APRIL: responses paused at a per-step token budget, resumed, versions per token
  tokenizers    HF tokenizers wrapper and a tiny built-in tokenizer
  tasks         prompts + template + reward
  data          grain prompt pipelines
  rewards       host reward execution with timeouts
  lag           parameter versions, the sync schedule, snapshots
  replay        device-resident ring buffer of rollout groups
  sharding      mesh construction and logical axis rules
  train_state   TrainState, the optimizer
  train_step    the pure sharded train step (module-level functions, typed metrics)
  reductions    typed metric reductions: Mean(sum, count), Sum, Max, Min
  rollouts      prompt batches, rewards, packing a scored rollout into a TrainBatch
  rl_step       one pure RL step (RunState, behaviour params, sample, reward, learn)
  components    build_components(config): the only reader of the config
  loop          train_and_evaluate(config, workdir): restore, iterate, write
  producer      the async-mode sampler thread
  disagg        disaggregated sampler/trainer meshes: device split, weight transfer
  observability compile counter and jax.profiler traces
  validation    start-up config checks that name the bad field
  evaluation    greedy accuracy and pass@k on held-out prompts
  sft           supervised warm start
  sweeps        run_sweep: a config's get_sweep() overrides, run one after another
  launchers     per-host commands, SLURM scripts and JobSets for a sweep on a cluster
  planner       per-device memory and step-time plan of a config, before allocating
  study         a seeded grid of methods x lags, vmapped over seeds, resumable
  study_stats   bootstrap intervals, paired verdicts, run summaries
  study_report  study.csv, study.md tables and plots
  bandit        the paper's 3-armed bandit as a seeded study of the losses
  checkpointing orbax save/restore of the whole run state
  metrics       JSONL / TensorBoard writers, progress bar, plots
"""

from offpolicy_jax import (
  advantages,
  bandit,
  checkpointing,
  components,
  data,
  disagg,
  evaluation,
  lag,
  launchers,
  loop,
  losses,
  metrics,
  models,
  partial_rollouts,
  planner,
  reductions,
  replay,
  rewards,
  rl_step,
  rollouts,
  sampling,
  sft,
  sharding,
  study,
  study_report,
  study_stats,
  sweeps,
  tasks,
  tokenizers,
  train_state,
  train_step,
  types,
  validation,
)

__version__ = "0.2.0"

__all__ = [
  "advantages",
  "bandit",
  "checkpointing",
  "data",
  "components",
  "disagg",
  "evaluation",
  "lag",
  "launchers",
  "loop",
  "losses",
  "metrics",
  "models",
  "partial_rollouts",
  "planner",
  "reductions",
  "replay",
  "rewards",
  "rl_step",
  "rollouts",
  "sampling",
  "sft",
  "sharding",
  "study",
  "study_report",
  "study_stats",
  "sweeps",
  "tasks",
  "tokenizers",
  "train_state",
  "train_step",
  "types",
  "validation",
]
