"""Partial rollouts (APRIL) as a `Rollout`: groups in flight across loop steps, on device.

The decode programs are `sampling.partial`'s (admit, advance under a per-step
token budget with a version and an exact log-prob per token, emit); this
module makes them a rollout. Each step

  admit    the step's G groups take free slots of the pool (`PartialState`),
  advance  every unfinished row decodes at most b tokens under theta_v,
  emit     groups whose K rows have all ended are handed to the step
           (`Finished.valid`), oldest admission first (`Finished.order`), and
           their slots are freed (`emit`, its metrics `emit_stats`),
  pi_old   with `rollout.score_old`, the tokens drawn now are scored at theta_v
           (`protocol.pi_old`; earlier tokens keep their own version's score),
           in the emitted rows and in the pool alike.

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

from offpolicy_jax.rollout import protocol
from offpolicy_jax.rollout.protocol import Finished, Rollout, pi_old
from offpolicy_jax.sampling import partial as programs
from offpolicy_jax.sampling.partial import PartialSampler, PartialState


@dataclasses.dataclass(frozen=True, eq=False)
class Partial(Rollout):
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

  def advance(self, rstate: PartialState, params, version, prompts, step, key, latest=None):
    """Admits, advances b tokens, emits, scores pi_old (traceable; module docstring)."""
    del latest
    pool, dropped = programs.admit(rstate, prompts, step)
    version = jnp.asarray(version, jnp.int32)
    pool = self.sampler.advance(params, pool, version, key)
    out, keep, order, left = programs.emit(pool)
    info = programs.emit_stats(pool, keep, dropped)
    if self.score_old is not None:
      scored = [(params, version)]
      old = pi_old(self.score_old, scored, pool.prompts, out, pool.versions, out.old_logprobs)
      out, left = out._replace(old_logprobs=old), left._replace(old_logprobs=old)
    return left, Finished(pool.prompts, out, pool.versions, valid=keep, order=order), info

  def signature(self) -> None:
    return None  # a changed pool shape fails the restore of the item's arrays

  def with_sampler(self, sampler) -> Rollout:
    raise protocol.own_sampler("partial rollouts (rollout.partial_budget)")

  def arrays(self, pool: PartialState) -> PartialState:
    return pool

  def meta(self, pool: PartialState) -> dict[str, Any]:
    del pool
    return {}

  def restore(self, pool: PartialState, arrays, meta: dict[str, Any]) -> PartialState:
    del pool, meta
    return arrays
