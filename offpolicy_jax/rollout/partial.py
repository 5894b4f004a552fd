"""Partial rollouts (APRIL) as a `Rollout`: groups in flight across loop steps, on device.

The decode programs are `sampling.partial`'s (admit, advance under a per-step
token budget with a version and an exact log-prob per token); this module
makes them a rollout. Each step

  admit    the step's G groups take free slots of the pool (`PartialState`),
  advance  every unfinished row decodes at most b tokens under theta_v,
  pi_old   with `rollout.score_old`, the tokens drawn now are scored at theta_v
           (`protocol.pi_old`; earlier tokens keep their own version's score),
  finish   groups whose K rows have all ended are handed to the step
           (`Finished.valid`), oldest admission first (`Finished.order`), and
           their slots are freed.

The pool is the rollout's carried state (`RunState.rollout`), checkpointed
as the item `inflight`. Everything is traceable: the whole step, pool
included, is one jitted program (scanned over `log_every` steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from offpolicy_jax.rollout.protocol import Finished, pi_old
from offpolicy_jax.sampling import partial as programs
from offpolicy_jax.sampling.partial import PartialSampler, PartialState


@dataclasses.dataclass(frozen=True, eq=False)
class Partial:
  """Partial rollouts of single-turn responses (module docstring).

  Attributes:
    sampler: the pool's decode programs and sizes (`sampling.partial.PartialSampler`).
    prompt_fields: `{name: (shape without the group axis, dtype)}` of the
      prompts' device fields (the pool's prompt slots).
    mesh: the mesh the pool is placed on.
    score_old: the learner's scorer of log pi_old, or None (not scored).
  """

  sampler: PartialSampler
  prompt_fields: dict[str, tuple[tuple[int, ...], Any]]
  mesh: jax.sharding.Mesh
  score_old: Callable | None = None
  traced = True
  prefetch = False
  item = "inflight"

  def init(self) -> PartialState:
    """An empty pool placed on the mesh."""
    g = self.sampler.slots  # any group count: `init` takes only the trailing shapes
    example = {name: jnp.zeros((g, *shape), dt) for name, (shape, dt) in self.prompt_fields.items()}
    return programs.shard(self.sampler.init(example), self.mesh)

  def advance(self, pool: PartialState, params, version, prompts, step, key, latest=None):
    """Admits, advances b tokens, scores pi_old, finishes (traceable; module docstring)."""
    del latest
    pool, dropped = programs.admit(pool, prompts, step)
    version = jnp.asarray(version, jnp.int32)
    pool = self.sampler.advance(params, pool, version, key)
    if self.score_old is not None:
      out = programs.as_output(pool)
      old = pi_old(
        self.score_old, [(params, version)], pool.prompts, out, pool.versions, pool.old_logprobs
      )
      pool = pool._replace(old_logprobs=old)
    finished, pool = finish(pool)
    return pool, finished, stats(finished, pool, dropped)

  def signature(self) -> None:
    return None  # a changed pool shape fails the restore of the item's arrays

  def arrays(self, pool: PartialState) -> PartialState:
    return pool

  def meta(self, pool: PartialState) -> dict[str, Any]:
    del pool
    return {}

  def restore(self, pool: PartialState, arrays, meta: dict[str, Any]) -> PartialState:
    del pool, meta
    return arrays


def finish(pool: PartialState) -> tuple[Finished, PartialState]:
  """The pool's rows with its finished groups marked valid, oldest first; their slots freed.

  Returns:
    `(finished, pool)`: every slot's rows (`valid`: the groups whose K rows
    have ended; `order`: those groups by admission step, then slot, then the
    rest), and the pool with the finished slots free for the next admissions.
  """
  keep = programs.finished(pool)
  order = jnp.argsort(jnp.where(keep, pool.admitted, jnp.iinfo(jnp.int32).max), stable=True)
  out = programs.as_output(pool)
  finished = Finished(pool.prompts, out, pool.versions, valid=keep, order=order)
  return finished, pool._replace(active=pool.active & ~keep)


def stats(finished: Finished, pool: PartialState, dropped) -> dict[str, jax.Array]:
  """Metrics of one partial-rollout step.

  Returns:
    ``partial_emitted_groups`` (finished groups handed to the buffer),
    ``partial_inflight_groups`` (left in the pool), ``partial_dropped_prompts``
    (groups refused for want of a slot; 0 by construction) and
    ``partial_mixed_rows`` (fraction of emitted rows whose tokens come from more
    than one parameter version).
  """
  keep = finished.valid
  k = finished.out.tokens.shape[0] // keep.shape[0]
  valid = finished.out.mask > 0
  big = jnp.iinfo(jnp.int32).max
  oldest = jnp.where(valid, finished.versions, big).min(axis=1)
  newest = jnp.where(valid, finished.versions, -1).max(axis=1)
  rows = jnp.repeat(keep, k) & valid.any(axis=1)
  mixed = (rows & (newest > oldest)).sum() / jnp.maximum(rows.sum(), 1)
  return {
    "partial_emitted_groups": keep.sum().astype(jnp.int32),
    "partial_inflight_groups": pool.active.sum().astype(jnp.int32),
    "partial_dropped_prompts": jnp.asarray(dropped, jnp.int32),
    "partial_mixed_rows": mixed.astype(jnp.float32),
  }
