"""The acting half of a step: the behaviour parameters of loop step t, then the rollout.

  v(t)     = m * floor((t - n - 1) / m)  (0 if t <= n)    behaviour version (loop steps)
  theta_mu = theta_{t-1} if v(t) = t - 1 else snapshot[v(t)]   (`lax.select`, no host sync)
  rollout  ~ pi_{theta_mu}(. | prompts_t)                 `Rollout.advance`

`rollout` is the traced half (inside the jitted step, or the jitted
`Programs.rollout` of a host step); `behaviour_params` alone is the
`Programs.behaviour` of a rollout that runs on the host. The acting half of
a step driven from the host (`host_step`) is `sample_traced` (the jitted
`Programs.rollout`) or `sample_host` (`advance` on the host under the
parameters of `Programs.behaviour`), chosen by the program builder
(`programs.acting_half`); each runs one seed's run or the study's S seeds
(`seeds.Seeds`: vmapped programs, each seed's host rollout on its own rows).
`advance` is `Rollout.advance` from the host with the step's sampling key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax import lag
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.step import run_state
from offpolicy_jax.step.run_state import LagSchedule, RunState, Sampled, StepFns, weights
from offpolicy_jax.step.seeds import Seeds


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


def sample_traced(
  fns: StepFns, progs, rollout: Rollout, state, prompts: dict, step: int, seeds: Seeds, schedule
) -> Sampled:
  """The acting half from the host with a traced rollout: its jitted program (asynchronous)."""
  step_a, seed_a = seeds.scalars(fns.model.mesh, step)
  device = prompt_rows.device_prompts(prompts)
  rstate, fin, info, v, found = progs.rollout(state, device, step_a, seed_a, schedule)
  # A traced rollout's groups are the step's prompts: they keep their host fields.
  whole = fin._replace(prompts={**prompts, **fin.prompts})
  per_seed = [seeds.take(whole, s) for s in range(len(seeds.ids))]
  host: list[dict] = [{} for _ in seeds.ids]
  return Sampled(rstate, prompt_rows.device_finished(fin), per_seed, info, host, v, found)


def sample_host(
  fns: StepFns, progs, rollout: Rollout, state, prompts: dict, step: int, seeds: Seeds, schedule
) -> Sampled:
  """The acting half from the host with a host rollout: each seed's `advance` under the
  parameters of the jitted `Programs.behaviour`, on that seed's prompts."""
  step_a, _ = seeds.scalars(fns.model.mesh, step)
  params, v, found = progs.behaviour(state, step_a, schedule)
  rstates, per_seed, host = [], [], []
  for s, seed in enumerate(seeds.ids):
    version = fns.learner.version(int(seeds.take(v, s)))
    whole = weights(state, seeds.take(params, s))
    one, carried = seeds.take(prompts, s), seeds.take(state.rollout, s)
    rstate, fin, info = advance(rollout, carried, whole, version, one, step, seed)
    rstates.append(rstate)
    per_seed.append(fin)
    host.append(info)
  device = seeds.stack([prompt_rows.device_finished(f) for f in per_seed])
  return Sampled(seeds.stack(rstates), device, per_seed, {}, host, v, found)


def advance(rollout: Rollout, rstate, params, version, prompts: dict, step: int, seed, latest=None):
  """`rollout.advance` from the host with the step's sampling key: `(rstate, fin, info)`.

  `params` are the whole behaviour model at `version`; `latest` (`Rollout.advance`)
  lets episodes continue under parameters published while they run (async mode).
  """
  key = run_state.step_key(seed, step, run_state.SAMPLE)
  return rollout.advance(rstate, params, version, prompts, step, key, latest)
