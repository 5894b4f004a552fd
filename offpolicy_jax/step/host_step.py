"""A step that leaves the device: the acting half, host scoring or environment, jitted learning.

The same step as `rl_step.rl_step` (rollout -> score -> pack -> learn) for
runs where part of it lives on the host: a host reward (scored in the
sandboxed verifier workers), a rollout that runs on the host (`Rollout.traced`
false: episodes, whose environment answers between decodes, and the episode
pool), or a rollout placed on a disaggregated sampler mesh. Its two halves
are the acting half (`programs.acting_half`) and `learning.learn_sampled`;
`Stepper` runs them, and dispatches the next step's acting half before this
step learns when the loop allows it (the device samples while the workers
score). The same step runs the study's seeds (`seeds.Seeds.many`: vmapped
programs, each seed's host part on its own rows). `collect` is the acting
half, scored and packed, for the async producer, which learns elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.step import learning, programs, rows, scoring
from offpolicy_jax.step.run_state import Sampled, StepFns
from offpolicy_jax.step.seeds import Seeds
from offpolicy_jax.store import metrics


class Stepper:
  """The host steps of a run, the next step's acting half dispatched ahead when allowed.

  `take_step` is the whole step (the acting half, then `learning.learn_sampled`);
  with `prefetch` it also reads and dispatches step t + 1's acting half before
  step t scores and learns, so the device samples while the verifier workers
  score (and a disaggregated sampler samples while the trainer trains). The
  caller says when the lag schedule allows it (the next behaviour parameters
  must not be this step's).

  Args:
    fns: the run's step functions; `rollout`: the rollout (placed or not).
    seeds: the run's seed (`Seeds.one`), or the study's S seeds (`Seeds.many`: the
      programs are vmapped, and each metric of a seed is an array [S]; what reading
      the prompts logged and `time/*` stay scalars).
    schedule: the `run_state.LagSchedule`.
  """

  def __init__(self, fns: StepFns, rollout: Rollout, seeds: Seeds, schedule):
    self.fns, self.rollout, self.seeds, self.schedule = fns, rollout, seeds, schedule
    self._sampled: dict[int, tuple[Any, Sampled]] = {}  # step -> (its read info, its rollout)

  @property
  def prefetched(self) -> bool:
    """Whether the next step's rollout was sampled ahead (and its prompts read)."""
    return bool(self._sampled)

  def take_step(
    self, progs, state, step: int, read: Callable[[], tuple[dict, Any]], prefetch: bool
  ):
    """One host step: `(state, row)`; `read()` gives the next prompts and what to log of them.

    `progs` are the run's programs for `state` (`programs.programs`). The row
    (`rows.step_row`) has what `read` returned beside the prompts and
    `time/sample_s` (until this step's rollout is ready), `time/reward_s`,
    `time/train_s` (the rest, with dispatching step t + 1's rollout when it is
    sampled ahead), and `time/sampled_ahead`: 1 when this step's rollout was
    dispatched during the previous step (its device time then falls in that
    step's `time/train_s`, the device running in order), else 0.
    """
    t0 = t1 = time.perf_counter()
    held, self._sampled = self._sampled, {}
    ahead = step in held
    rollouts = {step: held[step]} if ahead else {}  # a rollout held for another step is dropped
    # This step's rollout (unless sampled ahead), then, when sampling ahead, the next one's,
    # in that order: the next one is dispatched only once this one is ready, since a
    # sampler-mesh placement frees the parameter copy this one decodes with when the next
    # one's behaviour version differs.
    for s in (step, step + 1) if prefetch else (step,):
      if s not in rollouts:
        rollouts[s] = self._sample(progs, state, s, read)
      if s == step:
        jax.block_until_ready(rollouts[s][1].fin.out)
        t1 = time.perf_counter()
    read_info, sampled = rollouts.pop(step)
    self._sampled = rollouts  # the next step's, when sampled ahead
    args = (self.fns, progs, state, sampled, step, self.seeds, self.schedule)
    state, learned = learning.learn_sampled(*args)
    times = {"reward_s": learned.reward_s, "sampled_ahead": int(ahead), "sample_s": t1 - t0}
    times["train_s"] = time.perf_counter() - t1 - learned.reward_s
    row = rows.step_row(self.seeds, learned.device, learned.host, fields=read_info, times=times)
    return state, row

  def _sample(self, progs, state, step: int, read) -> tuple[Any, Sampled]:
    prompts, read_info = read()
    act = programs.acting_half(self.rollout)
    args = (self.rollout, state, prompts, step, self.seeds, self.schedule)
    return read_info, act(self.fns, progs, *args)


def collect(
  fns: StepFns,
  rollout: Rollout,
  rstate,
  params,
  version,
  prompts: dict,
  step: int,
  seed,
  latest=None,
):
  """The acting half with given parameters, scored and packed, from the host (the async producer).

  `rstate` is the rollout's carried state (None for a stateless kind); `latest`
  (`Rollout.advance`) lets episodes continue under parameters published while
  they run.

  Returns:
    `(rstate, batch, keep, host metrics)`: `keep` (bool [G'], or None for every
    group) says which groups of `batch` finished and are to be buffered
    (`learning.learn`); the rows of the others weigh 0, so that staleness
    bounds and token counts see only the groups that finished.
  """
  args = (rstate, params, version, prompts, step, seed, latest)
  rstate, fin, info = programs.advance(rollout, *args)
  rewards, stats = scoring.rewards_of(fns, fin)
  batch, keep = learning.pack_finished(fns, fin, rewards, step, seed, jitted=True)
  if keep is not None:
    kept = jnp.repeat(jnp.asarray(keep, jnp.float32), fns.sizes.group_size)
    batch = batch._replace(weights=batch.weights * kept)
  info = {k: metrics.to_python(x) for k, x in jax.device_get(info).items()}
  return rstate, batch, keep, {**stats, **info}  # a rollout's own reward statistics win
