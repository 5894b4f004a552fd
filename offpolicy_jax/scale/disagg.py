"""Disaggregated sampler and trainer meshes: the device split, weight transfer, the sampler.

With `config.mesh.sampler_devices = k > 0` the sampler runs on k devices of
its own and the trainer on all the others (`config.mesh.{data,fsdp,tensor}`
shape the trainer's mesh). The sampler holds its own copy of the parameters,
sharded over its own `(data=k, fsdp=1, tensor=1)` mesh by the logical-axis
rules (replicated there) with prompt rows over its `data` axis. At each sync
the trainer's parameters are resharded onto it (`SamplerParams.sync`, timed:
`reshard_time_s`, `reshard_bytes`), and every rollout is moved back to the
trainer mesh's batch shardings before learning. Sampling and learning are two
programs on disjoint devices, so they run at the same time whenever the lag
schedule lets the next rollout start before the current step has trained.

Layout: every process gives its first `k / P` local devices (by id) to the
sampler and the rest to the trainer (`split_devices`), so each process owns
devices of both roles and both meshes order their devices process-major. Why:
in multi-controller JAX every process takes part in every program, and
`jax.device_put` cannot reshard between meshes over different device sets
that span several processes (a sampler on host 0 and a trainer on host 1
cannot exchange weights that way). With this layout the transfer needs no
cross-process copy beyond a collective on the trainer mesh: the parameters
are all-gathered there, then each process copies its own replica onto its own
sampler devices; batch rows stay in the process that read their prompts
(`transfer`). One process: any split works and `jax.device_put` does the
copy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from offpolicy_jax.scale import sharding

FIELD = "mesh.sampler_devices"


class Layout(NamedTuple):
  """Devices of each role, process-major (by process index, then device id)."""

  sampler: list
  trainer: list


def split_devices(devices: Sequence[Any], sampler_count: int) -> Layout:
  """Splits `devices` between the sampler and the trainer, every process owning both roles.

  Each process gives its first `sampler_count / P` devices (by id) to the
  sampler and the rest to the trainer, P being the number of processes that
  own devices.

  Args:
    devices: objects with `.id` and `.process_index` (e.g. `jax.devices()`).
    sampler_count: k, the sampler's devices over all processes.

  Returns:
    The two device lists, each ordered by (process index, id).

  Raises:
    ValueError: naming `mesh.sampler_devices` when k is not a positive int,
      leaves the trainer no device, does not split evenly over the processes,
      or when processes own different numbers of devices.
  """
  k = sampler_count
  if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
    raise ValueError(f"{FIELD}: must be an int >= 1 to split the devices, got {k!r}")
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(int(d.process_index), []).append(d)
  n, procs = len(devices), sorted(by_process)
  if k >= n:
    raise ValueError(f"{FIELD}: {k} leaves the trainer no device ({n} devices in all)")
  if k % len(procs):
    raise ValueError(
      f"{FIELD}: {k} does not split evenly over {len(procs)} processes: every process "
      f"must own sampler and trainer devices (use a multiple of {len(procs)})"
    )
  counts = {p: len(by_process[p]) for p in procs}
  if len(set(counts.values())) > 1:
    raise ValueError(f"{FIELD}: processes own different numbers of devices: {counts}")
  per = k // len(procs)  # < every process's count, as k < n and the counts are equal
  local = [sorted(by_process[p], key=lambda d: d.id) for p in procs]
  return Layout([d for ds in local for d in ds[:per]], [d for ds in local for d in ds[per:]])


def mesh_of(devices: Sequence[Any], shape: tuple[int, int, int]) -> Mesh:
  """A `(data, fsdp, tensor)` mesh over `devices` in the given (process-major) order."""
  grid = np.empty(len(devices), dtype=object)
  grid[:] = list(devices)
  return Mesh(grid.reshape(shape), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def sampler_shape(sampler_count: int) -> tuple[int, int, int]:
  """`(data, fsdp, tensor)` of the sampler's mesh: its k devices on `data` (prompt rows)."""
  return (sampler_count, 1, 1)


