"""How the sampling fields fit the rest of a run's config: continuous batching, sampler
threads, partial rollouts, and the greedy baseline of ReMax (`advantages.GREEDY_FIRST`).

`validation.validate_settings` runs `validate`; the values alone are checked by the schema.
"""

from __future__ import annotations

import math

from offpolicy_jax import advantages, errors


def validate(c, advantage: str) -> None:
  """How the sampling fields fit together and the rest (the values alone are checked already).

  `advantage` is the run's estimator (`validation.advantage_name`): ReMax's
  takes a greedy response per group from the static sampler.

  Raises:
    ConfigError: `config.<field>: ...` naming the field.
  """
  if advantage in advantages.GREEDY_FIRST:
    others = (
      ("rollout.continuous_slots", c.rollout.continuous_slots),
      ("rollout.partial_budget", c.rollout.partial_budget),
      ("multiturn.max_turns", c.multiturn.max_turns),
    )
    for field, value in others:
      errors.need(
        not value,
        field,
        f"advantage {advantage!r} takes its baseline, a greedy response per group, from the "
        f"static sampler, not the one of {field}={value}: set it to 0",
      )
  if c.rollout.continuous_auto_steps:
    errors.need(
      c.rollout.continuous_slots > 0,
      "rollout.continuous_auto_steps",
      "the automatic switch to continuous batching needs the slots to switch to "
      "(rollout.continuous_slots > 0)",
    )
    errors.need(
      c.lag.mode == "sync",
      "rollout.continuous_auto_steps",
      f"the automatic switch to continuous batching runs in lag.mode='sync' only, got "
      f"{c.lag.mode!r} (set rollout.continuous_slots without it)",
    )
  if c.lag.sampler_threads > 1:
    errors.need(
      c.lag.mode == "async",
      "lag.sampler_threads",
      f"{c.lag.sampler_threads} sampler threads need lag.mode='async', got {c.lag.mode!r}",
    )
    errors.need(
      not c.rollout.partial_budget,
      "lag.sampler_threads",
      "partial rollouts carry one pool of groups in flight: they take one sampler thread",
    )
  if c.rollout.partial_budget:
    # In flight up to L = ceil(N / b) steps: under async, tokens L - 1 older than their batch.
    steps = math.ceil(c.max_new_tokens / c.rollout.partial_budget)
    errors.need(
      c.lag.mode == "sync" or not c.lag.max_staleness or c.lag.max_staleness >= steps,
      "lag.max_staleness",
      f"partial rollouts keep a group in flight up to ceil(max_new_tokens / rollout.partial_"
      f"budget) = {steps} loop steps: a bound of {c.lag.max_staleness} drops every batch that "
      f"finishes one; use 0 (no bound) or >= {steps} (a little more leaves room for the queue)",
    )
    errors.need(
      not c.rollout.continuous_slots,
      "rollout.continuous_slots",
      "continuous batching samples whole responses; it does not take partial rollouts "
      "(rollout.partial_budget > 0)",
    )
    # The pool is on the trainer's mesh (`Partial.mesh`); a sampler mesh's is not built.
    errors.need(
      not c.mesh.sampler_devices,
      "mesh.sampler_devices",
      "a disaggregated sampler samples whole responses; it does not take partial rollouts "
      "(rollout.partial_budget > 0)",
    )
