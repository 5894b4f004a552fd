"""One RL step as a pure function: ``rl_step(fns, opts, state, prompts, step, seed, lag)``.

Per loop step ``t`` (docs/science.md s5; Yao et al., "Group-relative REINFORCE is
secretly an off-policy algorithm", arXiv:2509.24203):

  v(t)     = m * floor((t - n - 1) / m)  (0 if t <= n)    behaviour version (loop steps)
  theta_mu = theta_{t-1} if v(t) = t - 1 else snapshot[v(t)]   (`lax.select`, no host sync)
  rollout  ~ pi_{theta_mu}(. | prompts_t)                 exact behaviour log-probs
  r        = reward(rollout);  A = advantages(r[G, K])
  buffer   = replay.add(buffer, batch);  batch = replay.sample(buffer)
  theta_t  = train_step(theta_{t-1}, batch)               U optimizer steps
  snapshot[t] = theta_t                                   when m divides t

The rollout is the run's `protocol.Rollout` (`StepFns.rollout`: whole
responses, partial rollouts, episodes, the episode pool), and every step is

  rollout (`advance`) -> score -> pack (`packing.pack`) -> learn

The two halves have their own modules: `acting` (the behaviour parameters,
then `advance`) and `learning` (pack, replay, train step, snapshot); this
module and `host_step` call them and hold no stage of their own. The run's
records (`StepFns`, `RunState`) are in `run_state`.

With a traced rollout and a device reward the whole step is one jitted
program and `rl_steps` scans `log_every` steps inside it (purejaxrl); with a
host reward or a host rollout it splits into the acting half and the jitted
`learning.learn_finished` (`host_step` drives both). The compiled programs of a run
are the named fields of a `programs.Programs` record.
`jax.vmap` over `(state, prompts, seed)` runs several seeds of the
device-reward step at once. Every PRNG key is a pure function of
`(seed, t, stream)`, so a resumed run reproduces an uninterrupted one.

Versions: the train step takes ``U`` optimizer steps per batch and versions
count optimizer steps, so the batch of step t records ``v(t) * U``
(`StepFns.learner.version`, the one place of that unit); the lag schedule (m, n)
counts loop steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax.step import acting, learning, scoring
from offpolicy_jax.step.run_state import ReplayOptions, RunState, StepFns


def rl_step(fns: StepFns, opts: ReplayOptions, state: RunState, prompts, step, seed, schedule):
  """One whole step of a traced rollout and a device reward (traceable, vmappable over seeds).

  rollout (`advance` under the behaviour parameters) -> device reward -> pack -> learn.
  """
  assert fns.reward.device is not None, "rl_step needs a device reward"
  rstate, fin, info, v, found = acting.rollout(fns, state, prompts, step, seed, schedule)
  rewards = scoring.score_on_device(fns, fin.prompts, fin.out)
  state, metrics = learning.learn_finished(
    fns, opts, state, rstate, fin, rewards, info, v, step, seed, schedule
  )
  metrics["snapshot_missing"] = (~found).astype(jnp.int32)
  return state, metrics


def rl_steps(fns: StepFns, opts: ReplayOptions, state, prompts_l, steps_l, seed, schedule):
  """`len(steps_l)` device-reward steps in one `lax.scan`; metrics stacked [L]."""

  base = state.base  # closed over, not carried: the loop carries only what changes

  def body(st, xs):
    prompts, step = xs
    st, metrics = rl_step(fns, opts, st._replace(base=base), prompts, step, seed, schedule)
    return st._replace(base=None), metrics

  state, metrics = jax.lax.scan(body, state._replace(base=None), (prompts_l, steps_l))
  return state._replace(base=base), metrics
