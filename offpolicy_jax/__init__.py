"""offpolicy_jax: JAX-native off-policy reinforcement learning for language models.

The package is a stack of wings, each importing only from the ones below it
(checked in CI by the layers contract in `pyproject.toml`):

  study      the lag study, its statistics and reports, the bandit, sweeps, launchers
  run        components (the config's one reader), loop, evaluation, warm start,
             validation, export, planner
  step       one RL step (act -> score -> pack -> learn): the run's records (run_state),
             the step's halves (acting, learning), scoring, packing, rl_step / host_step,
             programs, drivers, the async producer, the sampler choice
  rollout    the Rollout protocol and its kinds, pi_old, prompt rows, the disaggregated sampler
  learn      train step, train state, batch splits, replay buffer, off-policy diagnostics
  store      checkpoints, the workdir record, metrics files
  rewards    tasks, host scoring in sandboxed verifier workers
  sampling   the KV-cache sampler, partial rollouts
  models     the NNX decoder, presets, HF import/export, tokenizers
  scale      meshes, logical-axis sharding, disaggregated sampler/trainer meshes
  maths      losses, advantages, returns (GAE, V-trace, Retrace), ope (off-policy evaluation),
             timeline (a step's wall clock per layout), reductions, types, lag (the
             schedule and snapshots), files;
             config_schema: every config field once (default, role, check, doc)

The names of the public contract: `losses`, `advantages`, `models`, `sampling`,
`lag`, `tasks`, `rewards`, `loop`.
"""

from offpolicy_jax import lazy

# The wings load on first use (`offpolicy_jax.losses`, `from offpolicy_jax import loop`):
# a binary that only reads its config, or refuses it, does not pay for JAX and the
# models (seconds per start).
_LAZY = {
  "tasks": "offpolicy_jax.rewards.tasks",
  "loop": "offpolicy_jax.run.loop",
}

__version__ = "0.2.0"

__all__ = [
  "advantages",
  "config_schema",
  "files",
  "lag",
  "learn",
  "loop",
  "losses",
  "models",
  "ope",
  "reductions",
  "returns",
  "rewards",
  "rollout",
  "run",
  "sampling",
  "scale",
  "step",
  "store",
  "study",
  "tasks",
  "timeline",
  "types",
]


__getattr__, __dir__ = lazy.modules(__name__, __all__, _LAZY)
