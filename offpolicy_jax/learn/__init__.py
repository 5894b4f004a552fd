"""The learn wing: from a packed `TrainBatch` to a parameter update.

  train_step    the pure sharded train step: U optimizer steps on a batch, make_train_step
                (jitted with mesh shardings)
  step_options  StepOptions, the train step's static settings; LearnerParts (options, optimizer)
  optimizer_step  one optimizer step: accumulation over micro-batches, exact (sum, count),
                skip non-finite
  micro_batch_loss  one micro-batch's forward passes, policy loss and typed metrics
  scorer        the learner's log-probs (token_logprobs, shared-prefix groups), make_scorer
  train_state   TrainState and the optimizer
  batch_splits  how the train step cuts a batch: micro-batches, chunks of the rows that count
  replay        device-resident ring buffer of rollout groups (fifo / uniform / staleness / reward)
  diagnostics   off-policy diagnostics of every row: k1/k2/k3 of pi/mu, pi/pi_old, pi_old/mu

May import: maths, scale, models, sampling, rewards, store (never rollout or run).
"""

from offpolicy_jax.learn import (
  batch_splits,
  diagnostics,
  micro_batch_loss,
  optimizer_step,
  replay,
  scorer,
  step_options,
  train_state,
  train_step,
)

__all__ = [
  "batch_splits",
  "diagnostics",
  "micro_batch_loss",
  "optimizer_step",
  "replay",
  "scorer",
  "step_options",
  "train_state",
  "train_step",
]
