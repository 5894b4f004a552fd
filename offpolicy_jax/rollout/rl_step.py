"""One RL step as a pure function: ``rl_step(fns, opts, state, prompts, step, seed, lag)``.

Per loop step ``t`` (SCIENCE.md s5; Yao et al., "Group-relative REINFORCE is
secretly an off-policy algorithm", arXiv:2509.24203):

  v(t)     = m * floor((t - n - 1) / m)  (0 if t <= n)    behaviour version (loop steps)
  theta_mu = theta_{t-1} if v(t) = t - 1 else snapshot[v(t)]   (`lax.select`, no host sync)
  rollout  ~ pi_{theta_mu}(. | prompts_t)                 exact behaviour log-probs
  r        = reward(rollout);  A = advantages(r[G, K])
  buffer   = replay.add(buffer, batch);  batch = replay.sample(buffer)
  theta_t  = train_step(theta_{t-1}, batch)               U optimizer steps
  snapshot[t] = theta_t                                   when m divides t

Every piece is pure and traceable: with a device reward the whole step is one
jitted program and `rl_steps` scans `log_every` steps inside it (purejaxrl);
with a host reward it splits at the reward boundary into `rollout` and
`learn_scored`. Sampling, scoring and packing are `pipeline`'s; the compiled
programs of a run are the named fields of a `Programs` record (`programs`).
`jax.vmap` over `(state, prompts, seed)` runs several seeds of the
device-reward step at once. Every PRNG key is a pure function of
`(seed, t, stream)`, so a resumed run reproduces an uninterrupted one.

Versions: the train step takes ``U`` optimizer steps per batch and versions
count optimizer steps, so the batch of step t records ``v(t) * U``
(`StepFns.version`, the one place of that unit); the lag schedule (m, n)
counts loop steps.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from offpolicy_jax import lag, models
from offpolicy_jax.learn import replay, train_state, train_step
from offpolicy_jax.learn.train_state import TrainState
from offpolicy_jax.rollout import pipeline
from offpolicy_jax.sampling import partial as partial_rollouts
from offpolicy_jax.scale import sharding


class ReplayOptions(NamedTuple):
  """How the train batch is drawn from the replay buffer (`replay.sample`)."""

  policy: str = "fifo"
  max_reuse: int | None = 1
  temperature: float = 1.0


class LagSchedule(NamedTuple):
  """The sync schedule (m, n) in loop steps, as traced scalars (changing it does not recompile)."""

  sync_interval: jax.Array
  sync_offset: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class StepFns:
  """The static parts a run's steps are built from: model, task, loss, optimizer, samplers.

  Frozen, and hashable by identity, so it is a static argument of the jitted
  steps: runs sharing one `StepFns` (see `components.build_components`) share
  their compiled `Programs`. It holds no config, no state and no cache.
  """

  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef
  tokenizer: Any
  task: Any
  model_fn: Callable[[int], Any]
  options: train_step.StepOptions
  optimizer: optax.GradientTransformation
  advantage: str
  sizes: pipeline.Sizes
  sample_kw: dict[str, Any]
  sampler: Callable
  greedy: Callable
  reward: pipeline.Reward
  truncate_prompts: bool
  model_key: str  # what the warm start depends on: model, task, shapes, mesh
  # The sampler's own mesh in a disaggregated run (`disagg`); None: it shares `mesh`.
  sampler_mesh: jax.sharding.Mesh | None = None
  partial: partial_rollouts.PartialSampler | None = (
    None  # partial rollouts (rollout.partial_budget)
  )
  # The learner's scoring of sampled tokens at the sampling parameters (log pi_old,
  # `train_step.make_scorer`), with `rollout.score_old`; None: not scored.
  score_old: Callable | None = None
  # Low-rank adapters (`lora.rank > 0`): the trained parameters are the adapters.
  lora: models.LoraConfig | None = None
  # The continuous-batching sampler (`rollout.continuous_slots` > 0), or None. `sampler`
  # is this one unless `rollout.continuous_auto_steps` > 0: then the run starts static
  # and may switch to it after that many steps (`sampler_choice`).
  continuous: Callable | None = None
  continuous_auto_steps: int = 0
  # Multi-turn episodes (`multiturn.max_turns > 0`, `rollout.episodes.Episodes`); None: single-turn.
  episodes: Any = None

  @property
  def updates(self) -> int:
    """U: optimizer steps (parameter versions) per loop step."""
    return self.options.updates

  def version(self, loop_step):
    """The parameter version (optimizer steps) after loop step `loop_step`: `loop_step * U`."""
    return loop_step * self.options.updates

  def init_params(self, seed: int):
    """Freshly initialised (from `seed`) or loaded parameters, placed on the mesh.

    The whole model's state; with adapters, `split` separates base and adapters.
    """
    _, params = nnx.split(self.model_fn(seed))
    return sharding.shard_params(params, self.mesh)

  def split(self, params) -> tuple[Any, Any]:
    """`(base, trainable)` of a whole state: `(None, params)` without adapters."""
    if self.lora is None:
      return None, params
    return models.lora.split(params)


class RunState(NamedTuple):
  """Everything a run carries from step to step (checkpointed by field name).

  Attributes:
    train: parameters, optimizer state and version counters.
    replay: the device-resident replay buffer.
    snapshots: parameter versions the lag schedule still needs (None on-policy
      or in async mode).
    ref_params: reference parameters of a KL-to-reference loss, or None.
    inflight: the pool of unfinished generations of partial rollouts, or None.
    base: with low-rank adapters, the frozen base weights the trained
      parameters adapt (`models.lora`), held once: every parameter field above
      (train params, snapshots, reference) is an adapter. Never donated nor
      checkpointed (the checkpoint records its fingerprint). None: the
      parameters are the whole model.

  With adapters, the reference policy is the fresh adapter (B = 0: the base).
  """

  train: TrainState
  replay: replay.ReplayState
  snapshots: lag.SnapshotState | None
  ref_params: Any
  inflight: partial_rollouts.PartialState | None = None
  base: Any = None


def weights(state: RunState, params=None):
  """The whole model state of `params` (default: the trainer's) over the run's base."""
  return models.lora.join(state.base, state.train.params if params is None else params)


def init_state(
  fns: StepFns, params, *, capacity_batches: int, snapshots: int, base=None
) -> RunState:
  """A fresh `RunState` from trainable `params` (copied), with `snapshots` slots (0: none).

  With adapters, `params` is the adapter and `base` the frozen rest (`StepFns.split`).
  """
  example = pipeline.empty_batch(fns.sizes)
  capacity = fns.sizes.prompts_per_step * capacity_batches
  buffer = replay.shard(replay.init(capacity, example, fns.sizes.group_size), fns.mesh)
  return RunState(
    train=train_state.init_train_state(params, fns.optimizer, mesh=fns.mesh),
    replay=buffer,
    snapshots=lag.snapshot_init(params, snapshots, 0) if snapshots else None,
    ref_params=jax.tree.map(jnp.copy, params) if fns.options.spec.needs_ref else None,
    inflight=None if fns.partial is None else _empty_pool(fns),
    base=base,
  )


def _empty_pool(fns: StepFns) -> partial_rollouts.PartialState:
  """An empty in-flight pool for the run's prompt batches, placed on the mesh."""
  assert fns.partial is not None
  g, p = fns.sizes.prompts_per_step, fns.sizes.max_prompt_len
  a = fns.task.max_answer_len + 1  # data.prompt_iterator's answer length
  example = {
    "prompt_tokens": jnp.zeros((g, p), jnp.int32),
    "prompt_lengths": jnp.zeros((g,), jnp.int32),
    "answer_tokens": jnp.zeros((g, a), jnp.int32),
  }
  return partial_rollouts.shard(fns.partial.init(example), fns.mesh)


def state_items(state: RunState) -> dict[str, Any]:
  """The checkpoint items of a run state, by name (None fields are left out)."""
  t = state.train
  items = {
    "params": t.params,
    "opt_state": t.opt_state,
    "counters": {"step": t.step, "version": t.version, "num_skipped": t.num_skipped},
    "replay": state.replay,
    "snapshots": state.snapshots,
    "ref_params": state.ref_params,
    "inflight": state.inflight,
  }
  return {k: v for k, v in items.items() if v is not None}


def state_from_items(items: dict[str, Any], like: RunState) -> RunState:
  """The `RunState` of restored checkpoint items (`like` says which fields are None)."""
  c = items["counters"]
  train = TrainState(items["params"], items["opt_state"], c["step"], c["version"], c["num_skipped"])
  return RunState(
    train=train,
    replay=items["replay"],
    snapshots=items.get("snapshots") if like.snapshots is not None else None,
    ref_params=items.get("ref_params") if like.ref_params is not None else None,
    inflight=items.get("inflight") if like.inflight is not None else None,
    base=like.base,
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


def learn(
  fns: StepFns, opts: ReplayOptions, state: RunState, batch, step, seed, schedule, keep=None
):
  """Buffers `batch`, draws the step's training batch, takes U optimizer steps, snapshots.

  With `keep` (bool [G'] over the groups of `batch`), only the kept groups are
  buffered (partial rollouts emit a variable number per step).
  """
  buffer, sampled, info = replay.sample(
    replay.add(state.replay, batch, keep),
    pipeline.step_key(seed, step, pipeline.REPLAY),
    batch_size=fns.sizes.prompts_per_step,
    policy=opts.policy,
    max_reuse=opts.max_reuse,
    current_version=fns.version(step - 1),
    temperature=opts.temperature,
  )
  stats = pipeline.batch_stats(sampled, fns.sizes.group_size)
  train, metrics = train_step.train_step(
    fns.graphdef,
    fns.optimizer,
    fns.options,
    state.train,
    sampled,
    pipeline.step_key(seed, step, pipeline.TRAIN),
    state.ref_params,
    base=state.base,
  )
  snapshots = state.snapshots
  if snapshots is not None:
    snapshots = jax.lax.cond(
      step % schedule.sync_interval == 0,
      lambda s: lag.snapshot_update(s, train.params, step),
      lambda s: s,
      snapshots,
    )
  state = state._replace(train=train, replay=buffer, snapshots=snapshots)
  return state, {**stats, **metrics, "replay_selected": info.num_selected}


def rollout(fns: StepFns, state: RunState, prompts: dict, step, seed, schedule):
  """First half of a host-reward step: samples with the behaviour parameters.

  Returns:
    `(rollout, v, found)`: the sampler's output, the behaviour loop step and
    whether its snapshot was present.
  """
  params, v, found = behaviour_params(state, step, schedule)
  return pipeline.sample(fns, weights(state, params), prompts, step, seed), v, found


def learn_scored(fns, opts, state, prompts, out, rewards_b, v, step, seed, schedule):
  """Second half of a step: packs the scored rollout and learns from it."""
  key = pipeline.step_key(seed, step, pipeline.ADV)
  batch = pipeline.pack(fns, prompts, out, rewards_b, fns.version(v), key)
  state, metrics = learn(fns, opts, state, batch, step, seed, schedule)
  metrics["behavior_version"] = fns.version(v)
  metrics["sampler/decode_waste"] = pipeline.decode_waste(out.mask)
  return state, metrics


def rl_step(fns: StepFns, opts: ReplayOptions, state: RunState, prompts, step, seed, schedule):
  """One whole step for a task with a device reward (traceable, vmappable over seeds)."""
  assert fns.reward.device is not None, "rl_step needs a device reward"
  if state.inflight is not None:
    return partial_rl_step(fns, opts, state, prompts, step, seed, schedule)
  out, v, found = rollout(fns, state, prompts, step, seed, schedule)
  rewards_b = pipeline.score_on_device(fns, prompts, out)
  state, metrics = learn_scored(fns, opts, state, prompts, out, rewards_b, v, step, seed, schedule)
  metrics["snapshot_missing"] = (~found).astype(jnp.int32)
  return state, metrics


def partial_rl_step(
  fns: StepFns, opts: ReplayOptions, state: RunState, prompts, step, seed, schedule
):
  """A device-reward step with partial rollouts (`sampling.partial`).

  The step's prompts join the in-flight pool, every unfinished row decodes at
  most `rollout.partial_budget` tokens with the behaviour parameters v(t) (its
  tokens record version v(t) * U), and the groups that have finished are
  scored, buffered and (FIFO) trained on.
  """
  params, v, found = behaviour_params(state, step, schedule)
  params = weights(state, params)
  assert fns.partial is not None and state.inflight is not None
  pool, dropped = partial_rollouts.admit(state.inflight, prompts, step)
  version = fns.version(v)
  pool = fns.partial.advance(params, pool, version, pipeline.step_key(seed, step, pipeline.SAMPLE))
  if fns.score_old is not None:
    old = fns.score_old(
      params,
      pool.prompts["prompt_tokens"],
      pool.prompts["prompt_lengths"],
      partial_rollouts.as_output(pool),
    )
    pool = partial_rollouts.record_old(pool, old, version)
  out = partial_rollouts.as_output(pool)
  rewards_r = pipeline.score_on_device(fns, pool.prompts, out)
  key = pipeline.step_key(seed, step, pipeline.ADV)
  batch, keep, pool = partial_rollouts.emit(pool, rewards_r, fns.advantage, key)
  state, metrics = learn(
    fns, opts, state._replace(inflight=pool), batch, step, seed, schedule, keep
  )
  metrics |= partial_rollouts.stats(batch, keep, pool, dropped)
  metrics["behavior_version"] = version
  metrics["snapshot_missing"] = (~found).astype(jnp.int32)
  return state, metrics


def host_reward_step(progs: Programs, state, prompts: dict, step, seed, schedule, score):
  """One step of a host-scored task: the compiled rollout, `score` on the host, the learning.

  Args:
    progs: the run's compiled programs (`programs`; vmapped over seeds in the study).
    state: the run state.
    prompts: the step's prompts (device and host fields).
    step: the loop step (traced scalar).
    seed: the run's seed(s).
    schedule: the `LagSchedule`.
    score: `rollout -> (rewards [B], host statistics)` (`pipeline.score`).

  Returns:
    `(state, metrics, host statistics, found)`.
  """
  device = {k: prompts[k] for k in pipeline.DEVICE_FIELDS}
  out, v, found = progs.rollout(state, device, step, seed, schedule)
  rewards_b, stats = score(out)
  state, metrics = progs.learn_scored(state, device, out, rewards_b, v, step, seed, schedule)
  return state, metrics, stats, found


def rl_steps(fns: StepFns, opts: ReplayOptions, state, prompts_l, steps_l, seed, schedule):
  """`len(steps_l)` device-reward steps in one `lax.scan`; metrics stacked [L]."""

  base = state.base  # closed over, not carried: the loop carries only what changes

  def body(st, xs):
    prompts, step = xs
    st, metrics = rl_step(fns, opts, st._replace(base=base), prompts, step, seed, schedule)
    return st._replace(base=None), metrics

  state, metrics = jax.lax.scan(body, state._replace(base=None), (prompts_l, steps_l))
  return state._replace(base=base), metrics


class Programs(NamedTuple):
  """A run's compiled programs, by name (`programs` builds them once per state structure).

  Attributes:
    rl_steps: `(state, prompts_l, steps_l, seed, schedule) -> (state, metrics [L])`,
      L device-reward steps in one scan.
    rollout: `(state, prompts, step, seed, schedule) -> (out, v, found)`.
    learn_scored: `(state, prompts, out, rewards_b, v, step, seed, schedule)
      -> (state, metrics)`.
    learn: `(state, batch, step, seed, schedule[, keep]) -> (state, metrics)`
      (`keep` bool [G']: the groups of `batch` to buffer).
    behaviour: `(state, step, schedule) -> (params, v, found)`.
  """

  rl_steps: Callable
  rollout: Callable
  learn_scored: Callable
  learn: Callable
  behaviour: Callable


# The arguments that carry a leading seed axis in the vmapped study programs
# (matched by parameter name, so a signature change cannot silently misalign them).
SEED_ARGS = frozenset({"state", "prompts", "prompts_l", "out", "rewards_b", "v", "seed", "batch"})
# Functions whose state argument is donated.
_DONATES_STATE = ("rl_steps", "learn_scored", "learn")

_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def programs(fns: StepFns, opts: ReplayOptions, state: RunState, *, over_seeds=False) -> Programs:
  """The jitted programs of a run whose state has `state`'s structure (built once, shared).

  The state is donated; without `over_seeds` it keeps its shardings and
  metrics are replicated. With `over_seeds` every program is `jax.vmap`ped
  over a leading seed axis of the `SEED_ARGS` arguments (the study).
  Programs are memoised per `fns`, so runs that share it share them.
  """
  memo = _PROGRAMS.setdefault(fns, {})
  key = (opts, jax.tree.structure(state), over_seeds)
  if key not in memo:
    fns_of: dict[str, Callable] = {
      "rl_steps": functools.partial(rl_steps, fns, opts),
      "rollout": functools.partial(rollout, fns),
      "learn_scored": functools.partial(learn_scored, fns, opts),
      "learn": functools.partial(learn, fns, opts),
      "behaviour": behaviour_params,
    }
    build = _vmapped if over_seeds else _sharded
    memo[key] = Programs(**{name: build(fns, name, fn, state) for name, fn in fns_of.items()})
  return memo[key]


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


def _base_back(jitted: Callable, donates: bool) -> Callable:
  def call(state, *args):
    out = jitted(state.base, state._replace(base=None), *args)
    return (out[0]._replace(base=state.base), *out[1:]) if donates else out

  return call


def _sharded(fns: StepFns, name: str, fn: Callable, state: RunState) -> Callable:
  state_sh = jax.tree.map(lambda x: x.sharding, state._replace(base=None))
  rep = sharding.replicated(fns.mesh)
  donates = name in _DONATES_STATE
  apart = _base_apart(fn, donates)
  if donates:
    jitted = jax.jit(apart, out_shardings=(state_sh, rep), donate_argnums=1)
  elif name == "behaviour":
    params_sh = jax.tree.map(lambda x: x.sharding, state.train.params)
    jitted = jax.jit(apart, out_shardings=(params_sh, rep, rep))
  else:
    jitted = jax.jit(apart)
  return _with_mesh(_base_back(jitted, donates), fns.mesh)


def _vmapped(fns: StepFns, name: str, fn: Callable, state: RunState) -> Callable:
  params = list(inspect.signature(fn).parameters)
  in_axes = (None, *(0 if p in SEED_ARGS else None for p in params))
  donates = name in _DONATES_STATE
  vmapped = jax.vmap(_base_apart(fn, donates), in_axes=in_axes)
  jitted = jax.jit(vmapped, donate_argnums=1 if donates else ())
  return _with_mesh(_base_back(jitted, donates), fns.mesh)


def _with_mesh(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
  """`fn` traced and run with `mesh` set, so activation constraints apply (`sharding.constrain`)."""

  def call(*args):
    with jax.set_mesh(mesh):
      return fn(*args)

  return call
