"""The records of a run: its static parts (`StepFns`) and its carried state (`RunState`).

`StepFns` is what a run's steps are built from (model, learner, task,
rollout, samplers), made once in `components`; `RunState` is what a run
carries from step to step, checkpointed by name (`state_items`,
`state_from_items`; `init_state` makes a fresh one, `weights` joins its
parameters to a LoRA run's frozen base). `Sampled` is what a host
step's acting half hands to its learning half. `StepFns`' small
records are here too: the batch shape
(`Sizes`, and `empty_batch`, the replay buffer's template), what packing
needs (`Packing`) and the task's reward (`Reward`); so are the step's
options: how the train batch is drawn (`ReplayOptions`) and the sync
schedule (m, n) (`LagSchedule`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax import lag, models
from offpolicy_jax.learn import replay, step_options, train_state
from offpolicy_jax.learn.train_state import TrainState
from offpolicy_jax.models import moe
from offpolicy_jax.models.parts import ModelParts
from offpolicy_jax.rewards import tasks
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.prompt_filter import PromptFilter
from offpolicy_jax.rollout.prompt_rows import Sizes
from offpolicy_jax.rollout.protocol import EvalRows, Finished, Rollout
from offpolicy_jax.sampling import Sampler
from offpolicy_jax.types import TrainBatch

# Streams of per-step randomness: step_key(seed, t, stream).
SAMPLE, ADV, REPLAY, TRAIN, EVAL, INIT = range(6)


class Packing(NamedTuple):
  """What `pack` needs of a run: group size K, the advantage estimator, the turn discount.

  `gamma` discounts turn rewards under `multiturn.credit = "turn"` (`advantages.per_turn`);
  `token_rewards`: the batch keeps those rewards on their turns' last tokens for a critic
  (`TrainBatch.token_rewards`).
  """

  group_size: int
  advantage: str
  gamma: float = 1.0
  token_rewards: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Reward:
  """A task's reward: a jitted device function, or a host function scored in sandboxed workers."""

  device: Callable | None = None
  host: Callable | None = None
  pool: Any = None
  timeout_s: float = 5.0
  batch_timeout_s: float | None = None


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
    packing: what `packing.pack` needs: group size, advantage estimator, turn discount.
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
    prompt_filter: the choice of each step's prompts among candidates by the
      critic's values (`rollout.prompt_filter`), or None: every prompt read is sampled.
  """

  model: ModelParts
  learner: step_options.LearnerParts
  task: tasks.Task
  sizes: Sizes
  packing: Packing
  reward: Reward
  truncate_prompts: bool
  rollout: Rollout
  sampler: Sampler
  eval_sampler: Callable[[int], Sampler]
  eval_rows: Callable[..., list[EvalRows]]
  sampler_mesh: jax.sharding.Mesh | None = None
  continuous: Sampler | None = None
  continuous_auto_steps: int = 0
  prompt_filter: PromptFilter | None = None
  # What is built once per StepFns (its jitted `Programs`, eval batches and samplers),
  # kept on it so that it goes when the StepFns goes. (In a module-level
  # WeakKeyDictionary the values, closures over their key, kept every StepFns and
  # its compiled programs alive: ~2k memory mappings and ~100 MB per run of a sweep.)
  # Not an init argument: `dataclasses.replace` gives a copy its own, empty memo.
  memo: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)

  def prompts(self, seed: int, split: str = "train", batch_size: int | None = None):
    """The run's prompt iterator (`prompt_rows.prompt_iterator`), shuffled by `seed`.

    No `batch_size`: training batches, this process's block of rows; an
    explicit one (evaluation, warm start) reads the whole split.
    """
    return prompt_rows.prompt_iterator(
      self.task,
      self.model.tokenizer,
      self.sizes,
      seed,
      split,
      batch_size=batch_size,
      truncate=self.truncate_prompts,
      candidates=self.prompt_filter.pool if self.prompt_filter else 1,
    )


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


class Sampled(NamedTuple):
  """The acting half of a step from the host (`acting.sample_traced` / `sample_host`), handed
  to the learning half; one run's, or the study's S seeds' (`seeds.Seeds`).

  Attributes:
    rstate: the rollout's carried state after `advance`.
    fin: the finished groups' device fields (stacked [S, ...] over the study's
      seeds), into the jitted learning.
    per_seed: each seed's finished groups with their host fields (scored per seed).
    info: the rollout's device metrics (a traced rollout's), into the jitted learning.
    host: each seed's host metrics (a host rollout's, or a placement's).
    v: the behaviour loop step (device scalar, or [S]).
    found: whether its snapshot was present (scalar, or [S]).
  """

  rstate: Any
  fin: Finished
  per_seed: list[Finished]
  info: dict[str, Any]
  host: list[dict[str, Any]]
  v: Any
  found: Any


def weights(state: RunState, params=None):
  """The whole model state of `params` (default: the trainer's) over the run's base."""
  return models.lora.join(state.base, state.train.params if params is None else params)


def empty_batch(sizes: Sizes) -> TrainBatch:
  """A zero `TrainBatch` of the run's shape (the replay buffer's template)."""
  b, n, p = sizes.prompts_per_step * sizes.group_size, sizes.max_new_tokens, sizes.max_prompt_len
  f = lambda *s: jnp.zeros(s, jnp.float32)
  i = lambda *s: jnp.zeros(s, jnp.int32)
  adv = f(b, n) if sizes.token_advantages else f(b)
  experts: tuple[jax.Array | None, jax.Array | None] = (None, None)
  if sizes.routing is not None:
    layers, k, e = sizes.routing
    index = moe.index_dtype(e)
    experts = (jnp.zeros((b, p, layers, k), index), jnp.zeros((b, n, layers, k), index))
  return TrainBatch(
    i(b, p),
    f(b, p),
    i(b, n),
    f(b, n),
    f(b, n),
    adv,
    f(b),
    i(b, n),
    f(b),
    i(b, n),
    f(b, n),
    *experts,
    token_rewards=f(b, n) if sizes.token_rewards else None,
  )


def init_state(
  fns: StepFns, params, *, capacity_batches: int, snapshots: int, base=None
) -> RunState:
  """A fresh `RunState` from trainable `params` (copied), with `snapshots` slots (0: none).

  With adapters, `params` is the adapter and `base` the frozen rest (`StepFns.model.split`).
  """
  example = empty_batch(fns.sizes)
  capacity = fns.sizes.prompts_per_step * capacity_batches
  buffer = replay.shard(replay.init(capacity, example, fns.sizes.group_size), fns.model.mesh)
  return RunState(
    train=train_state.init_train_state(
      params, fns.learner.optimizer, mesh=fns.model.mesh, reward_stats=fns.learner.reward_stats
    ),
    replay=buffer,
    snapshots=lag.snapshot_init(params, snapshots, 0) if snapshots else None,
    ref_params=jax.tree.map(jnp.copy, params) if fns.learner.options.needs_ref else None,
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
    "counters": {"step": t.step, "version": t.version, "num_skipped": t.num_skipped}
    | ({} if t.reward_stats is None else {"reward_stats": t.reward_stats}),
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
  stats = c.get("reward_stats") if like.train.reward_stats is not None else None
  train = TrainState(
    items["params"], items["opt_state"], c["step"], c["version"], c["num_skipped"], stats
  )
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


def step_key(seed, step, stream: int) -> jax.Array:
  """The PRNG key of `stream` at loop step `step`: a pure function of (seed, step); traceable."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)
