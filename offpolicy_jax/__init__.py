"""offpolicy_jax: JAX-native off-policy reinforcement learning for language models.

Submodules, one topic each:
  losses        composable policy losses and every named preset
  advantages    group-relative advantage estimators over [G, K] rewards
  models        Flax NNX decoder, size presets, HF safetensors import/export
  sampling      jitted KV-cache sampler with exact behaviour log-probs
  tokenizers    HF tokenizers wrapper and a tiny built-in tokenizer
  tasks         prompts + template + reward
  data          grain prompt pipelines
  rewards       host reward execution with timeouts
  lag           parameter versions, the sync schedule, snapshots
  replay        device-resident ring buffer of rollout groups
  sharding      mesh construction and logical axis rules
  train_step    the pure sharded train step
  loop          train_and_evaluate(config, workdir)
  environment   what a run builds once: mesh, model, tokenizer, task, compiled functions
  validation    start-up config checks that name the bad field
  evaluation    greedy accuracy and pass@k on held-out prompts
  sft           supervised warm start
  checkpointing orbax save/restore of the whole run state
  metrics       JSONL / TensorBoard writers, progress bar, plots
"""

from offpolicy_jax import (
  advantages,
  checkpointing,
  data,
  environment,
  evaluation,
  lag,
  loop,
  losses,
  metrics,
  models,
  replay,
  rewards,
  sampling,
  sft,
  sharding,
  tasks,
  tokenizers,
  train_step,
  types,
  validation,
)

__version__ = "0.1.0"

__all__ = [
  "advantages",
  "checkpointing",
  "data",
  "environment",
  "evaluation",
  "lag",
  "loop",
  "losses",
  "metrics",
  "models",
  "replay",
  "rewards",
  "sampling",
  "sft",
  "sharding",
  "tasks",
  "tokenizers",
  "train_step",
  "types",
  "validation",
]
