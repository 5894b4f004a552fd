"""Every seed's warm start, computed once per study and kept in its workdir.

All cells of a study start a seed from the same supervised warm start (the
runs are paired). `Starts.get` computes a seed's the first time a cell needs
it and keeps it in memory and, given a directory, on disk
(`<study>/warm_starts`: one checkpoint per seed, its step number the seed,
written through `store.checkpointing` with its digests). Cells that run in
worker processes of their own, and a study resumed after a kill, read it
instead of training it again. The study refuses to resume with a config
that changes a field a cell depends on (`runner`), so a stored warm start is
always the one the config asks for.

A critic's value head (`models.value`) is not part of a warm start: it is
kept without one, and a cell whose model has a head gets a zero head added,
so cells with and without a critic start each seed from the same trunk. A
separate critic is not kept either: a cell with one starts it from the seed
(or as a copy of the warm-started policy, `critic.model = "policy"`).
"""

from __future__ import annotations

from typing import Any

import jax

from offpolicy_jax.models import value
from offpolicy_jax.run import components, sft
from offpolicy_jax.store import checkpointing


def warm_start(comps: components.Components, seed: int, base_seed: int | None = None):
  """Seed `seed`'s warm start `(base, params)`.

  Without adapters `base` is None and `params` the whole warm-started model.
  With adapters every seed of a study shares the base of `base_seed` (its
  warm start), and `params` is seed `seed`'s fresh adapter.
  """
  fns, run = comps.fns, comps.run
  base, params = fns.model.split(fns.model.init_params(seed))
  kw: dict[str, Any] = dict(
    steps=run.sft.steps,
    batch_size=run.sft.batch_size,
    learning_rate=run.sft.learning_rate,
    distractor=run.sft.distractor,
    log_fn=lambda *_: None,
  )
  if base is None:
    return None, sft.warm_start(fns, params, seed=seed, **kw) if run.sft.enabled else params
  base_seed = seed if base_seed is None else base_seed
  if base_seed != seed:
    base = fns.model.split(fns.model.init_params(base_seed))[0]
  if run.sft.enabled:  # any adapter with B = 0 leaves the warm start of the base unchanged
    base = sft.warm_start(fns, base, seed=base_seed, frozen=params, **kw)
  return base, params


class Starts:
  """The warm starts `(base, params)` of a study's seeds: in memory, and on disk if given one.

  Args:
    directory: where the seeds' checkpoints go (None: memory only).
  """

  def __init__(self, directory: str | None = None):
    self.directory = directory
    self._memory: dict[int, tuple[Any, Any]] = {}
    self._store: checkpointing.Checkpointer | None = None

  def get(self, comps: components.Components, seed: int, base_seed: int) -> tuple[Any, Any]:
    """Seed `seed`'s warm start: from memory, from disk, or trained (and then stored).

    Without a supervised phase the start is the initial parameters, rebuilt
    rather than stored. With adapters every seed's fresh adapters sit on the
    warm start of `base_seed`'s base, stored once (with `base_seed`).
    """
    fns = comps.fns
    if seed in self._memory:
      return self._with_head(comps, seed, self._memory[seed])
    if fns.model.lora is not None and seed != base_seed:
      start = (
        self.get(comps, base_seed, base_seed)[0],
        fns.model.split(fns.model.init_params(seed))[1],
      )
    elif not comps.run.sft.enabled:
      start = warm_start(comps, seed, base_seed)
    else:
      start = self._read(comps, seed) or self._write(seed, warm_start(comps, seed, base_seed))
    start = (start[0], value.without_head(start[1]))
    self._memory[seed] = start
    return self._with_head(comps, seed, start)

  @staticmethod
  def _with_head(comps: components.Components, seed: int, start: tuple[Any, Any]):
    """`start` with the zero value head of `comps`' model, when it has one."""
    if comps.fns.learner.options.critic is None:  # no head: nothing to trace
      return start
    if comps.fns.model.critic:  # a separate critic, from the seed or the start's policy
      return start[0], comps.fns.model.with_critic(start[1], seed)
    abstract = jax.eval_shape(lambda: comps.fns.model.init_params(seed))
    return start[0], value.with_zero_head(start[1], abstract)

  def close(self) -> None:
    """Waits for and releases the checkpointer (its threads); the memory copies stay."""
    if self._store is not None:
      self._store.close()
      self._store = None

  def _checkpointer(self) -> checkpointing.Checkpointer | None:
    if self.directory is not None and self._store is None:
      self._store = checkpointing.Checkpointer(self.directory, max_to_keep=None, async_save=False)
    return self._store

  def _read(self, comps: components.Components, seed: int) -> tuple[Any, Any] | None:
    store = self._checkpointer()
    if store is None or seed not in store.all_steps():
      return None
    fns = comps.fns
    base, params = jax.eval_shape(lambda: fns.model.split(fns.model.init_params(seed)))
    params = value.without_head(params)  # stored without one (module docstring)
    try:
      items, meta = store.restore({"base": base, "params": params}, step=seed)
    except checkpointing.CheckpointError as e:
      raise checkpointing.CheckpointError(
        f"{self.directory}: the stored warm start of seed {seed} is unreadable ({e}); "
        f"delete {self.directory}/{seed} to train it again",
        e.failures,
      ) from e
    if meta.get("seed") != seed:
      raise checkpointing.CheckpointError(
        f"{self.directory}/{seed}: holds the warm start of seed {meta.get('seed')!r}", []
      )
    return items["base"], items["params"]

  def _write(self, seed: int, start: tuple[Any, Any]) -> tuple[Any, Any]:
    store = self._checkpointer()
    if store is not None:
      params = value.without_head(start[1])
      store.save(seed, {"base": start[0], "params": params}, {"seed": seed})
      store.wait()
    return start
