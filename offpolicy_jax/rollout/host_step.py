"""A step that leaves the device: rollout half, host scoring or environment, jitted learning.

The same step as `rl_step.rl_step` (rollout -> score -> pack -> learn) for
runs where part of it lives on the host: a host reward (scored in the
sandboxed verifier workers), a rollout that runs on the host (`Rollout.traced`
false: episodes, whose environment answers between decodes, and the episode
pool), or a rollout placed on a disaggregated sampler mesh. It is split in
two so that a caller may overlap them (the loop dispatches the next step's
rollout while this one is scored, `sample` / `learn`):

  sample  a traced rollout runs as the jitted `Programs.rollout` (behaviour
          parameters and `advance` in one program); a host rollout runs
          `advance` on the host with the behaviour parameters of
          `Programs.behaviour`;
  learn   rewards (unless the rollout earned them), then the jitted
          `Programs.learn_finished` (pack, replay, train step).

`steps_over_seeds` is the same step for the study's seeds (vmapped programs,
each seed's host part on its own rows); `collect` is the rollout half with
packing for the async producer, which learns elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import models
from offpolicy_jax.rollout import episodes, pipeline, rl_step
from offpolicy_jax.rollout.protocol import Finished, Rollout
from offpolicy_jax.rollout.rl_step import StepFns
from offpolicy_jax.scale import sharding
from offpolicy_jax.store import metrics


class Sampled(NamedTuple):
  """The rollout half of a step (`sample`).

  Attributes:
    rstate: the rollout's carried state after `advance`.
    fin: the finished groups (prompts with their host fields).
    info: the rollout's device metrics (a traced rollout's), into the jitted learning.
    host: the rollout's host metrics (a host rollout's, or a placement's).
    v: the behaviour loop step (device scalar).
    found: whether its snapshot was present.
  """

  rstate: Any
  fin: Finished
  info: dict[str, Any]
  host: dict[str, Any]
  v: Any
  found: Any


def _device(fin: Finished) -> Finished:
  """`fin` with only the prompts' device fields (what the jitted programs take)."""
  return fin._replace(prompts={k: fin.prompts[k] for k in pipeline.DEVICE_FIELDS})


def sample(
  fns: StepFns, progs, rollout: Rollout, state, prompts: dict, step: int, seed: int, schedule
):
  """The rollout half of step `step` (module docstring); dispatched asynchronously when traced."""
  step_a, seed_a = _scalar(fns, step), _scalar(fns, seed)
  if rollout.traced:
    device = {k: prompts[k] for k in pipeline.DEVICE_FIELDS}
    rstate, fin, info, v, found = progs.rollout(state, device, step_a, seed_a, schedule)
    # A traced rollout's groups are the step's prompts: they keep their host fields.
    return Sampled(rstate, fin._replace(prompts={**prompts, **fin.prompts}), info, {}, v, found)
  params, v, found = progs.behaviour(state, step_a, schedule)
  key = pipeline.step_key(seed, step, pipeline.SAMPLE)
  version = fns.learner.version(int(v))
  params = rl_step.weights(state, params)
  rstate, fin, host = rollout.advance(state.rollout, params, version, prompts, step, key)
  return Sampled(rstate, fin, {}, host, v, found)


def learn(
  fns: StepFns, progs, rollout: Rollout, state, sampled: Sampled, step: int, seed: int, schedule
):
  """The learning half: rewards, then the jitted packing and learning.

  Returns:
    `(state, row)`: the run state and the step's metrics as Python values
    (device metrics, host reward statistics, the rollout's host metrics,
    `time/reward_s`).
  """
  fin, begin = sampled.fin, time.perf_counter()
  if fin.rewards is None:
    rewards, stats = pipeline.score(fns, fin.prompts, fin.out)
  else:
    rewards, stats = fin.rewards, pipeline.no_reward_stats()
  reward_s = time.perf_counter() - begin
  rstate = sampled.rstate
  if not fns.rollout.traced:  # host objects stay outside the programs (`programs._traced`)
    state, rstate = state._replace(rollout=rstate), None
  step_a, seed_a = _scalar(fns, step), _scalar(fns, seed)
  args = (rstate, _device(fin), rewards, sampled.info, sampled.v, step_a, seed_a, schedule)
  state, out = progs.learn_finished(state, *args)
  row = {k: metrics.to_python(x) for k, x in jax.device_get(out).items()}
  row.update(stats)
  row.update({k: metrics.to_python(x) for k, x in sampled.host.items()})
  row["snapshot_missing"] = int(not bool(sampled.found))
  row["time/reward_s"] = reward_s
  return state, row


