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
`learn_scored`. `jax.vmap` over `(state, prompts, seed)` runs several seeds of
the device-reward step at once. Every PRNG key is a pure function of
`(seed, t, stream)`, so a resumed run reproduces an uninterrupted one.

Versions: the train step takes ``U`` optimizer steps per batch and versions
count optimizer steps, so the batch of step t records ``v(t) * U``; the lag
schedule (m, n) counts loop steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from offpolicy_jax import lag
from offpolicy_jax.run import replay, rollouts, train_state, train_step
from offpolicy_jax.run.train_state import TrainState
from offpolicy_jax.sampling import partial as partial_rollouts
from offpolicy_jax.sampling import sampler as sampling
from offpolicy_jax.scale import sharding

# Streams of per-step randomness: key(seed, t, stream).
SAMPLE, ADV, REPLAY, TRAIN, EVAL, INIT = range(6)


def step_key(seed, step, stream: int) -> jax.Array:
  """The PRNG key of `stream` at loop step `step`: a pure function of (seed, step); traceable."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)


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
  """The model, task, loss, optimizer and jitted functions a run's steps use (no config, no state).

  Hashable by identity, so it is a static argument of the jitted steps: runs
  sharing one `StepFns` (see `components.build_components`) share compiled code.
  """

  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef
  tokenizer: Any
  task: Any
  model_fn: Callable[[int], Any]
  options: train_step.StepOptions
  optimizer: optax.GradientTransformation
  advantage: str
  sizes: rollouts.Sizes
  sample_kw: dict[str, Any]
  sampler: Callable
  greedy: Callable
  reward: rollouts.Reward
  truncate_prompts: bool
  model_key: str  # what the warm start depends on: model, task, shapes, mesh
  # The sampler's own mesh in a disaggregated run (`disagg`); None: it shares `mesh`.
  sampler_mesh: jax.sharding.Mesh | None = None
  cache: dict = dataclasses.field(default_factory=dict)
  partial: partial_rollouts.PartialSampler | None = (
    None  # partial rollouts (rollout.partial_budget)
  )

  @property
  def updates(self) -> int:
    """U: optimizer steps (parameter versions) per loop step."""
    return self.options.updates

  def init_params(self, seed: int):
    """Freshly initialised (from `seed`) or loaded parameters, placed on the mesh."""
    _, params = nnx.split(self.model_fn(seed))
    return sharding.shard_params(params, self.mesh)

  def pass_sampler(self, k: int) -> Callable:
    """The sampler of k responses per prompt at the training temperature (pass@k)."""
    key = ("pass_sampler", k)
    if key not in self.cache:
      kw = dict(self.sample_kw)
      self.cache[key] = sampling.make_sampler(self.graphdef, group_size=k, **kw)
    return self.cache[key]


class RunState(NamedTuple):
  """Everything a run carries from step to step (checkpointed by field name).

  Attributes:
    train: parameters, optimizer state and version counters.
    replay: the device-resident replay buffer.
    snapshots: parameter versions the lag schedule still needs (None on-policy
      or in async mode).
    ref_params: reference parameters of a KL-to-reference loss, or None.
    inflight: the pool of unfinished generations of partial rollouts, or None.
  """

  train: TrainState
  replay: replay.ReplayState
  snapshots: lag.SnapshotState | None
  ref_params: Any
  inflight: partial_rollouts.PartialState | None = None


def init_state(fns: StepFns, params, *, capacity_batches: int, snapshots: int) -> RunState:
  """A fresh `RunState` from `params` (copied), with `snapshots` slots (0: none)."""
  example = rollouts.empty_batch(fns.sizes)
  capacity = fns.sizes.prompts_per_step * capacity_batches
  buffer = replay.shard(replay.init(capacity, example, fns.sizes.group_size), fns.mesh)
  return RunState(
    train=train_state.init_train_state(params, fns.optimizer, mesh=fns.mesh),
    replay=buffer,
    snapshots=lag.snapshot_init(params, snapshots, 0) if snapshots else None,
    ref_params=jax.tree.map(jnp.copy, params) if fns.options.spec.needs_ref else None,
    inflight=None if fns.partial is None else _empty_pool(fns),
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
  )


def behaviour_version(step, schedule: LagSchedule) -> jax.Array:
  """`lag.behavior_version` on traced scalars: v(t) = 0 if t <= n else m * floor((t-n-1)/m)."""
  m, n = schedule
  return jnp.where(step <= n, 0, m * ((step - n - 1) // m)).astype(jnp.int32)


def behaviour_params(state: RunState, step, schedule: LagSchedule):
  """Parameters after loop step v(step), chosen on device: `(params, v, found)`."""
  if state.snapshots is None:
    return state.train.params, jnp.asarray(step - 1, jnp.int32), jnp.array(True)
  v = behaviour_version(step, schedule)
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
    step_key(seed, step, REPLAY),
    batch_size=fns.sizes.prompts_per_step,
    policy=opts.policy,
    max_reuse=opts.max_reuse,
    current_version=(step - 1) * fns.updates,
    temperature=opts.temperature,
  )
  stats = rollouts.batch_stats(sampled, fns.sizes.group_size)
  train, metrics = train_step.train_step(
    fns.graphdef,
    fns.optimizer,
    fns.options,
    state.train,
    sampled,
    step_key(seed, step, TRAIN),
    state.ref_params,
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
  key = step_key(seed, step, SAMPLE)
  out = fns.sampler(params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)
  return out, v, found


def learn_scored(fns, opts, state, prompts, out, rewards_b, v, step, seed, schedule):
  """Second half of a step: packs the scored rollout and learns from it."""
  batch = rollouts.pack(
    fns.sizes, fns.advantage, prompts, out, rewards_b, v * fns.updates, step_key(seed, step, ADV)
  )
  state, metrics = learn(fns, opts, state, batch, step, seed, schedule)
  metrics["behavior_version"] = v * fns.updates
  return state, metrics


def rl_step(fns: StepFns, opts: ReplayOptions, state: RunState, prompts, step, seed, schedule):
  """One whole step for a task with a device reward (traceable, vmappable over seeds)."""
  if state.inflight is not None:
    return partial_rl_step(fns, opts, state, prompts, step, seed, schedule)
  out, v, found = rollout(fns, state, prompts, step, seed, schedule)
  answers = jnp.repeat(prompts["answer_tokens"], fns.sizes.group_size, axis=0)
  assert fns.reward.device is not None, "rl_step needs a device reward"
  rewards_b = fns.reward.device(answers, out.tokens, out.mask)
  state, metrics = learn_scored(fns, opts, state, prompts, out, rewards_b, v, step, seed, schedule)
  metrics["snapshot_missing"] = (~found).astype(jnp.int32)
  return state, metrics


def partial_rl_step(
  fns: StepFns, opts: ReplayOptions, state: RunState, prompts, step, seed, schedule
):
  """A device-reward step with partial rollouts (`partial_rollouts`).

  The step's prompts join the in-flight pool, every unfinished row decodes at
  most `rollout.partial_budget` tokens with the behaviour parameters v(t) (its
  tokens record version v(t) * U), and the groups that have finished are
  scored, buffered and (FIFO) trained on.
  """
  params, v, found = behaviour_params(state, step, schedule)
  assert fns.partial is not None and fns.reward.device is not None and state.inflight is not None
  pool, dropped = partial_rollouts.admit(state.inflight, prompts, step)
  version = v * fns.updates
  pool = fns.partial.advance(params, pool, version, step_key(seed, step, SAMPLE))
  out = partial_rollouts.rollout(pool)
  answers = jnp.repeat(pool.prompts["answer_tokens"], fns.sizes.group_size, axis=0)
  rewards_r = fns.reward.device(answers, out.tokens, out.mask)
  key = step_key(seed, step, ADV)
  batch, keep, pool = partial_rollouts.emit(pool, rewards_r, fns.advantage, key)
  state, metrics = learn(
    fns, opts, state._replace(inflight=pool), batch, step, seed, schedule, keep
  )
  metrics |= partial_rollouts.stats(batch, keep, pool, dropped)
  metrics["behavior_version"] = version
  metrics["snapshot_missing"] = (~found).astype(jnp.int32)
  return state, metrics


def rl_steps(fns: StepFns, opts: ReplayOptions, state, prompts_l, steps_l, seed, schedule):
  """`len(steps_l)` device-reward steps in one `lax.scan`; metrics stacked [L]."""

  def body(st, xs):
    prompts, step = xs
    return rl_step(fns, opts, st, prompts, step, seed, schedule)

  return jax.lax.scan(body, state, (prompts_l, steps_l))


def _shardings(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def jitted(fns: StepFns, name: str, opts: ReplayOptions, state: RunState) -> Callable:
  """The jitted `rl_steps` / `rollout` / `learn_scored` / `learn` for this state's structure.

  The state is donated and keeps its shardings; metrics are replicated. Cached
  on `fns`, so runs that share it share the compiled programs.
  """
  structure = jax.tree.structure(state)
  key = (name, opts, structure)
  if key not in fns.cache:
    state_sh = _shardings(state)
    rep = sharding.replicated(fns.mesh)
    if name == "rl_steps":
      fn = functools.partial(rl_steps, fns, opts)
      out_sh: Any = (state_sh, rep)
      donate: tuple[int, ...] = (0,)
    elif name == "rollout":
      fn, out_sh, donate = functools.partial(rollout, fns), None, ()
    elif name == "learn":
      fn = functools.partial(learn, fns, opts)
      out_sh, donate = (state_sh, rep), (0,)
    else:
      fn = functools.partial(learn_scored, fns, opts)
      out_sh, donate = (state_sh, rep), (0,)
    fns.cache[key] = _with_mesh(jax.jit(fn, out_shardings=out_sh, donate_argnums=donate), fns.mesh)
  return fns.cache[key]


def _with_mesh(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
  """`fn` traced and run with `mesh` set, so activation constraints apply (`sharding.constrain`)."""

  def call(*args):
    with jax.set_mesh(mesh):
      return fn(*args)

  return call
