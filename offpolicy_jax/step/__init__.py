"""The step wing: one RL step (act -> score -> pack -> learn) and what drives it.

  run_state      a run's static parts (`StepFns`), its carried state (`RunState`),
                 its checkpoint items and its per-step randomness (`step_key`)
  seeds          one run's seed or the study's seeds side by side: the one place that
                 knows whether a tree carries a seed axis
  acting         the acting half of a step: behaviour parameters (lag), then the rollout
  scoring        a step's rewards: on device, or in the sandboxed verifier workers
  packing        scored rows -> a `TrainBatch` (advantages, versions, order): the one packer
  learning       the learning half: score, pack, replay, train step, snapshots
  rl_step        one pure RL step: acting -> learning (and chunks of them, scanned)
  host_step      the same step where it leaves the device (one run, or the study's seeds)
  programs       a run's named compiled programs, and the choices between them
  drivers        the loop's one step driver: scanned chunks, split host steps, or async
  producer       the async-mode sampler thread
  sampler_choice static or continuous batching, chosen from the measured decode waste

What produces a finished rollout (the protocol, its kinds, prompts) is the
rollout wing below this one.

May import: every wing below it (maths, scale, models, sampling, rewards, store, learn,
rollout).
"""

from offpolicy_jax.step import (
  acting,
  drivers,
  host_step,
  learning,
  packing,
  producer,
  programs,
  rl_step,
  run_state,
  sampler_choice,
  scoring,
  seeds,
)

__all__ = [
  "acting",
  "drivers",
  "host_step",
  "learning",
  "packing",
  "producer",
  "programs",
  "rl_step",
  "run_state",
  "sampler_choice",
  "scoring",
  "seeds",
]