class Stepper:
  """The host steps of a run, the next step's rollout dispatched ahead when allowed.

  `take_step` is the whole step (`sample`, then `learn`); with `prefetch` it reads
  and dispatches step t + 1's rollout before scoring and learning step t, so
  the device samples while the verifier workers score (and a disaggregated
  sampler samples while the trainer trains). The caller says when the lag
  schedule allows it (the next behaviour parameters must not be this step's).

  Args:
    fns: the run's step functions; `rollout`: the rollout (placed or not).
    seed: the run's seed; `schedule`: the `rl_step.LagSchedule`.
  """

  def __init__(self, fns: StepFns, rollout: Rollout, seed: int, schedule):
    self.fns, self.rollout, self.seed, self.schedule = fns, rollout, seed, schedule
    self._pending: tuple[int, Any, Sampled] | None = None  # (step, its read info, its rollout)

  @property
  def prefetched(self) -> bool:
    """Whether the next step's rollout was sampled ahead (and its prompts read)."""
    return self._pending is not None

  def take_step(
    self, progs, state, step: int, read: Callable[[], tuple[dict, Any]], prefetch: bool
  ):
    """One host step: `(state, row)`; `read()` gives the next prompts and what to log of them.

    `progs` are the run's programs for `state` (`programs.programs`). The row
    has `read_info` (what `read` returned beside the prompts) and
    `time/sample_s`, `time/reward_s`, `time/train_s`, and `time/sampled_ahead`:
    1 when this step's rollout was dispatched during the previous step (its
    device time then falls in that step's `time/train_s`, the device running
    in order), else 0.
    """
    t0 = time.perf_counter()
    pending, self._pending = self._pending, None
    ahead = pending is not None and pending[0] == step
    if pending is None or pending[0] != step:
      pending = (step, *self._sample(progs, state, step, read))
    _, read_info, sampled = pending
    jax.block_until_ready(sampled.fin.out)
    t1 = time.perf_counter()
    if prefetch:
      self._pending = (step + 1, *self._sample(progs, state, step + 1, read))
    state, row = learn(
      self.fns, progs, self.rollout, state, sampled, step, self.seed, self.schedule
    )
    row["read_info"] = read_info
    row["time/sampled_ahead"] = int(ahead)
    row["time/sample_s"] = t1 - t0
    row["time/train_s"] = time.perf_counter() - t1 - row["time/reward_s"]
    return state, row

  def _sample(self, progs, state, step: int, read) -> tuple[Any, Sampled]:
    prompts, read_info = read()
    args = (self.rollout, state, prompts, step, self.seed, self.schedule)
    return read_info, sample(self.fns, progs, *args)


def collect(
  fns: StepFns, rollout: Rollout, rstate, params, version, prompts, step: int, seed, latest=None
):
  """Rollout, score and pack with given parameters, from the host (the async producer).

  `latest` (`Rollout.advance`) lets episodes continue under parameters
  published while they run.

  Returns:
    `(rstate, batch, host metrics)`.
  """
  key = pipeline.step_key(seed, step, pipeline.SAMPLE)
  rstate, fin, info = rollout.advance(rstate, params, version, prompts, step, key, latest)
  if fin.rewards is None:
    rewards, stats = pipeline.score(fns, fin.prompts, fin.out)
  else:
    rewards, stats = fin.rewards, {}
  batch, keep = rl_step.pack_finished(fns, fin, rewards, step, seed, jitted=True)
  if keep is not None:
    raise ValueError("a rollout with groups in flight cannot feed the async producer")
  info = {k: metrics.to_python(x) for k, x in jax.device_get(info).items()}
  return rstate, batch, {**info, **stats}


def steps_over_seeds(fns: StepFns, progs, state, prompts_l: dict, steps, seeds, schedule):
  """Loop steps of S seeds' runs (the study's vmapped state): `(state, metrics [S, L])`.

  Per step: the rollout half (a traced rollout vmapped over seeds; a host
  rollout per seed with that seed's behaviour parameters and key), each
  seed's rows scored on their own, and the vmapped learning: exactly the
  loop's step of each seed.
  """
  rollout, rows = fns.rollout, []
  seeds_l = np.asarray(seeds).tolist()
  for i, step in enumerate(steps):
    prompts = {k: x[:, i] for k, x in prompts_l.items()}
    if rollout.traced:
      device = {k: prompts[k] for k in pipeline.DEVICE_FIELDS}
      rstate, fin, info, v, found = progs.rollout(state, device, step, seeds, schedule)
      stacked = _device(fin)  # already [S, ...]: sliced per seed only for scoring
      fin = fin._replace(prompts={**prompts, **fin.prompts})
      per_seed = [jax.tree.map(lambda x, s=s: x[s], fin) for s in range(len(seeds_l))]
      host: list[dict[str, Any]] = [{} for _ in seeds_l]
    else:
      rstate, info = None, {}
      params, v, found = progs.behaviour(state, step, schedule)
      per_seed, host = [], []
      for s, seed in enumerate(seeds_l):
        one = {k: x[s] for k, x in prompts.items()}
        whole = models.lora.join(state.base, jax.tree.map(lambda x, s=s: x[s], params))
        key = pipeline.step_key(seed, int(step), pipeline.SAMPLE)
        version = fns.learner.version(int(v[s]))
        _, fin_s, host_s = rollout.advance(None, whole, version, one, int(step), key)
        per_seed.append(fin_s)
        host.append(host_s)
      stack = lambda *x: jnp.stack([jnp.asarray(y) for y in x])
      stacked = jax.tree.map(stack, *map(_device, per_seed))
    scored = [_rewards(fns, f) for f in per_seed]
    rewards = jnp.stack([r for r, _ in scored])
    args = (rstate, stacked, rewards, info, v, step, seeds, schedule)
    state, m = progs.learn_finished(state, *args)
    m = dict(m)
    m["reward_failures"] = jnp.asarray([f for _, f in scored], jnp.float32)
    for name in episodes.EPISODE_STATS:
      if name in host[0]:
        m[name] = jnp.asarray([h[name] for h in host], jnp.float32)
    rows.append({**m, "snapshot_missing": (~found).astype(jnp.int32)})
  return state, jax.tree.map(lambda *x: jnp.stack(x, axis=1), *rows)


def _rewards(fns: StepFns, fin: Finished) -> tuple[Any, int]:
  """One seed's rewards and how many failed (scored 0): the rollout's own, or scored (device,
  or the sandboxed workers)."""
  if fin.rewards is not None:
    return fin.rewards, 0
  rewards, stats = pipeline.score(fns, fin.prompts, fin.out)
  return rewards, int(stats["reward_failures"])


def _scalar(fns: StepFns, x) -> jax.Array:
  """`x` as an int32 scalar replicated on the run's mesh."""
  return jax.device_put(np.int32(x), sharding.replicated(fns.model.mesh))
