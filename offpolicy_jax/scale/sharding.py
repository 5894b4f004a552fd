"""Device mesh, logical-axis rules and sharding helpers.

Parameters name their axes with logical names (``embed``, ``mlp``, ``heads``,
``kv_heads``, ``vocab``, ...; the module constants `EMBED`, `MLP`, ... list
them all in `LOGICAL_AXES`) through Flax NNX variable metadata. One rules
table, :data:`LOGICAL_AXIS_RULES`, maps each logical name to mesh axes of a
``(data, fsdp, tensor)`` mesh, in the style of MaxText and Flax's
``logical_axis_rules``, and one function, `logical_to_spec`, applies it (model
import, `tree_shardings`, `constrain`). Batches are split over ``(data, fsdp)``.

A dimension whose size does not divide by the mesh axes it maps to is left
replicated, so tiny test models run on any mesh unchanged.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Mesh axes.
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)
BATCH_AXES = (DATA, FSDP)

# Logical axis names: layers annotate parameters and activations with these.
BATCH = "batch"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
VOCAB = "vocab"
HEAD_DIM = "head_dim"
LENGTH = "length"
LAYERS = "layers"
EXPERT = "expert"
LOGICAL_AXES = (BATCH, EMBED, MLP, HEADS, KV_HEADS, VOCAB, HEAD_DIM, LENGTH, LAYERS, EXPERT)

# logical name -> mesh axis, tuple of mesh axes, or None (replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
  (BATCH, BATCH_AXES),
  (EMBED, FSDP),
  (MLP, TENSOR),
  (HEADS, TENSOR),
  (KV_HEADS, TENSOR),
  (VOCAB, TENSOR),
  (HEAD_DIM, None),
  (LENGTH, None),
  (LAYERS, None),
  (EXPERT, None),
)

_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


def make_mesh(
  data: int = -1,
  fsdp: int = 1,
  tensor: int = 1,
  *,
  devices: Sequence[Any] | None = None,
  axis_type: AxisType = AxisType.Auto,
) -> Mesh:
  """Builds a ``(data, fsdp, tensor)`` mesh.

  Exactly one axis may be ``-1``; it takes all remaining devices.

  Args:
    data: size of the data-parallel axis, or -1.
    fsdp: size of the fully-sharded data-parallel axis (shards ``embed``), or -1.
    tensor: size of the tensor-parallel axis, or -1.
    devices: devices to use; default ``jax.devices()``.
    axis_type: ``AxisType`` given explicitly for all three axes. ``Auto`` lets
      XLA propagate shardings inside jitted code; jit boundaries carry explicit
      in/out shardings either way.

  Returns:
    A ``jax.sharding.Mesh`` with axis names ``("data", "fsdp", "tensor")``.

  Raises:
    ValueError: naming the field when a size is invalid or does not divide the
      device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  sizes = {DATA: data, FSDP: fsdp, TENSOR: tensor}
  fill = [name for name, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ValueError(f"mesh: only one axis may be -1, got {fill}")
  for name, s in sizes.items():
    if s != -1 and (not isinstance(s, int | np.integer) or s < 1):
      raise ValueError(f"mesh.{name} must be a positive int or -1, got {s!r}")
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  if fill:
    if n % fixed:
      raise ValueError(
        f"mesh.{fill[0]}=-1: {n} devices do not divide by the product {fixed} of the "
        f"other axes (data={data}, fsdp={fsdp}, tensor={tensor})"
      )
    sizes[fill[0]] = n // fixed
  elif fixed != n:
    raise ValueError(
      f"mesh: data*fsdp*tensor = {fixed} must equal the number of devices {n} "
      f"(data={data}, fsdp={fsdp}, tensor={tensor})"
    )
  shape = tuple(sizes[a] for a in MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types=(axis_type,) * 3, devices=devices)


def axis_size(mesh: Mesh | jax.sharding.AbstractMesh, axes: str | tuple[str, ...] | None) -> int:
  """Number of devices along one mesh axis or a tuple of axes (1 for None)."""
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return int(np.prod([mesh.shape[a] for a in axes]))


def logical_to_spec(
  names: Sequence[str | None] | None,
  shape: Sequence[int] | None = None,
  mesh: Mesh | jax.sharding.AbstractMesh | None = None,
  rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES,
) -> P:
  """Maps logical axis names to a ``PartitionSpec`` through the rules table.

  A mesh axis is used at most once per spec (first dimension wins). When
  ``shape`` and ``mesh`` are given, dimensions that do not divide evenly by
  their mesh axes are replicated instead.

  Args:
    names: one logical name (or None) per array dimension; None for a scalar
      or unannotated array.
    shape: the array's shape, to check divisibility.
    mesh: the mesh, to check divisibility and drop size-1 axes.
    rules: (logical name, mesh axes) pairs.

  Returns:
    A ``PartitionSpec`` over mesh axis names.

  Raises:
    ValueError: if a logical name is not in the rules table.
  """
  if not names:
    return P()
  table = dict(rules)
  used: set[str] = set()
  out: list = []
  for dim, name in enumerate(names):
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis name {name!r} has no rule; known: {sorted(table)}")
    axes = table[name]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if a not in used)
    if mesh is not None:
      axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)  # absent axes: size 1
      if shape is not None and axes and shape[dim] % axis_size(mesh, axes):
        axes = ()
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def _logical_names(leaf: Any) -> tuple[str | None, ...] | None:
  if isinstance(leaf, nnx.Variable):
    meta = leaf.get_metadata()
    for k in _METADATA_KEYS:
      names = meta.get(k)
      if isinstance(names, tuple | list) and all(isinstance(n, str | None) for n in names):
        return tuple(names)
  return None


