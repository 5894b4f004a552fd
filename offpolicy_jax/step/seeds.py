"""The seeds a host step runs for: one run's, or the study's S runs side by side.

A run's state and its programs' outputs have no seed axis; the study's have a
leading one (its programs are `jax.vmap`ped, `programs.programs(...,
seeds=Seeds.many(...))`). The host parts of a step (a host rollout, the sandboxed
scoring, the metrics row) run once per seed either way: `Seeds` is the one
place that knows whether a tree has a seed axis, so the halves of a step are
written once (`acting.sample_traced` / `sample_host`, `learning.learn_sampled`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.scale import sharding


class Seeds(NamedTuple):
  """The seeds of the runs a step advances.

  Attributes:
    ids: each run's seed (the study's random streams: seed + stream offset).
    stacked: whether states and outputs carry a leading seed axis (the study);
      False for one run (`one`), whose trees have none.
  """

  ids: tuple[int, ...]
  stacked: bool

  @classmethod
  def one(cls, seed: int) -> Seeds:
    return cls((int(seed),), False)

  @classmethod
  def many(cls, seeds: Sequence[int]) -> Seeds:
    return cls(tuple(int(s) for s in np.asarray(seeds).tolist()), True)

  def take(self, tree: Any, s: int) -> Any:
    """Seed `s`'s part of `tree` (`tree` itself for one run)."""
    return jax.tree.map(lambda x: x[s], tree) if self.stacked else tree

  def stack(self, trees: Sequence[Any]) -> Any:
    """One tree from each seed's (`take`'s inverse); arrays on device."""
    if not self.stacked:
      (tree,) = trees
      return tree
    return jax.tree.map(lambda *x: jnp.stack([jnp.asarray(y) for y in x]), *trees)

  def seed_arg(self, mesh: jax.sharding.Mesh) -> jax.Array:
    """The programs' `seed` argument: a replicated scalar, or the seeds' [S] vector."""
    if self.stacked:
      return jnp.asarray(self.ids, jnp.int32)
    return sharding.replicated_int(mesh, self.ids[0])

  def scalars(self, mesh: jax.sharding.Mesh, step) -> tuple[jax.Array, jax.Array]:
    """The programs' `(step, seed)` arguments (the step replicated for one run)."""
    step_a = jnp.int32(step) if self.stacked else sharding.replicated_int(mesh, int(step))
    return step_a, self.seed_arg(mesh)

  def prompts(self, mesh: jax.sharding.Mesh, local: dict[str, Any], *, steps: bool = False):
    """A step's prompts (`steps`: n steps' batches stacked on axis 0) as the programs take
    them: one run's global arrays (`prompt_rows.assemble_global`, rows over the mesh),
    or the study's host arrays [S, ...] (S before the step axis)."""
    if not self.stacked:
      return prompt_rows.assemble_global(mesh, local, leading_axes=int(steps))
    return local

  def stack_steps(self, batches: Sequence[dict[str, Any]], fields: Sequence[str]) -> dict:
    """n steps' prompt batches stacked on the step axis: [n, ...], or [S, n, ...]."""
    return {k: np.stack([b[k] for b in batches], axis=int(self.stacked)) for k in fields}

  def step_of(self, out: dict[str, Any], i: int) -> dict[str, Any]:
    """Step `i`'s metrics from a scan's ([n] each, or [S, n]: then each [S])."""
    if self.stacked:
      return {k: np.asarray(v)[:, i] for k, v in out.items()}
    return {k: v[i] for k, v in out.items()}

  def row(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One metrics row from each seed's (Python values): the row itself, or each metric [S]."""
    if not self.stacked:
      (row,) = rows
      return row
    return {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
