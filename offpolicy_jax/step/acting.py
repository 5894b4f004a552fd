"""The acting half of a step: the behaviour parameters of loop step t, then the rollout.

  v(t)     = m * floor((t - n - 1) / m)  (0 if t <= n)    behaviour version (loop steps)
  theta_mu = theta_{t-1} if v(t) = t - 1 else snapshot[v(t)]   (`lax.select`, no host sync)
  rollout  ~ pi_{theta_mu}(. | prompts_t)                 `Rollout.advance`

`rollout` is the traced half (inside the jitted step, or the jitted
`Programs.rollout` of a host step); `behaviour_params` alone is the
`Programs.behaviour` of a rollout that runs on the host. `sample` is the
acting half of a step driven from the host (`host_step`): the jitted
`Programs.rollout` of a traced rollout, or `advance` on the host under the
parameters of `Programs.behaviour`; `sample_over_seeds` is the same for the
study's S seeds (vmapped programs, each seed's host rollout on its own rows).
`advance` is `Rollout.advance` from the host with the step's sampling key
(also the async producer's, `host_step.collect`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import lag
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.scale import sharding
from offpolicy_jax.step import run_state
from offpolicy_jax.step.run_state import (
  LagSchedule,
  RunState,
  Sampled,
  SampledSeeds,
  StepFns,
  weights,
)


def behaviour_params(state: RunState, step, schedule: LagSchedule):
  """Parameters after loop step v(step), chosen on device: `(params, v, found)`."""
  if state.snapshots is None:
    return state.train.params, jnp.asarray(step - 1, jnp.int32), jnp.array(True)
  v = lag.behavior_version(step, *schedule)
  stored, found = lag.snapshot_get(state.snapshots, v)
  own = v == step - 1  # on-policy for this step: the trainer's own parameters
  params = jax.tree.map(lambda a, b: jax.lax.select(own, a, b), state.train.params, stored)
  return params, v, own | found


def rollout(fns: StepFns, state: RunState, prompts: dict, step, seed, schedule):
  """The rollout half of a step with a traced rollout: behaviour parameters, then `advance`.

  Returns:
    `(rstate, finished, info, v, found)`: the rollout's carried state, the
    groups to pack (`protocol.Finished`), its metrics, the behaviour loop step
    and whether its snapshot was present.
  """
  params, v, found = behaviour_params(state, step, schedule)
  key = run_state.step_key(seed, step, run_state.SAMPLE)
  rstate, fin, info = fns.rollout.advance(
    state.rollout, weights(state, params), fns.learner.version(v), prompts, step, key
  )
  return rstate, fin, info, v, found


def sample(
  fns: StepFns, progs, rollout: Rollout, state, prompts: dict, step: int, seed: int, schedule
):
  """The acting half of step `step` from the host (module docstring); asynchronous when traced."""
  mesh = fns.model.mesh
  step_a, seed_a = sharding.replicated_int(mesh, step), sharding.replicated_int(mesh, seed)
  if rollout.traced:
    device = prompt_rows.device_prompts(prompts)
    rstate, fin, info, v, found = progs.rollout(state, device, step_a, seed_a, schedule)
    # A traced rollout's groups are the step's prompts: they keep their host fields.
    return Sampled(rstate, fin._replace(prompts={**prompts, **fin.prompts}), info, {}, v, found)
  params, v, found = progs.behaviour(state, step_a, schedule)
  version = fns.learner.version(int(v))
  args = (weights(state, params), version, prompts, step, seed)
  rstate, fin, host = advance(rollout, state.rollout, *args)
  return Sampled(rstate, fin, {}, host, v, found)


def advance(rollout: Rollout, rstate, params, version, prompts: dict, step: int, seed, latest=None):
  """`rollout.advance` from the host with the step's sampling key: `(rstate, fin, info)`.

  `params` are the whole behaviour model at `version`; `latest` (`Rollout.advance`)
  lets episodes continue under parameters published while they run (async mode).
  A traced kind that carries state (partial rollouts' pool) advances as one
  jitted program over the prompts' device fields, so its state stays on device.
  """
  key = run_state.step_key(seed, step, run_state.SAMPLE)
  if rollout.traced and rollout.item:
    device = prompt_rows.device_prompts(prompts)
    return _advance_jit(rollout, rstate, params, jnp.int32(version), device, jnp.int32(step), key)
  return rollout.advance(rstate, params, version, prompts, step, key, latest)


@functools.partial(jax.jit, static_argnums=0)
def _advance_jit(rollout: Rollout, rstate, params, version, prompts: dict, step, key):
  return rollout.advance(rstate, params, version, prompts, step, key)


def sample_over_seeds(
  fns: StepFns, progs, state, prompts: dict, step, seeds, schedule
) -> SampledSeeds:
  """The acting half of step `step` of S seeds' runs (the study's vmapped `state`).

  A traced rollout runs as the vmapped `Programs.rollout`; a host rollout
  runs per seed, with that seed's behaviour parameters and key.
  """
  rollout = fns.rollout
  seeds_l = np.asarray(seeds).tolist()
  if rollout.traced:
    device = prompt_rows.device_prompts(prompts)
    rstate, fin, info, v, found = progs.rollout(state, device, step, seeds, schedule)
    stacked = prompt_rows.device_finished(fin)  # already [S, ...]: sliced per seed only for scoring
    fin = fin._replace(prompts={**prompts, **fin.prompts})
    per_seed = [jax.tree.map(lambda x, s=s: x[s], fin) for s in range(len(seeds_l))]
    return SampledSeeds(rstate, stacked, per_seed, info, [{} for _ in seeds_l], v, found)
  params, v, found = progs.behaviour(state, step, schedule)
  per_seed, host = [], []
  for s, seed in enumerate(seeds_l):
    one = {k: x[s] for k, x in prompts.items()}
    whole = weights(state, jax.tree.map(lambda x, s=s: x[s], params))
    version = fns.learner.version(int(v[s]))
    _, fin_s, host_s = advance(rollout, None, whole, version, one, int(step), seed)
    per_seed.append(fin_s)
    host.append(host_s)
  stack = lambda *x: jnp.stack([jnp.asarray(y) for y in x])
  stacked = jax.tree.map(stack, *map(prompt_rows.device_finished, per_seed))
  return SampledSeeds(None, stacked, per_seed, {}, host, v, found)
