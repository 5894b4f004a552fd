"""The learning half of a step: pack the scored groups, buffer them, train, snapshot.

  batch    = pack(finished groups, rewards)               `packing.pack`
  buffer   = replay.add(buffer, batch);  batch = replay.sample(buffer)
  theta_t  = train_step(theta_{t-1}, batch)               U optimizer steps
  snapshot[t] = theta_t                                   when m divides t

`learn_finished` is the half after a rollout (`Programs.learn_finished`);
`learn` alone takes an already packed batch (the async trainer's
`Programs.learn`). `learn_sampled` is the learning half of a step driven from
the host (`host_step`): the rewards (the rollout's own, or scored on device or
in the sandboxed verifier workers: `scoring.rewards_of`), then
`Programs.learn_finished`, for one run or the study's S seeds (`seeds.Seeds`:
each seed's rows scored apart, the vmapped learning).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax import advantages, lag
from offpolicy_jax.learn import replay, train_step
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.protocol import Finished
from offpolicy_jax.step import packing, run_state, scoring
from offpolicy_jax.step.run_state import (
  ReplayOptions,
  RunState,
  Sampled,
  StepFns,
)
from offpolicy_jax.step.seeds import Seeds
from offpolicy_jax.store import metrics as store_metrics


def learn(
  fns: StepFns, opts: ReplayOptions, state: RunState, batch, step, seed, schedule, keep=None
):
  """Buffers `batch`, draws the step's training batch, takes U optimizer steps, snapshots.

  With `keep` (bool [G'] over the groups of `batch`), only the kept groups are
  buffered (partial rollouts emit a variable number per step). The metrics
  count the tokens of the buffered rows (`sampled_tokens`, and
  `sampled_prompt_tokens`, one prefill per group): the run's cost accounting
  (`step.costs`) sums them.
  """
  greedy = fns.packing.advantage in advantages.GREEDY_FIRST  # decoded, though not trained on
  sampled_counts = _sampled_tokens(batch, keep, fns.sizes.group_size, greedy)
  buffer, sampled, info = replay.sample(
    replay.add(state.replay, batch, keep),
    run_state.step_key(seed, step, run_state.REPLAY),
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
    run_state.step_key(seed, step, run_state.TRAIN),
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
  return state, {**stats, **metrics, **sampled_counts, "replay_selected": info.num_selected}


def _sampled_tokens(batch, keep, group_size: int, greedy_first: bool) -> dict[str, jax.Array]:
  """Response tokens of the rows of `batch` to buffer, and their groups' prompt tokens.

  `greedy_first`: each group's first row is a greedy baseline of weight 0, sampled all the same.
  """
  rows = batch.weights > 0
  if greedy_first:
    rows = rows | (jnp.arange(rows.shape[0]) % group_size == 0)
  if keep is not None:
    rows = rows & jnp.repeat(jnp.asarray(keep, bool), group_size)
  rows_f = rows.astype(jnp.float32)
  groups_f = rows_f.reshape(-1, group_size).max(axis=1)
  prompt_g = batch.prompt_mask.reshape(-1, group_size, batch.prompt_mask.shape[-1])[:, 0]
  return {
    "sampled_tokens": jnp.sum(batch.mask * rows_f[:, None]),
    "sampled_prompt_tokens": jnp.sum(prompt_g.sum(axis=1) * groups_f),
  }


def pack_finished(fns: StepFns, fin: Finished, rewards, step, seed, *, jitted: bool = False):
  """`(batch, keep)`: the finished groups packed (`packing.pack`), and which to buffer.

  `keep` (bool [G'], in batch order) is None when every group is kept.
  """
  packer = packing.pack_jit if jitted else packing.pack
  prompts = {k: fin.prompts[k] for k in prompt_rows.DEVICE_FIELDS if k in fin.prompts}
  key = run_state.step_key(seed, step, run_state.ADV)
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


class Learned(NamedTuple):
  """What `learn_sampled` gives a step's row (`rows.step_row`).

  Attributes:
    device: the step's device metrics as Python values (each [S] over a study's seeds).
    host: each seed's host metrics: its reward statistics, the rollout's host
      metrics, `snapshot_missing`.
    reward_s: the seconds the host rewards took.
  """

  device: dict[str, Any]
  host: list[dict[str, Any]]
  reward_s: float


def learn_sampled(fns: StepFns, progs, state, sampled: Sampled, step: int, seeds: Seeds, schedule):
  """The learning half of a step from the host: each seed's rewards, then the jitted packing
  and learning (vmapped over the study's seeds).

  Returns:
    `(state, Learned)`: the run state and the parts of the step's row.
  """
  begin = time.perf_counter()
  scored = [scoring.rewards_of(fns, fin) for fin in sampled.per_seed]
  reward_s = time.perf_counter() - begin
  rewards = seeds.stack([r for r, _ in scored])
  step_a, seed_a = seeds.scalars(fns.model.mesh, step)
  args = (sampled.rstate, sampled.fin, rewards, sampled.info, sampled.v, step_a, seed_a, schedule)
  state, out = progs.learn_finished(state, *args)
  out, found = jax.device_get((out, sampled.found))
  # Each seed's as Python values (a study's stacked as float64 / int64 [S], as before rows
  # were built in one place, so that a rerun's records repeat to the last digit).
  python = store_metrics.to_python
  device = seeds.row(
    [{k: python(x) for k, x in seeds.take(out, s).items()} for s in range(len(seeds.ids))]
  )
  host = [
    {**stats, **sampled.host[s], "snapshot_missing": int(not bool(seeds.take(found, s)))}
    for s, (_, stats) in enumerate(scored)
  ]
  return state, Learned(device, host, reward_s)