def tree_shardings(
  tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES
) -> Any:
  """``NamedSharding`` for every array of a pytree from its logical axis names.

  Works on NNX parameter states and on optimizer states derived from them
  (optax keeps the NNX variables and their metadata). Arrays without logical
  names (step counters, scalars) are replicated.

  Args:
    tree: pytree whose leaves are arrays, ``jax.ShapeDtypeStruct`` or NNX
      variables holding them.
    mesh: the device mesh.
    rules: (logical name, mesh axes) pairs.

  Returns:
    A pytree of ``NamedSharding`` with the same leaf structure as ``tree``.
  """

  def one(leaf):
    if isinstance(leaf, nnx.Variable):
      shape = np.shape(leaf.get_value())
      spec = logical_to_spec(_logical_names(leaf), shape, mesh, rules)
      if len(spec) > len(shape):
        spec = P()
      return leaf.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_params(state: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES):
  """Places a parameter (or optimizer) state on the mesh by its logical names.

  Args:
    state: NNX state (e.g. from ``nnx.split(model)``) or any pytree of arrays.
    mesh: the device mesh.
    rules: (logical name, mesh axes) pairs.

  Returns:
    The same pytree with every array placed with its ``NamedSharding``.
  """
  return put(state, tree_shardings(state, mesh, rules))


def put(tree: Any, shardings: Any) -> Any:
  """``jax.device_put`` that also places values on devices of other processes.

  With several processes a ``NamedSharding`` spans devices this process cannot
  address, and ``jax.device_put`` refuses a process-local (committed) array.
  Here every process passes the same global value (parameters built from the
  seed, PRNG keys, replicated scalars); each keeps the pieces its own devices
  hold, with no communication. Arrays that already span several processes are
  resharded by ``jax.device_put``. With one process this is ``jax.device_put``.

  Args:
    tree: pytree of arrays (PRNG key arrays included) or host values, the same
      global value on every process.
    shardings: a sharding, or a pytree of shardings mirroring ``tree``.

  Returns:
    ``tree`` placed with ``shardings``.
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _put_one(x, shardings), tree)
  return jax.tree.map(_put_one, tree, shardings)


def _put_one(x: Any, sharding: jax.sharding.Sharding) -> Any:
  if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(x)
    return jax.random.wrap_key_data(_put_one(jax.random.key_data(x), sharding), impl=impl)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  """Sharding of one batch-major array: leading axis over ``(data, fsdp)``."""
  if ndim == 0:
    return NamedSharding(mesh, P())
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
  """Shardings for a batch pytree (e.g. ``TrainBatch``): rows over ``(data, fsdp)``.

  Args:
    batch: pytree of arrays with a shared leading batch axis.
    mesh: the device mesh.

  Returns:
    A pytree of ``NamedSharding`` of the same structure.

  Raises:
    ValueError: naming the field whose batch size does not divide by
      ``data * fsdp``.
  """
  n = axis_size(mesh, BATCH_AXES)
  fields = getattr(batch, "_fields", None)
  leaves = batch._asdict() if fields else {str(i): x for i, x in enumerate(jax.tree.leaves(batch))}
  for name, x in leaves.items():
    if x is not None and np.ndim(x) and np.shape(x)[0] % n:
      raise ValueError(
        f"batch.{name}: batch size {np.shape(x)[0]} does not divide by data*fsdp = {n}"
      )
  return jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x)), batch)


def shard_batch(batch: Any, mesh: Mesh) -> Any:
  """Places a batch pytree on the mesh, rows split over ``(data, fsdp)``."""
  return put(batch, batch_shardings(batch, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated sharding on ``mesh``."""
  return NamedSharding(mesh, P())


def replicated_int(mesh: Mesh, x: int) -> jax.Array:
  """``x`` as an int32 scalar replicated on ``mesh`` (a program's step or seed)."""
  return jax.device_put(np.int32(x), replicated(mesh))


def constrain(
  x: jax.Array,
  names: Sequence[str | None],
  mesh: Mesh | None = None,
  rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES,
) -> jax.Array:
  """Sharding constraint by logical names, for use inside jitted code.

  A no-op when no mesh is given and none is set with ``jax.set_mesh``.

  Args:
    x: array to constrain.
    names: one logical name (or None) per dimension of ``x``.
    mesh: the mesh; default the ambient mesh.
    rules: (logical name, mesh axes) pairs.

  Returns:
    ``x`` with a ``with_sharding_constraint`` applied.
  """
  target: Mesh | jax.sharding.AbstractMesh | None = mesh
  if target is None:
    target = jax.sharding.get_abstract_mesh()
    if target is None or target.empty:
      return x
  spec = logical_to_spec(names, x.shape, target, rules)
  sharding = NamedSharding(target, spec) if isinstance(target, Mesh) else spec
  return jax.lax.with_sharding_constraint(x, sharding)
