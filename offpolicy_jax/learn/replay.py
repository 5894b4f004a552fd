"""Device-resident ring buffer of rollout groups, as pure ``(init, add, sample)``.

A slot holds one group: the ``K`` responses to one prompt (rows stay together
so group-relative quantities remain meaningful). The buffer is a
:class:`ReplayState` of fixed-shape arrays with a leading capacity axis, so
``add`` and ``sample`` are jittable, never leave the device and never
recompile. ``add`` overwrites the oldest slots when full (wrap-around).

Sampling policies (data shaping, principle P2 of Yao et al., "Group-relative
REINFORCE is secretly an off-policy algorithm", arXiv:2509.24203):

- ``fifo``: oldest first; with ``max_reuse=1`` each group is used exactly once
  in insertion order (the paper's one-pass setting).
- ``uniform``: uniformly without replacement among eligible groups.
- ``staleness``: without replacement, ``P(slot) ~ exp(-staleness / temperature)``
  (prefers fresh data).
- ``reward``: without replacement, ``P(slot) ~ exp(mean_reward / temperature)``.

Weighted draws without replacement use the Gumbel-top-k trick. A group is
eligible if its slot is valid, it has been used fewer than ``max_reuse``
times and its staleness ``current_version - version`` is at most
``max_staleness``. Groups past the staleness bound are evicted; groups that
reach ``max_reuse`` are retired. When fewer eligible groups than
``batch_size`` exist, the remaining rows are filled from other slots with
``weights = 0`` so the loss ignores them (static shapes).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from offpolicy_jax.scale.sharding import BATCH_AXES, axis_size, put
from offpolicy_jax.types import TrainBatch

POLICIES = ("fifo", "uniform", "staleness", "reward")


class ReplayState(NamedTuple):
  """Ring buffer of ``capacity`` groups of ``K`` rows.

  Attributes:
    data: ``TrainBatch`` whose arrays have shape ``[C, K, ...]``.
    version: int32 [C] oldest token version of the group (its behaviour version).
    insert_index: int32 [C] global insertion counter of the group (FIFO order).
    reuse: int32 [C] times the group has been sampled.
    valid: bool [C] slot holds a usable group.
    ptr: int32 [] next slot to write.
    num_added: int32 [] groups added so far.
  """

  data: TrainBatch
  version: jax.Array
  insert_index: jax.Array
  reuse: jax.Array
  valid: jax.Array
  ptr: jax.Array
  num_added: jax.Array


class SampleInfo(NamedTuple):
  """What :func:`sample` did.

  Attributes:
    indices: int32 [S] slots sampled.
    selected: bool [S] whether each sampled slot was eligible (False = filler).
    num_selected: int32 [] eligible groups in the batch.
    num_evicted: int32 [] groups evicted by the staleness bound in this call.
    num_retired: int32 [] groups retired by the reuse limit in this call.
    size: int32 [] valid groups left in the buffer.
    staleness_mean: float32 [] mean staleness of the selected groups.
    staleness_max: int32 [] max staleness of the selected groups.
    reuse_mean: float32 [] mean prior use count of the selected groups.
  """

  indices: jax.Array
  selected: jax.Array
  num_selected: jax.Array
  num_evicted: jax.Array
  num_retired: jax.Array
  size: jax.Array
  staleness_mean: jax.Array
  staleness_max: jax.Array
  reuse_mean: jax.Array


def _check_batch(batch: TrainBatch, group_size: int) -> int:
  b = batch.tokens.shape[0]
  if group_size < 1 or b % group_size:
    raise ValueError(f"group_size: batch of {b} rows does not split into groups of {group_size}")
  return b // group_size


def _group_version(batch: TrainBatch, group_size: int) -> jax.Array:
  big = jnp.iinfo(jnp.int32).max
  v = jnp.where(batch.mask > 0, batch.versions, big).reshape(-1, group_size * batch.mask.shape[1])
  v = v.min(axis=1)
  return jnp.where(v == big, batch.versions.reshape(v.shape[0], -1).max(axis=1), v)


def init(capacity: int, example_batch: TrainBatch, group_size: int) -> ReplayState:
  """Creates an empty buffer for groups shaped like ``example_batch``.

  Args:
    capacity: number of groups held.
    example_batch: a ``TrainBatch`` of ``G * K`` rows (values unused).
    group_size: ``K``, rows per group.

  Returns:
    An empty :class:`ReplayState`.

  Raises:
    ValueError: naming the field for a bad capacity or group size.
  """
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  _check_batch(example_batch, group_size)

  def slots(x):
    x = jnp.asarray(x)
    return jnp.zeros((capacity, group_size, *x.shape[1:]), x.dtype)

  return ReplayState(
    data=jax.tree.map(slots, example_batch),
    version=jnp.zeros((capacity,), jnp.int32),
    insert_index=jnp.zeros((capacity,), jnp.int32),
    reuse=jnp.zeros((capacity,), jnp.int32),
    valid=jnp.zeros((capacity,), bool),
    ptr=jnp.zeros((), jnp.int32),
    num_added=jnp.zeros((), jnp.int32),
  )


@functools.partial(jax.jit, donate_argnums=0)
def add(state: ReplayState, batch: TrainBatch, keep: ArrayLike | None = None) -> ReplayState:
  """Writes the ``G`` groups of ``batch`` (``G*K`` rows) at the write pointer.

  Overwrites the oldest slots when full. Jitted; ``state`` is donated. With
  ``keep``, only the kept groups are written, in order, to consecutive slots
  (a variable number per call at static shapes, as partial rollouts emit).

  Args:
    state: the buffer.
    batch: ``TrainBatch`` of ``G * K`` group-major rows; ``G <= capacity``.
    keep: optional bool [G], the groups to write (default: all).

  Returns:
    The new buffer state.

  Raises:
    ValueError: naming the field when the batch does not fit.
  """
  capacity, group_size = state.valid.shape[0], state.data.tokens.shape[1]
  num_groups = _check_batch(batch, group_size)
  if num_groups > capacity:
    raise ValueError(f"batch: {num_groups} groups exceed the buffer capacity {capacity}")
  keep = jnp.ones((num_groups,), bool) if keep is None else jnp.asarray(keep, bool)
  rank = (jnp.cumsum(keep) - 1).astype(jnp.int32)
  count = keep.sum().astype(jnp.int32)
  # Groups not kept get an out-of-range slot, which the scatters drop.
  idx = jnp.where(keep, (state.ptr + rank) % capacity, capacity)

  def write(buf, x):
    x = jnp.asarray(x, buf.dtype).reshape(num_groups, group_size, *buf.shape[2:])
    return buf.at[idx].set(x, mode="drop")

  return ReplayState(
    data=jax.tree.map(write, state.data, batch),
    version=state.version.at[idx].set(_group_version(batch, group_size), mode="drop"),
    insert_index=state.insert_index.at[idx].set(state.num_added + rank, mode="drop"),
    reuse=state.reuse.at[idx].set(0, mode="drop"),
    valid=state.valid.at[idx].set(True, mode="drop"),
    ptr=((state.ptr + count) % capacity).astype(jnp.int32),
    num_added=state.num_added + count,
  )


def _priority_logits(state, key, policy, current_version, temperature):
  gumbel = jax.random.gumbel(key, state.valid.shape, jnp.float32)
  if policy == "uniform":
    return gumbel
  if policy == "staleness":
    stale = (current_version - state.version).astype(jnp.float32)
    return gumbel - stale / temperature
  rewards = state.data.rewards.reshape(state.valid.shape[0], -1).mean(axis=1)
  return gumbel + rewards / temperature


@functools.partial(
  jax.jit,
  static_argnames=("batch_size", "policy", "max_reuse", "max_staleness", "temperature"),
  donate_argnums=0,
)
def sample(
  state: ReplayState,
  key: jax.Array,
  batch_size: int,
  policy: str = "fifo",
  max_reuse: int | None = 1,
  current_version: ArrayLike = 0,
  max_staleness: int | None = None,
  temperature: float = 1.0,
) -> tuple[ReplayState, TrainBatch, SampleInfo]:
  """Draws ``batch_size`` groups and updates reuse counts and validity.

  Args:
    state: the buffer (donated).
    key: PRNG key (unused by ``fifo``).
    batch_size: ``S`` groups to draw (static); the batch has ``S * K`` rows.
    policy: ``fifo`` | ``uniform`` | ``staleness`` | ``reward`` (static).
    max_reuse: uses allowed per group; None = unlimited (static).
    current_version: int scalar trainer version, for staleness.
    max_staleness: largest allowed ``current_version - version``; older groups
      are evicted. None = no bound (static).
    temperature: softness of the ``staleness``/``reward`` policies (static).

  Returns:
    ``(state, batch, info)``: the new buffer, a ``TrainBatch`` of ``S * K``
    rows (filler rows have ``weights == 0``) and a :class:`SampleInfo`.

  Raises:
    ValueError: naming the field for an unknown policy or bad sizes.
  """
  if policy not in POLICIES:
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
  capacity = state.valid.shape[0]
  if not 1 <= batch_size <= capacity:
    raise ValueError(f"batch_size must be in [1, capacity={capacity}], got {batch_size}")
  if max_reuse is not None and max_reuse < 1:
    raise ValueError(f"max_reuse must be >= 1 or None, got {max_reuse}")
  if temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  current_version = jnp.asarray(current_version, jnp.int32)
  stale = current_version - state.version
  valid = state.valid
  evict = jnp.zeros_like(valid)
  if max_staleness is not None:
    evict = valid & (stale > max_staleness)
    valid = valid & ~evict
  eligible = valid if max_reuse is None else valid & (state.reuse < max_reuse)

  # Eligible slots first (by priority), then other slots as zero-weight filler.
  if policy == "fifo":
    score = jnp.where(eligible, -state.insert_index, jnp.iinfo(jnp.int32).min)
  else:
    logits = _priority_logits(state, key, policy, current_version, temperature)
    score = jnp.where(eligible, logits, -jnp.inf)
  _, idx = jax.lax.top_k(score, batch_size)
  selected = eligible[idx]

  reuse = state.reuse.at[idx].add(selected.astype(jnp.int32))
  retire = jnp.zeros_like(valid)
  if max_reuse is not None:
    retire = valid & (reuse >= max_reuse)
    valid = valid & ~retire

  group_size = state.data.tokens.shape[1]
  batch = jax.tree.map(lambda x: x[idx].reshape(batch_size * group_size, *x.shape[2:]), state.data)
  row_keep = jnp.repeat(selected, group_size).astype(batch.weights.dtype)
  batch = batch._replace(weights=batch.weights * row_keep)

  n_sel = selected.sum().astype(jnp.int32)
  sel_stale = jnp.where(selected, stale[idx], 0)
  info = SampleInfo(
    indices=idx.astype(jnp.int32),
    selected=selected,
    num_selected=n_sel,
    num_evicted=evict.sum().astype(jnp.int32),
    num_retired=retire.sum().astype(jnp.int32),
    size=valid.sum().astype(jnp.int32),
    staleness_mean=sel_stale.sum() / jnp.maximum(n_sel, 1).astype(jnp.float32),
    staleness_max=sel_stale.max(),
    reuse_mean=jnp.where(selected, state.reuse[idx], 0).sum() / jnp.maximum(n_sel, 1),
  )
  return state._replace(reuse=reuse, valid=valid), batch, info


def shardings(state: ReplayState, mesh: Mesh) -> ReplayState:
  """Shardings for a buffer: the capacity axis split over ``(data, fsdp)``.

  Falls back to replication when the capacity does not divide by
  ``data * fsdp``. Small bookkeeping arrays are replicated.

  Args:
    state: a :class:`ReplayState` (or its ``jax.eval_shape``).
    mesh: the device mesh.

  Returns:
    A ``ReplayState`` of ``NamedSharding``.
  """
  capacity = state.valid.shape[0]
  split = capacity % axis_size(mesh, BATCH_AXES) == 0

  def data_sharding(x):
    spec = P(BATCH_AXES, *([None] * (x.ndim - 1))) if split else P()
    return NamedSharding(mesh, spec)

  rep: Any = NamedSharding(mesh, P())  # a pytree of shardings mirrors the state
  return ReplayState(
    data=jax.tree.map(data_sharding, state.data),
    version=rep,
    insert_index=rep,
    reuse=rep,
    valid=rep,
    ptr=rep,
    num_added=rep,
  )


def shard(state: ReplayState, mesh: Mesh) -> ReplayState:
  """Places a buffer on ``mesh`` with :func:`shardings`."""
  return put(state, shardings(state, mesh))


def size(state: ReplayState) -> jax.Array:
  """Number of valid groups held."""
  return state.valid.sum()


def _row_abs_advantage(batch: TrainBatch) -> jax.Array:
  """[B] mean |advantage| of each row (over its response tokens when per token)."""
  a = jnp.abs(batch.advantages)
  if a.ndim == 1:
    return a
  return (a * batch.mask).sum(1) / jnp.maximum(batch.mask.sum(1), 1.0)


def batch_stats(batch: TrainBatch, group_size: int) -> dict[str, jax.Array]:
  """Reward and length statistics of a batch's rows (filler rows, weight 0, excluded)."""
  w = (batch.weights > 0).astype(jnp.float32)
  n = jnp.maximum(w.sum(), 1.0)
  r = batch.rewards
  mean = (r * w).sum() / n
  r_gk = r.reshape(-1, group_size)
  return {
    "reward_mean": mean,
    "reward_std": jnp.sqrt(((r - mean) ** 2 * w).sum() / n),
    "accuracy": ((r > 0.5) * w).sum() / n,
    "response_len": (batch.mask.sum(1) * w).sum() / n,
    "response_tokens": (batch.mask.sum(1) * w).sum(),
    "groups_all_equal": (r_gk.max(1) == r_gk.min(1)).mean(),
    "adv_abs_mean": (_row_abs_advantage(batch) * w).sum() / n,
  }
