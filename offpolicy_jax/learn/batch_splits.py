"""How the train step cuts a batch: micro-batches, and chunks of the rows that move the loss.

`micro_batches` / `split_micro` cut a minibatch into gradient-accumulation
micro-batches (strided by units of rows, so every micro-batch spans all
data-parallel devices; a unit is a group when the prompt is shared).

For a loss with ``LossSpec.zero_advantage_inert``, a row whose advantages are
all 0 adds exactly 0 to the loss sum and to the gradient, and its share of the
denominator depends on the mask only. `cut` packs the units (rows, or
groups with a shared prefix) that move the loss first and cuts the batch into
equal chunks; the optimizer step then loops, with a traced trip count, over
only the chunks holding them: one compiled body, nothing recompiles, no host
round trip, and still vmappable. The loss count and the ``tokens`` metric are
those of the whole batch; the other metrics are over the rows of the chunks
that ran.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax import losses
from offpolicy_jax import reductions as red
from offpolicy_jax.scale import sharding
from offpolicy_jax.types import TrainBatch


def micro_batches(options: Any, rows: int) -> int:
  """Micro-batches per optimizer step for a batch of `rows` rows (static)."""
  if rows % options.num_minibatches:
    raise ValueError(f"num_minibatches={options.num_minibatches} does not divide batch rows {rows}")
  mb_rows = rows // options.num_minibatches
  size = options.micro_batch_size
  m = options.num_micro_batches if size is None else mb_rows // size
  if m < 1 or mb_rows % m or (size is not None and mb_rows % size):
    raise ValueError(
      f"micro_batch_size/num_micro_batches: {mb_rows} rows per minibatch do not split "
      f"into micro-batches (num_micro_batches={options.num_micro_batches}, "
      f"micro_batch_size={size})"
    )
  if (mb_rows // m) % options.unit:
    raise ValueError(
      f"shared_prefix: micro-batches of {mb_rows // m} rows do not hold whole groups of "
      f"group_size={options.group_size} (num_minibatches={options.num_minibatches}, "
      f"num_micro_batches={m})"
    )
  return m


def split_micro(batch: TrainBatch, m: int, unit: int = 1) -> TrainBatch:
  # Strided split by units of `unit` rows (unit u goes to micro-batch u % m)
  # keeps every micro-batch spread over all data-parallel devices.
  def split(x):
    units = x.reshape(x.shape[0] // (m * unit), m, unit, *x.shape[1:])
    return jnp.swapaxes(units, 0, 1).reshape(m, x.shape[0] // m, *x.shape[1:])

  return jax.tree.map(split, batch)


def join_micro(x, unit: int = 1):
  """The inverse of `split_micro` on an array [m, rows / m, ...] -> [rows, ...]."""
  m, per = x.shape[:2]
  units = x.reshape(m, per // unit, unit, *x.shape[2:])
  return jnp.swapaxes(units, 0, 1).reshape(m * per, *x.shape[2:])


def moving_rows(batch: TrainBatch) -> jax.Array:
  """bool [B]: rows with a valid, weighted token whose advantage is not 0."""
  valid = (batch.mask * batch.weights[:, None]) > 0
  adv = batch.advantages if batch.advantages.ndim == 2 else batch.advantages[:, None]
  return jnp.any(valid & (adv != 0), axis=1)


def chunks_per_micro_batch(options: Any, micro_rows: int, shards: int = 1) -> int:
  """Chunks a micro-batch of `micro_rows` rows is cut into when skipping rows (static).

  The largest count <= ``skip_chunks`` whose chunks hold whole units, the same
  number of units on each of the `shards` data-parallel devices where possible.
  """
  for per_device in (shards, 1):
    for c in range(min(options.skip_chunks, micro_rows), 0, -1):
      if micro_rows % (c * options.unit * per_device) == 0:
        return c
  return 1


def batch_shards() -> int:
  """Devices the batch rows are split over in the ambient mesh (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return 1
  return sharding.axis_size(mesh, tuple(a for a in sharding.BATCH_AXES if a in mesh.shape))


class Cut(NamedTuple):
  """A minibatch cut for gradient accumulation (`cut`).

  Attributes:
    chunks: the rows stacked into C equal chunks, [C, rows / C, ...].
    n: the chunks that run: C (a Python int: every micro-batch), or a traced
      count when skipping (the chunks holding rows that move the loss, first).
    whole: when skipping, the metrics of the whole minibatch that the chunks
      that ran cannot give (`tokens`, `rows_skipped`); None: every chunk runs
      and the metrics are the chunks' own.
    loss_count: when skipping, the loss's denominator over the whole minibatch.
  """

  chunks: TrainBatch
  n: Any
  whole: dict[str, Any] | None = None
  loss_count: Any = None


def cut(batch: TrainBatch, m: int, options: Any) -> Cut:
  """`batch` cut into its `m` micro-batches, or, skipping rows, into the chunks that run.

  Skipping (``options.skips_rows``; module docstring): each micro-batch is cut
  into `chunks_per_micro_batch` chunks, the units that move the loss are
  packed first, and only the chunks holding them run.
  """
  if not options.skips_rows:
    return Cut(split_micro(batch, m, options.unit), m)
  rows, unit = batch.tokens.shape[0], options.unit
  chunks = m * chunks_per_micro_batch(options, rows // m, batch_shards())
  chunk_rows = rows // chunks
  moving = moving_rows(batch)
  unit_moves = jnp.any(moving.reshape(-1, unit), axis=1)
  unit_order = jnp.argsort(~unit_moves, stable=True)
  order = (unit_order[:, None] * unit + jnp.arange(unit)[None, :]).reshape(-1)
  # Rows that do not move the loss and fill the last chunk add exactly 0 to the sums.
  packed = jax.tree.map(lambda x: x[order], batch)
  stacked = jax.tree.map(lambda x: x.reshape(chunks, chunk_rows, *x.shape[1:]), packed)
  n_moving = jnp.sum(unit_moves.astype(jnp.int32)) * unit
  # At least one chunk, so that every metric is defined when nothing moves.
  n_chunks = jnp.maximum((n_moving + chunk_rows - 1) // chunk_rows, 1)
  weighted = batch.mask * batch.weights[:, None]
  spec = options.spec
  _, count = losses.aggregate(jnp.zeros_like(weighted), weighted, spec.agg, max_len=spec.max_len)
  whole = {
    # Rows of weight 0 (ReMax's greedy baseline, dropped rows) are not trained on.
    "tokens": red.Sum(
      jnp.sum(((batch.mask > 0) & (batch.weights[:, None] > 0)).astype(jnp.float32))
    ),
    "rows_skipped": red.Sum(rows - jnp.sum(moving.astype(jnp.float32))),
  }
  return Cut(stacked, n_chunks, whole, count)
