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

  rollout (`advance`) -> score -> pack (`pipeline.pack`) -> learn

With a traced rollout and a device reward the whole step is one jitted
program and `rl_steps` scans `log_every` steps inside it (purejaxrl); with a
host reward or a host rollout it splits into a rollout half and the jitted
`learn_finished` (`host_step` drives both). The compiled programs of a run
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

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax import lag, models
from offpolicy_jax.learn import replay, step_options, train_state, train_step
from offpolicy_jax.learn.train_state import TrainState
from offpolicy_jax.models.parts import ModelParts
from offpolicy_jax.rewards import tasks
from offpolicy_jax.rollout import pipeline
from offpolicy_jax.rollout.protocol import EvalRows, Finished, Rollout


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
  """The static parts a run's steps are built from: model, learner, task, rollout, samplers.

  Frozen, and hashable by identity, so it is a static argument of the jitted
  steps: runs sharing one `StepFns` (see `components.build_components`) share
  their compiled `Programs`. It holds no config and no state; `memo` holds
  what is built from it (programs, eval batches) for as long as it lives.
  Every choice of mode is made once, in `components`: the rollout kind, the
  sampler, the sampler mesh and how evaluation plays its rows.

  Attributes:
    model: the parameters' mesh, graph, initialiser, tokenizer and adapters.
    learner: the train step's options and optimizer; `learner.version` turns
      loop steps into parameter versions.
    task: the task (prompts, answers, its reward function).
    sizes: the static batch shape.
    packing: what `pipeline.pack` needs: group size, advantage estimator, turn discount.
    reward: the task's reward (device, or host in the sandboxed workers).
    truncate_prompts: cut prompts longer than `sizes.max_prompt_len` (else an error).
    rollout: how the run samples (`protocol.Rollout`).
    sampler: the behaviour sampler the rollout samples with.
    sampler_mesh: the sampler's own mesh in a disaggregated run; None: it
      shares `model.mesh`.
    continuous: the continuous-batching sampler (`rollout.continuous_slots`
      > 0), or None. `sampler` is this one unless `continuous_auto_steps` > 0:
      then the run starts static and may switch after that many steps
      (`sampler_choice`).
    eval_sampler: `k -> sampler` of evaluation: greedy for k = 1, else k
      samples per prompt at the training temperature.
    eval_rows: how evaluation plays and scores one batch of eval prompts
      (sampled responses, or episodes): `evaluation.sampled_rows` or
      `evaluation.episode_rows`, called as `eval_rows(fns, params, ...)`.
  """

  model: ModelParts
  learner: step_options.LearnerParts
  task: tasks.Task
  sizes: pipeline.Sizes
  packing: pipeline.Packing
  reward: pipeline.Reward
  truncate_prompts: bool
  rollout: Rollout
  sampler: Callable
  eval_sampler: Callable[[int], Callable]
  eval_rows: Callable[..., list[EvalRows]]
  sampler_mesh: jax.sharding.Mesh | None = None
  continuous: Callable | None = None
  continuous_auto_steps: int = 0
  # What is built once per StepFns (its jitted `Programs`, eval batches and samplers),
  # kept on it so that it goes when the StepFns goes. (In a module-level
  # WeakKeyDictionary the values, closures over their key, kept every StepFns and
  # its compiled programs alive: ~2k memory mappings and ~100 MB per run of a sweep.)
  # Not an init argument: `dataclasses.replace` gives a copy its own, empty memo.
  memo: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)


