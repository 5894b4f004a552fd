"""Parameter versions, the sync schedule v(t), staleness and parameter snapshots.

Version ``k`` means "the parameters after ``k`` optimizer steps". The paper's
simulated asynchronous system (Yao et al., "Group-relative REINFORCE is secretly
an off-policy algorithm", arXiv:2509.24203) feeds optimizer step ``t``
(1-indexed) with a batch sampled at version

  v(t) = 0                          if t <= n
  v(t) = m * floor((t - n - 1) / m)  otherwise,

with ``m = sync_interval`` and ``n = sync_offset``; the lag is
``t - 1 - v(t)``. ``m=1, n=0`` is on-policy, ``m=1, n=k`` a constant lag ``k``,
``n=0, m=20`` a sawtooth 0..19, and ``m`` beyond the run length is offline.

The snapshot store keeps device-resident copies of recent parameter versions
so the trainer can sample with exactly the parameters the schedule names.
Staleness has one measure, `row_staleness` (the trainer's version minus the
oldest version in a row), and one bound, `step.producer.SamplerThread`'s ``max_staleness``:
batches beyond it are dropped, or their stale rows reweighted by
`staleness_weights`.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

# ------------------------------------------------------------------ schedule


def validate_schedule(sync_interval: int, sync_offset: int) -> None:
  """Raises ValueError naming the field if the lag schedule is invalid."""
  if not isinstance(sync_interval, int | np.integer) or sync_interval < 1:
    raise ValueError(f"sync_interval must be an int >= 1, got {sync_interval!r}")
  if not isinstance(sync_offset, int | np.integer) or sync_offset < 0:
    raise ValueError(f"sync_offset must be an int >= 0, got {sync_offset!r}")


def behavior_version(step, sync_interval=1, sync_offset=0):
  """Parameter version that generated the batch of optimizer step ``step``.

  ``v(t) = 0 if t <= n else m * floor((t - n - 1) / m)`` (docs/science.md s5).
  The one implementation of v(t): Python ints give an int (checked), traced
  or array arguments an int32 array (what the jitted RL step uses).

  Args:
    step: optimizer step ``t``, 1-indexed.
    sync_interval: ``m >= 1``, steps between parameter syncs to the sampler.
    sync_offset: ``n >= 0``, the constant part of the lag.

  Returns:
    The version ``v(t)``, in ``[0, t - 1]``.

  Raises:
    ValueError: naming the field when ``step < 1`` or the schedule is invalid
      (Python ints only).
  """
  if any(isinstance(x, jax.Array) for x in (step, sync_interval, sync_offset)):
    m, n = sync_interval, sync_offset
    return jnp.where(step <= n, 0, m * ((step - n - 1) // m)).astype(jnp.int32)
  validate_schedule(sync_interval, sync_offset)
  if not isinstance(step, int | np.integer) or step < 1:
    raise ValueError(f"step must be an int >= 1 (1-indexed), got {step!r}")
  if step <= sync_offset:
    return 0
  return sync_interval * ((step - sync_offset - 1) // sync_interval)


def staleness(step: int, sync_interval: int = 1, sync_offset: int = 0) -> int:
  """Lag ``t - 1 - v(t)`` of the batch consumed by optimizer step ``step``."""
  return step - 1 - behavior_version(step, sync_interval, sync_offset)


def snapshot_capacity(sync_interval: int, sync_offset: int) -> int:
  """Snapshots the sync schedule needs at once.

  Before step ``t`` the trainer holds version ``t - 1`` and the sampler needs
  ``v(t), v(t+1), ...``: the multiples of ``m`` (and 0) in
  ``[v(t), t - 1]``, at most ``(n + m - 1) // m + 1`` of them.
  """
  validate_schedule(sync_interval, sync_offset)
  return (sync_offset + sync_interval - 1) // sync_interval + 1


def is_snapshot_version(version: int, sync_interval: int) -> bool:
  """Whether the schedule will ever sample at ``version`` (0 or a multiple of m)."""
  return version % sync_interval == 0


# ------------------------------------------------------------------ snapshots


class SnapshotState(NamedTuple):
  """A ring of parameter snapshots, stacked along a leading capacity axis.

  Attributes:
    params: pytree like the parameters with a leading ``[C]`` axis.
    versions: int32 [C] version held in each slot, -1 for empty.
    ptr: int32 [] next slot to overwrite.
  """

  params: Any
  versions: jax.Array
  ptr: jax.Array


def snapshot_init(params: Any, capacity: int, version: ArrayLike = 0) -> SnapshotState:
  """Creates a store holding ``params`` as ``version`` in slot 0.

  Jitted, so the store lives on the devices of ``params`` (versions and pointer
  replicated there), as a multi-process checkpoint needs.

  Args:
    params: parameter pytree.
    capacity: number of versions kept (see :func:`snapshot_capacity`).
    version: version of ``params``.

  Returns:
    A :class:`SnapshotState`.
  """
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  return _snapshot_init(params, capacity, version)


@functools.partial(jax.jit, static_argnums=1)
def _snapshot_init(params: Any, capacity: int, version: ArrayLike) -> SnapshotState:
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (capacity, *jnp.shape(x))) + 0, params)
  versions = jnp.full((capacity,), -1, jnp.int32).at[0].set(version)
  return SnapshotState(stacked, versions, jnp.asarray(1 % capacity, jnp.int32))


@jax.jit
def snapshot_update(state: SnapshotState, params: Any, version: ArrayLike) -> SnapshotState:
  """Stores ``params`` as ``version``, overwriting the oldest slot.

  Storing a version that is already present overwrites that slot instead.
  """
  version = jnp.asarray(version, jnp.int32)
  present = state.versions == version
  slot = jnp.where(present.any(), jnp.argmax(present), state.ptr)
  new_params = jax.tree.map(lambda s, p: s.at[slot].set(p), state.params, params)
  ptr = jnp.where(present.any(), state.ptr, (state.ptr + 1) % state.versions.shape[0])
  return SnapshotState(new_params, state.versions.at[slot].set(version), ptr.astype(jnp.int32))


@jax.jit
def snapshot_get(state: SnapshotState, version: ArrayLike) -> tuple[Any, jax.Array]:
  """Parameters stored for ``version``.

  Args:
    state: the store.
    version: int scalar version.

  Returns:
    ``(params, found)``: the parameters (slot 0's when not found) and a bool
    scalar telling whether ``version`` is present.
  """
  hit = state.versions == jnp.asarray(version, jnp.int32)
  slot = jnp.argmax(hit)
  return jax.tree.map(lambda s: s[slot], state.params), hit.any()


# ------------------------------------------------------------------ staleness bound


def row_staleness(versions: ArrayLike, mask: ArrayLike, current_version: ArrayLike) -> jax.Array:
  """Staleness of each row: ``current_version - min(version over valid tokens)``.

  Args:
    versions: int32 [B, N] version per token.
    mask: float32 [B, N] valid tokens.
    current_version: int scalar trainer version.

  Returns:
    int32 [B] staleness of the oldest valid token (0 for empty rows).
  """
  versions = jnp.asarray(versions)
  big = jnp.iinfo(jnp.int32).max
  oldest = jnp.min(jnp.where(jnp.asarray(mask) > 0, versions, big), axis=-1)
  return jnp.where(oldest == big, 0, jnp.asarray(current_version, jnp.int32) - oldest)


def staleness_weights(
  versions: ArrayLike,
  mask: ArrayLike,
  current_version: ArrayLike,
  max_staleness: int,
  stale_weight: float = 0.0,
) -> jax.Array:
  """Per-row weights: 1 within the staleness bound, ``stale_weight`` beyond it.

  Args:
    versions: int32 [B, N] version per token.
    mask: float32 [B, N] valid tokens.
    current_version: int scalar trainer version.
    max_staleness: largest allowed staleness.
    stale_weight: weight of rows older than the bound (0 drops them).

  Returns:
    float32 [B] weights to multiply into ``TrainBatch.weights``.
  """
  stale = row_staleness(versions, mask, current_version) > max_staleness
  return jnp.where(stale, jnp.float32(stale_weight), jnp.float32(1.0))