def make_meshes(
  devices: Sequence[Any], sampler_count: int, trainer_shape: tuple[int, int, int]
) -> tuple[Mesh, Mesh]:
  """`(sampler mesh, trainer mesh)`: k sampler devices on `data`, the rest in `trainer_shape`.

  Args:
    devices: all devices (`jax.devices()`).
    sampler_count: k, see `split_devices`.
    trainer_shape: `(data, fsdp, tensor)` of the trainer, -1 filling the
      trainer's devices; it must use all of them.

  Raises:
    ValueError: naming the mesh field that does not fit.
  """
  layout = split_devices(devices, sampler_count)
  n = len(layout.trainer)
  fill = [i for i, s in enumerate(trainer_shape) if s == -1]
  fixed = int(np.prod([s for s in trainer_shape if s != -1]))
  shape = list(trainer_shape)
  if fill:
    shape[fill[0]] = n // fixed
  if fixed * (n // fixed if fill else 1) != n:
    raise ValueError(
      f"mesh: with {FIELD} = {sampler_count} the trainer's data * fsdp * tensor "
      f"{tuple(trainer_shape)} must use exactly the other {n} devices"
    )
  sampler_mesh = mesh_of(layout.sampler, sampler_shape(len(layout.sampler)))
  return sampler_mesh, mesh_of(layout.trainer, (shape[0], shape[1], shape[2]))


# ------------------------------------------------------------------ transfer


def transfer(tree: Any, shardings: Any, *, gather: bool = False, donate: bool = False) -> Any:
  """`tree` placed with `shardings` on another mesh (asynchronous where JAX allows).

  One process: `jax.device_put` (the source donated if `donate`). Several
  processes: `jax.device_put` cannot move arrays between meshes over
  different device sets, so each process builds its shards of the result
  from its own shards of the source: with `gather`, the source is first
  all-gathered on its own mesh (parameters: every process then holds a full
  replica); without it each target shard must lie within this process's
  rows (batches: the rows of the prompts it read).

  Args:
    tree: pytree of `jax.Array`s.
    shardings: a sharding, or a pytree of shardings mirroring `tree`.
    gather: all-gather on the source mesh first (multi-process only).
    donate: donate the source buffers (one process only; best effort).

  Raises:
    ValueError: when a target shard needs rows another process holds.
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings, donate=donate)
  return _transfer_local(tree, shardings, gather=gather)


def _transfer_local(tree: Any, shardings: Any, *, gather: bool) -> Any:
  """`transfer` by process-local copies (also runs, slower, with one process)."""
  if gather:
    tree = _all_gather(tree)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _put_local(x, shardings), tree)
  return jax.tree.map(_put_local, tree, shardings)


def _all_gather(tree: Any) -> Any:
  def rep(x):
    return NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())

  return jax.jit(lambda t: t, out_shardings=jax.tree.map(rep, tree))(tree)


def _put_local(x: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
  """`x` with sharding `target`, built only from this process's shards of `x`."""
  shards = [s for s in x.addressable_shards if s.replica_id == 0] or x.addressable_shards
  if x.ndim == 0:
    pieces = [jax.device_put(shards[0].data, d) for d in target.addressable_devices]
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)
  spans = []  # (first row, last row + 1, data) of this process's row blocks
  for s in x.addressable_shards:
    if s.data.shape[1:] != x.shape[1:]:
      raise ValueError(f"transfer: a {x.shape} array split beyond its rows needs gather=True")
    lo = s.index[0].start or 0
    spans.append((lo, lo + s.data.shape[0], s.data))
  pieces = []
  for d, where in target.addressable_devices_indices_map(x.shape).items():
    index = tuple(where or (slice(None),) * x.ndim)
    lo, hi, _ = index[0].indices(x.shape[0])
    parts, at = [], lo
    while at < hi:
      hit = next((sp for sp in spans if sp[0] <= at < sp[1]), None)
      if hit is None:
        raise ValueError(
          f"transfer: rows {lo}:{hi} of a {x.shape} array are not on process "
          f"{jax.process_index()}: its sampler and trainer devices must hold the same rows "
          f"(see disagg.split_devices)"
        )
      end = min(hi, hit[1])
      parts.append(jax.device_put(hit[2][at - hit[0] : end - hit[0]], d))
      at = end
    piece = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    pieces.append(jax.device_put(piece[(slice(None), *index[1:])], d))
  return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


def tree_bytes(tree: Any) -> int:
  """Bytes of one copy of `tree`'s arrays (global shapes)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def row_shardings(tree: Any, mesh: Mesh) -> Any:
  """Batch shardings on `mesh` (rows over `(data, fsdp)`) of every array in `tree`."""
  return jax.tree.map(lambda x: sharding.batch_sharding(mesh, np.ndim(x)), tree)


# ------------------------------------------------------------------ the sampler's side


class SamplerParams:
  """The sampler's copy of the parameters on its own mesh, and the version it holds.

  Args:
    mesh: the sampler mesh.
  """

  def __init__(self, mesh: Mesh):
    self.mesh = mesh
    self.shardings: Any = None  # from the logical names of the first parameters placed
    self.params: Any = None
    self.version: int | None = None

  def place(self, params: Any, *, donate: bool = False) -> Any:
    """A copy of `params` (on the trainer mesh) on the sampler mesh, not yet kept."""
    if self.shardings is None:
      self.shardings = sharding.tree_shardings(params, self.mesh)
    return transfer(params, self.shardings, gather=True, donate=donate)

  def sync(self, params: Any, version: int, *, donate: bool = False) -> dict[str, Any]:
    """Reshards `params` onto the sampler mesh as `version`, freeing the previous copy first.

    Returns:
      `reshard_time_s` (wall time until the copy is on the sampler's devices)
      and `reshard_bytes` (one copy).
    """
    begin = time.perf_counter()
    if self.params is not None:  # nothing samples with it now: free it before the new copy lands
      for x in jax.tree.leaves(self.params):
        x.delete()
    self.params = jax.block_until_ready(self.place(params, donate=donate))
    self.version = version
    return {"reshard_time_s": time.perf_counter() - begin, "reshard_bytes": tree_bytes(params)}