class RunState(NamedTuple):
  """Everything a run carries from step to step (checkpointed by field name).

  Attributes:
    train: parameters, optimizer state and version counters.
    replay: the device-resident replay buffer.
    snapshots: parameter versions the lag schedule still needs (None on-policy
      or in async mode).
    ref_params: reference parameters of a KL-to-reference loss, or None.
    rollout: the rollout's carried state (`Rollout.init`: the pool of partial
      rollouts, on device; the episodes in flight, on the host), or None.
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
  rollout: Any = None
  base: Any = None


def weights(state: RunState, params=None):
  """The whole model state of `params` (default: the trainer's) over the run's base."""
  return models.lora.join(state.base, state.train.params if params is None else params)


def init_state(
  fns: StepFns, params, *, capacity_batches: int, snapshots: int, base=None
) -> RunState:
  """A fresh `RunState` from trainable `params` (copied), with `snapshots` slots (0: none).

  With adapters, `params` is the adapter and `base` the frozen rest (`StepFns.model.split`).
  """
  example = pipeline.empty_batch(fns.sizes)
  capacity = fns.sizes.prompts_per_step * capacity_batches
  buffer = replay.shard(replay.init(capacity, example, fns.sizes.group_size), fns.model.mesh)
  return RunState(
    train=train_state.init_train_state(params, fns.learner.optimizer, mesh=fns.model.mesh),
    replay=buffer,
    snapshots=lag.snapshot_init(params, snapshots, 0) if snapshots else None,
    ref_params=jax.tree.map(jnp.copy, params) if fns.learner.options.spec.needs_ref else None,
    rollout=fns.rollout.init(),
    base=base,
  )


def state_items(state: RunState, rollout: Rollout) -> dict[str, Any]:
  """The checkpoint items of a run state, by name (None fields are left out).

  The rollout's carried state is the item `rollout.item` (`Rollout.arrays`).
  """
  t = state.train
  items = {
    "params": t.params,
    "opt_state": t.opt_state,
    "counters": {"step": t.step, "version": t.version, "num_skipped": t.num_skipped},
    "replay": state.replay,
    "snapshots": state.snapshots,
    "ref_params": state.ref_params,
  }
  if rollout.item:
    items[rollout.item] = rollout.arrays(state.rollout)
  return {k: v for k, v in items.items() if v is not None}


def state_meta(state: RunState, rollout: Rollout) -> dict[str, Any]:
  """The checkpoint meta of a run state: the rollout's signature and JSON part."""
  if not rollout.item:
    return {}
  return {"rollout": rollout.signature(), rollout.item: rollout.meta(state.rollout)}


def state_from_items(
  items: dict[str, Any], like: RunState, rollout: Rollout, meta: dict[str, Any]
) -> RunState:
  """The `RunState` of restored checkpoint items (`like` says which fields are None)."""
  c = items["counters"]
  train = TrainState(items["params"], items["opt_state"], c["step"], c["version"], c["num_skipped"])
  carried = like.rollout
  if rollout.item:
    carried = rollout.restore(like.rollout, items[rollout.item], meta.get(rollout.item) or {})
  return RunState(
    train=train,
    replay=items["replay"],
    snapshots=items.get("snapshots") if like.snapshots is not None else None,
    ref_params=items.get("ref_params") if like.ref_params is not None else None,
    rollout=carried,
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
    current_version=fns.learner.version(step - 1),
    temperature=opts.temperature,
  )
  stats = replay.batch_stats(sampled, fns.sizes.group_size)
  train, metrics = train_step.train_step(
    fns.model.graphdef,
    fns.learner.optimizer,
    fns.learner.options,
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
  """The rollout half of a step with a traced rollout: behaviour parameters, then `advance`.

  Returns:
    `(rstate, finished, info, v, found)`: the rollout's carried state, the
    groups to pack (`protocol.Finished`), its metrics, the behaviour loop step
    and whether its snapshot was present.
  """
  params, v, found = behaviour_params(state, step, schedule)
  key = pipeline.step_key(seed, step, pipeline.SAMPLE)
  rstate, fin, info = fns.rollout.advance(
    state.rollout, weights(state, params), fns.learner.version(v), prompts, step, key
  )
  return rstate, fin, info, v, found


def pack_finished(fns: StepFns, fin: Finished, rewards, step, seed, *, jitted: bool = False):
  """`(batch, keep)`: the finished groups packed (`pipeline.pack`), and which to buffer.

  `keep` (bool [G'], in batch order) is None when every group is kept.
  """
  packer = pipeline.pack_jit if jitted else pipeline.pack
  prompts = {k: fin.prompts[k] for k in pipeline.DEVICE_FIELDS if k in fin.prompts}
  key = pipeline.step_key(seed, step, pipeline.ADV)
  args = (fin.out, rewards, fin.versions, key, fin.valid, fin.order)
  batch = packer(fns.packing, prompts, *args)
  keep = fin.valid
  if keep is not None and fin.order is not None:
    keep = jnp.asarray(keep)[jnp.asarray(fin.order)]
  return batch, keep


def learn_finished(
  fns: StepFns,
  opts: ReplayOptions,
  state: RunState,
  rstate,
  fin: Finished,
  rewards,
  info,
  v,
  step,
  seed,
  schedule,
):
  """The learning half of a step: packs the scored groups, learns from them (traceable).

  Args:
    rstate: the rollout's carried state after this step's `advance`.
    fin: the groups the rollout finished; `rewards`: their rewards.
    info: the rollout's metrics (they join the step's).
    v: the behaviour loop step.
  """
  batch, keep = pack_finished(fns, fin, rewards, step, seed)
  state, metrics = learn(
    fns, opts, state._replace(rollout=rstate), batch, step, seed, schedule, keep
  )
  metrics = {**metrics, **info, "behavior_version": fns.learner.version(v)}
  return state, metrics


def rl_step(fns: StepFns, opts: ReplayOptions, state: RunState, prompts, step, seed, schedule):
  """One whole step of a traced rollout and a device reward (traceable, vmappable over seeds).

  rollout (`advance` under the behaviour parameters) -> device reward -> pack -> learn.
  """
  assert fns.reward.device is not None, "rl_step needs a device reward"
  rstate, fin, info, v, found = rollout(fns, state, prompts, step, seed, schedule)
  rewards = pipeline.score_on_device(fns, fin.prompts, fin.out)
  state, metrics = learn_finished(
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
