"""A run's compiled programs, by name: `programs(fns, opts, state) -> Programs`.

The pieces of a step (`rl_step`, `acting`, `learning`) jitted once per state
structure and shared by every run that shares its `StepFns` (memoised per
`fns`): `rl_steps` (L traced steps in one scan), the halves of a host step
(`rollout`, `learn_finished`), `learn` (the async loop's), and `behaviour`.
For one run (`seeds.Seeds.one`) they keep the state's shardings and donate
it; for a study's stacked seeds (`Seeds.many`) every program is `jax.vmap`ped
over a leading seed axis of the `SEED_ARGS` arguments. The frozen LoRA base
and a host rollout's state stay outside the programs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.scale import sharding
from offpolicy_jax.step import acting, run_state
from offpolicy_jax.step.learning import learn, learn_finished
from offpolicy_jax.step.rl_step import rl_steps
from offpolicy_jax.step.run_state import ReplayOptions, RunState, StepFns
from offpolicy_jax.step.seeds import Seeds


class Programs(NamedTuple):
  """A run's compiled programs, by name (`programs` builds them once per state structure).

  Attributes:
    rl_steps: `(state, prompts_l, steps_l, seed, schedule) -> (state, metrics [L])`,
      L device-reward steps in one scan.
    rollout: `(state, prompts, step, seed, schedule) -> (rstate, fin, info, v, found)`,
      the rollout half of a step with a traced rollout.
    learn_finished: `(state, rstate, fin, rewards, info, v, step, seed, schedule)
      -> (state, metrics)`, the learning half (pack, replay, train step).
    learn: `(state, batch, step, seed, schedule[, keep]) -> (state, metrics)`
      (`keep` bool [G']: the groups of `batch` to buffer).
    behaviour: `(state, step, schedule) -> (params, v, found)`.
  """

  rl_steps: Callable
  rollout: Callable
  learn_finished: Callable
  learn: Callable
  behaviour: Callable


# The arguments that carry a leading seed axis in the vmapped study programs
# (matched by parameter name, so a signature change cannot silently misalign them).
SEED_ARGS = frozenset(
  {
    "state",
    "prompts",
    "prompts_l",
    "rstate",
    "fin",
    "rewards",
    "info",
    "v",
    "seed",
    "batch",
    "keep",
  }
)
# Functions whose state argument is donated.
_DONATES_STATE = ("rl_steps", "learn_finished", "learn")


def programs(
  fns: StepFns, opts: ReplayOptions, state: RunState, *, seeds: Seeds | None = None
) -> Programs:
  """The jitted programs of a run whose state has `state`'s structure (built once, shared).

  The state is donated; for one run (`seeds` None or `Seeds.one`) it keeps
  its shardings and metrics are replicated. For stacked seeds (`Seeds.many`)
  every program is `jax.vmap`ped over a leading seed axis of the `SEED_ARGS`
  arguments (the study).
  Programs are memoised per `fns`, so runs that share it share them.
  """
  memo = fns.memo.setdefault("programs", {})
  stacked = seeds is not None and seeds.stacked
  key = (opts, jax.tree.structure(_traced(fns, state)), stacked)
  if key not in memo:
    fns_of: dict[str, Callable] = {
      "rl_steps": functools.partial(rl_steps, fns, opts),
      "rollout": functools.partial(acting.rollout, fns),
      "learn_finished": functools.partial(learn_finished, fns, opts),
      "learn": functools.partial(learn, fns, opts),
      "behaviour": acting.behaviour_params,
    }
    build = _vmapped if stacked else _sharded
    memo[key] = Programs(**{name: build(fns, name, fn, state) for name, fn in fns_of.items()})
  return memo[key]


def one_program(fns: StepFns) -> bool:
  """Whether a whole step of `fns` is one jitted program (a traced rollout, a device reward)."""
  return fns.rollout.traced and fns.reward.device is not None


def acting_half(rollout: Rollout) -> Callable:
  """The acting half of a host step with `rollout`: its jitted program (`acting.sample_traced`)
  for a traced rollout, else `advance` on the host (`acting.sample_host`)."""
  return acting.sample_traced if rollout.traced else acting.sample_host


def advance(rollout: Rollout, rstate, params, version, prompts: dict, step: int, seed, latest=None):
  """`acting.advance` (`Rollout.advance` from the host); a traced kind that carries state
  (partial rollouts' pool) advances as one jitted program over the prompts' device
  fields, so its state stays on device (the async producer's acting half)."""
  if rollout.traced and rollout.item:
    key = run_state.step_key(seed, step, run_state.SAMPLE)
    device = prompt_rows.device_prompts(prompts)
    return _advance_jit(rollout, rstate, params, jnp.int32(version), device, jnp.int32(step), key)
  return acting.advance(rollout, rstate, params, version, prompts, step, seed, latest)


@functools.partial(jax.jit, static_argnums=0)
def _advance_jit(rollout: Rollout, rstate, params, version, prompts: dict, step, key):
  return rollout.advance(rstate, params, version, prompts, step, key)


def _base_apart(fn: Callable, donates: bool) -> Callable:
  """`fn(state, *args)` as `(base, state without base, *args)`, so the base is never donated.

  The frozen base (`RunState.base`) is an argument of its own: the donated
  state does not hold it, vmapped programs share it across seeds
  (`in_axes=None`), and a sampler thread can read it while the trainer runs.
  """

  def apart(base, state, *args):
    out = fn(state._replace(base=base), *args)
    return (out[0]._replace(base=None), *out[1:]) if donates else out

  return apart


def _traced(fns: StepFns, state: RunState) -> RunState:
  """The part of `state` the programs trace: no base, and no host rollout's state.

  A rollout that runs on the host (`Rollout.traced` false, e.g. the episode
  pool) carries host objects; they stay outside the programs and go back into
  the state they return.
  """
  return state._replace(base=None, rollout=state.rollout if fns.rollout.traced else None)


def _base_back(fns: StepFns, jitted: Callable, donates: bool, name: str) -> Callable:
  def call(state, *args):
    if name == "learn_finished" and not fns.rollout.traced:
      # A host rollout's state after `advance` (`args[0]`) joins the state outside the program.
      state, args = state._replace(rollout=args[0]), (None, *args[1:])
    out = jitted(state.base, _traced(fns, state), *args)
    if not donates:
      return out
    back = out[0]._replace(base=state.base)
    if not fns.rollout.traced:
      back = back._replace(rollout=state.rollout)
    return (back, *out[1:])

  return call


def _sharded(fns: StepFns, name: str, fn: Callable, state: RunState) -> Callable:
  state_sh = jax.tree.map(lambda x: x.sharding, _traced(fns, state))
  rep = sharding.replicated(fns.model.mesh)
  donates = name in _DONATES_STATE
  apart = _base_apart(fn, donates)
  if donates:
    jitted = jax.jit(apart, out_shardings=(state_sh, rep), donate_argnums=1)
  elif name == "behaviour":
    params_sh = jax.tree.map(lambda x: x.sharding, state.train.params)
    jitted = jax.jit(apart, out_shardings=(params_sh, rep, rep))
  else:
    jitted = jax.jit(apart)
  return _with_mesh(_base_back(fns, jitted, donates, name), fns.model.mesh)


def _vmapped(fns: StepFns, name: str, fn: Callable, state: RunState) -> Callable:
  params = list(inspect.signature(fn).parameters)
  in_axes = (None, *(0 if p in SEED_ARGS else None for p in params))
  donates = name in _DONATES_STATE
  vmapped = jax.vmap(_base_apart(fn, donates), in_axes=in_axes)
  jitted = jax.jit(vmapped, donate_argnums=1 if donates else ())
  return _with_mesh(_base_back(fns, jitted, donates, name), fns.model.mesh)


def _with_mesh(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
  """`fn` traced and run with `mesh` set, so activation constraints apply (`sharding.constrain`)."""

  def call(*args):
    with jax.set_mesh(mesh):
      return fn(*args)

  return call
