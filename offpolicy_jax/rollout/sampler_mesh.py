"""A rollout placed on a disaggregated sampler mesh: `OnSamplerMesh(rollout)`.

Placement is a wrapper over any rollout kind, not a kind of its own
(`protocol.Rollout`). The device split, the weight transfer and the
sampler's parameter copy live in `scale.disagg`; this wrapper keeps the copy
at the behaviour version of the schedule (docs/science.md s5): a step whose
version differs from the copy's first reshards the parameters onto the
sampler mesh (with adapters only the adapters; the frozen base is placed
once). The step's prompts move to the sampler mesh, the wrapped rollout runs
there, and its finished rows move back to the trainer mesh, rows over the
trainer's batch axes, where the step scores, packs and learns.

The placement is chosen once per run, by the run's driver (`step.drivers.placed`;
not with the cached components, since it holds the run's parameter copy): a
sync run's step and the async producer's sampler thread advance the same
placed rollout, so the copy is resharded on the thread that samples, only for
versions it samples with. Episodes continuing under newer parameters
(`latest`) reshard the same copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from offpolicy_jax import models
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.rollout.protocol import Finished, Rollout
from offpolicy_jax.scale.disagg import SamplerParams, row_shardings, transfer


class OnSamplerMesh(Rollout):
  """`rollout` run on the sampler's own mesh (module docstring).

  Args:
    rollout: the wrapped rollout.
    mesh: the sampler's mesh (`StepFns.sampler_mesh`).
    trainer_mesh: the trainer's mesh (`StepFns.model.mesh`).
    split: whole model state -> `(frozen base or None, trainable)` (`StepFns.model.split`).
    free_previous: free the previous copy before a reshard (one copy on the sampler's
      devices). False when several sampler threads advance at once (`lag.sampler_threads`):
      another thread may still decode with it, so it is dropped, not freed.
    rows_back: move the finished rows to the trainer mesh (a sync step scores and packs
      them there). False for the async producer, whose thread scores and packs them on the
      sampler mesh and moves the packed batch: its programs then never share the trainer's
      devices with the trainer's own (concurrent programs with collectives on the same
      devices can stall each other past XLA's rendezvous timeout).
  """

  traced = False  # host code around the wrapped rollout's programs (placement and transfers)

  def __init__(
    self,
    rollout: Rollout,
    mesh: Mesh,
    trainer_mesh: Mesh,
    split: Callable,
    free_previous: bool = True,
    rows_back: bool = True,
  ):
    self.inner, self.mesh, self.trainer_mesh, self._split = rollout, mesh, trainer_mesh, split
    self.free_previous, self.rows_back = free_previous, rows_back
    self.copy = SamplerParams(mesh)
    # A LoRA run's frozen base on the sampler mesh, placed once (a list: shared by `around`).
    self._placed_base: list[Any] = []
    self._lock = threading.Lock()  # sampler threads share the copy

  @property
  def prefetch(self) -> bool:
    return self.inner.prefetch

  @property
  def item(self) -> str:
    return self.inner.item

  def init(self) -> Any:
    return self.inner.init()

  def arrays(self, rstate) -> Any:
    return self.inner.arrays(rstate)

  def meta(self, rstate) -> dict[str, Any]:
    return self.inner.meta(rstate)

  def restore(self, rstate, arrays, meta: dict[str, Any]) -> Any:
    return self.inner.restore(rstate, arrays, meta)

  def signature(self) -> dict[str, Any] | None:
    return self.inner.signature()

  def with_sampler(self, sampler) -> Rollout:
    """The same placement and parameter copy around the inner kind's switched sampler."""
    return self.around(self.inner.with_sampler(sampler))

  def around(self, rollout: Rollout) -> OnSamplerMesh:
    """`rollout` in this placement, sharing its parameter copy (and base) with this one."""
    placed = OnSamplerMesh(
      rollout, self.mesh, self.trainer_mesh, self._split, self.free_previous, self.rows_back
    )
    placed.copy, placed._placed_base, placed._lock = self.copy, self._placed_base, self._lock
    return placed

  def _on_mesh(self, params, version, free: bool) -> tuple[Any, dict[str, Any]]:
    """The whole model at `version` on the sampler mesh (resharded when the copy is another
    version's; the previous copy freed with `free`), and `reshard_time_s` / `reshard_bytes`
    (0 without a reshard)."""
    base, trainable = self._split(params)
    info: dict[str, Any] = {"reshard_time_s": 0.0, "reshard_bytes": 0}
    with self._lock:
      if base is not None and not self._placed_base:
        self._placed_base.append(jax.block_until_ready(SamplerParams(self.mesh).place(base)))
      if version != self.copy.version:
        info = self.copy.sync(trainable, version, free=free)
      placed_base = self._placed_base[0] if self._placed_base else None
      return models.lora.join(placed_base, self.copy.params), info

  def advance(self, rstate, params, version, prompts, step, key, latest=None):
    """The wrapped `advance` on the sampler mesh; reshards the copy when `version` changed.

    Returns the wrapped rollout's `(rstate, finished, info)` with `finished` on
    the trainer mesh, and in `info` `reshard_time_s` and `reshard_bytes` (0
    without a reshard; with `latest`, the sum over the episode's reshards).
    """
    whole, info = self._on_mesh(params, version, self.free_previous)
    if latest is not None:  # newer parameters reach the episode through the same copy
      latest = self._latest(latest, info)
    device = prompt_rows.device_prompts(prompts)
    placed = {**prompts, **transfer(device, row_shardings(device, self.mesh))}
    with jax.set_mesh(self.mesh):
      rstate, fin, inner = self.inner.advance(rstate, whole, version, placed, step, key, latest)
    if not self.rows_back:
      return rstate, fin, {**info, **inner}
    back = lambda tree: transfer(tree, row_shardings(tree, self.trainer_mesh))
    fin = Finished(
      {**prompts, **back(prompt_rows.device_prompts(fin.prompts))},
      back(fin.out),
      fin.versions if isinstance(fin.versions, int) else back(fin.versions),
      None if fin.rewards is None else back(fin.rewards),
      fin.valid,
      fin.order,
    )
    # Device values stay on device: fetching them here would wait for the whole decode.
    return rstate, fin, {**info, **inner}

  def _latest(self, latest: Callable, info: dict[str, Any]) -> Callable:
    """`latest` giving the newest parameters on the sampler mesh; adds its reshards to `info`.

    The copy an episode started with is dropped, not freed: the episode's tokens of
    earlier versions are scored under it (pi_old) after its last turn.
    """

    def on_mesh():
      params, version = latest()
      whole, more = self._on_mesh(params, version, False)
      info["reshard_time_s"] += more["reshard_time_s"]
      info["reshard_bytes"] += more["reshard_bytes"]
      return whole, version

    return on_mesh
