"""The decoder's blocks stored per layer or stacked over layers, and the conversion both ways.

Per layer (models under `config.STACK_FROM_PARAMS` parameters by default):
``state["layers"][i][...]``, one leaf per layer and kind of weight (an
`nnx.List` of blocks). Stacked (`ModelConfig.scan_layers`,
MaxText's `scan_layers`): ``state["layers"][...]``, one leaf per kind of weight
with a leading [L] axis whose logical name is `sharding.LAYERS`; the blocks
run as one `lax.scan` over it, and the optimizer's per-leaf code no longer
grows with depth.

A stacked model holds the same numbers as the per-layer one built from the
same key: the blocks are drawn one by one as before and then stacked
(`stack_modules`), so a seed's weights do not depend on the layout.

The tree functions (`stack`, `unstack`) convert any nested mapping in which a
``"layers"`` entry holds blocks by integer index (pure dicts of parameters,
an optimizer state's moments): HF import/export and the PEFT adapters read
and write per layer through them, and a run resumed in the other layout
converts its checkpoint's items (`run.relayout`; `axis` 1 for the snapshots'
parameters, stacked over slots first). A `jax.ShapeDtypeStruct` leaf keeps its
`NamedSharding`, the layer axis unsharded, so an abstract template converts too.

  stacked = layout.stack(per_layer_tree)     # {"layers": {0: t0, 1: t1}} -> {"layers": t[L]}
  per_layer = layout.unstack(stacked, 2)     # and back
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offpolicy_jax.scale import sharding

LAYERS_KEY = "layers"


def stack_modules(blocks: Sequence[nnx.Module]) -> nnx.Module:
  """One module of `blocks`' structure whose variables are stacked on a leading [L] axis.

  Each variable's logical axis names (`out_sharding`) gain `sharding.LAYERS` in front.
  """
  graphdef, _ = nnx.split(blocks[0])
  states = [nnx.split(block)[1] for block in blocks]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)

  def named(var):
    names = var.get_metadata().get("out_sharding")
    if names is not None:
      var.set_metadata(out_sharding=(sharding.LAYERS, *names))
    return var

  stacked = jax.tree.map(named, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, stacked)


def blocks(layers, config) -> list[Any]:
  """A decoder's blocks one by one: its `nnx.List`, or views of the stacked variables."""
  if not config.scan_layers:
    return list(layers)
  graphdef, state = nnx.split(layers)
  return [
    nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(config.num_layers)
  ]


def apply(layers, config, block, carry, keys=None, xs=None):
  """``carry, y_l = block(layer, carry, key_l, x_l)`` over a decoder's blocks (no cache).

  `keys`: the layers' dropout keys [L] (`lora_ops.fold_range`), or None;
  `xs`: per-layer inputs stacked [L, ...] (a pytree, None leaves allowed).
  Returns `(carry, ys)`, the y_l stacked [L, ...].

  Stacked blocks (``scan_layers``) run as one `lax.scan` over their variables
  (one block compiled); ``remat`` rematerialises each block in the backward pass.
  """
  if config.scan_layers:
    graphdef, stacked = nnx.split(layers)

    def scanned(carry, layer_xs):
      state, key, x = layer_xs
      return block(nnx.merge(graphdef, state), carry, key, x)

    if config.remat:
      scanned = jax.checkpoint(scanned)
    return jax.lax.scan(scanned, carry, (stacked, keys, xs))
  ys = []
  for i, layer in enumerate(layers):
    key = None if keys is None else keys[i]
    x = jax.tree.map(lambda a, i=i: a[i], xs)
    if config.remat:
      layer_def, state = nnx.split(layer)

      def run(state, carry, key, x, layer_def=layer_def):
        return block(nnx.merge(layer_def, state), carry, key, x)

      carry, y = jax.checkpoint(run)(state, carry, key, x)
    else:
      carry, y = block(layer, carry, key, x)
    ys.append(y)
  return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def apply_cached(layers, config, block, h, caches):
  """``h, cache_l, y_l = block(layer, h, caches_l)`` over a decoder's blocks (with KV caches).

  `caches`: a list of `KVCache`s (or one), whose ``k``/``v`` are a tuple of L
  per-layer arrays (per-layer blocks) or one array stacked [L, ...] (stacked
  blocks); `caches_l` their l-th entries. Returns `(h, caches, ys)`: the new
  caches in the same layout, the y_l stacked [L, ...] (None leaves allowed).

  Stacked blocks with ``scan_decode`` run as one `lax.scan`, the written cache
  carried and updated in place (the decode step compiles one block whatever
  the depth); without it, one by one on views of the stacked variables (the
  samplers take `for_decoding`'s per-layer model instead).
  """
  if config.scan_layers and config.scan_decode:
    graphdef, stacked = nnx.split(layers)
    written = caches[-1] if isinstance(caches, list) else caches  # the one the block returns
    read = caches[:-1] if isinstance(caches, list) else None

    def scanned(carry, xs):
      h, out = carry
      state, i, ro = xs
      mine = jax.tree.map(lambda c: c[i], out)
      h, new, y = block(nnx.merge(graphdef, state), h, mine if ro is None else [*ro, mine])
      out = jax.tree.map(lambda c, x: jax.lax.dynamic_update_index_in_dim(c, x, i, 0), out, new)
      return (h, out), y

    n = config.num_layers
    (h, out), ys = jax.lax.scan(scanned, (h, written), (stacked, jnp.arange(n), read))
    return h, out, ys
  per_layer = lambda c: type(c) is tuple  # noqa: E731  (a KVCache's tuple of L arrays)
  outs = []
  for i, layer in enumerate(blocks(layers, config)):
    h, cache, y = block(layer, h, jax.tree.map(lambda c, i=i: c[i], caches, is_leaf=per_layer))
    outs.append((cache, y))
  new = jax.tree.map(lambda *c: tuple(c), *(c for c, _ in outs))
  return h, new, jax.tree.map(lambda *y: jnp.stack(y), *(y for _, y in outs))


def for_decoding(model):
  """The model the samplers decode with: stacked blocks without ``scan_decode`` as a
  per-layer model (its variables sliced once per sampler call, not per token; traceable).

  A decode step over per-layer weights and caches runs faster than one scanned
  over stacked ones on the CPU (docs/results/compile_time.md); its compile
  time grows with depth, which ``scan_decode`` trades for the scan's.
  """
  c = model.config
  if not c.scan_layers or c.scan_decode:
    return model
  view = nnx.merge(*nnx.split(model))  # a new module on the same arrays
  graphdef, state = nnx.split(model.layers)
  # The barrier keeps the slices out of the decode loop (else XLA may slice per token).
  sliced = jax.lax.optimization_barrier(
    [jax.tree.map(lambda a, i=i: a[i], state) for i in range(c.num_layers)]
  )
  view.layers = nnx.List([nnx.merge(graphdef, s) for s in sliced])
  view.config = dataclasses.replace(c, scan_layers=False)
  return view


def relayout(model, scan_layers: bool):
  """`model` (a `Decoder`) with its blocks stored per layer or stacked: the same weights."""
  config = dataclasses.replace(model.config, scan_layers=scan_layers)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0))))
  pure = nnx.to_pure_dict(nnx.state(model))
  nnx.replace_by_pure_dict(state, stack(pure) if scan_layers else unstack(pure, config.num_layers))
  return nnx.merge(graphdef, state)


def weight_ndim(path, x) -> int:
  """The dims of a leaf's weight, its stacked `layers` axis not counted (a key path's leaf).

  A rule on a parameter's rank (weight decay on matrices only) then gives the
  same answer in both layouts.
  """
  keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
  for i, k in enumerate(keys[:-1]):
    if k == LAYERS_KEY and not isinstance(keys[i + 1], int):
      return jnp.ndim(x) - 1
  return jnp.ndim(x)


def is_per_layer(node: Any) -> bool:
  """Whether a ``"layers"`` entry holds blocks by integer index (else: stacked)."""
  return isinstance(node, Mapping) and bool(node) and all(isinstance(k, int) for k in node)


def stack(tree: Any, axis: int = 0) -> Any:
  """`tree` with every per-layer ``"layers"`` entry stacked (arrays or ShapeDtypeStructs)
  on a new axis `axis` (0: leading).

  Recurses through mappings, lists and tuples (NamedTuples keep their type);
  other leaves and already stacked entries pass through.
  """
  return _convert(tree, lambda node: _stack_blocks(node, axis))


def unstack(tree: Any, num_layers: int, axis: int = 0) -> Any:
  """`tree` with every stacked ``"layers"`` entry split into `num_layers` blocks by index
  along axis `axis`.

  Raises:
    ValueError: a stacked leaf's axis `axis` is not `num_layers` long.
  """
  return _convert(tree, lambda node: _unstack_blocks(node, num_layers, axis))


def num_layers(tree: Any) -> int:
  """The decoder blocks a parameter tree holds, in either layout (its first ``"layers"``)."""
  node = tree[LAYERS_KEY]
  if is_per_layer(node):
    return len(node)
  return int(jax.tree.leaves(node)[0].shape[0])


def _convert(tree: Any, blocks_fn) -> Any:
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out[k] = (
        blocks_fn(v) if k == LAYERS_KEY and isinstance(v, Mapping) else _convert(v, blocks_fn)
      )
    return out
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple (optimizer states)
    return type(tree)(*(_convert(v, blocks_fn) for v in tree))
  if isinstance(tree, (list, tuple)):
    return type(tree)(_convert(v, blocks_fn) for v in tree)
  return tree


def _stack_blocks(node: Mapping, axis: int = 0) -> Any:
  if not is_per_layer(node):
    return node
  blocks = [node[i] for i in sorted(node)]
  if sorted(node) != list(range(len(blocks))):
    raise ValueError(f"layers {sorted(node)} are not 0..{len(blocks) - 1}: cannot stack them")
  return jax.tree.map(lambda *xs: _stack_leaves(*xs, axis=axis), *blocks)


def _stack_leaves(*xs, axis: int = 0):
  x = xs[0]
  if isinstance(x, jax.ShapeDtypeStruct):
    shape = (*x.shape[:axis], len(xs), *x.shape[axis:])
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=_spec_at(x.sharding, axis, insert=True))
  return jnp.stack(xs, axis=axis)


def _spec_at(sh, axis: int, insert: bool):
  """`sh` (a NamedSharding, or None) with the layer axis `axis` inserted (unsharded) or removed."""
  if not isinstance(sh, jax.sharding.NamedSharding):
    return sh
  spec = list(sh.spec) + [None] * max(0, axis + 1 - len(sh.spec))
  spec = [*spec[:axis], None, *spec[axis:]] if insert else spec[:axis] + spec[axis + 1 :]
  return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec))


def _unstack_blocks(node: Mapping, num_layers: int, axis: int = 0) -> Any:
  if is_per_layer(node) or not node:
    return node

  def check(path, x):
    if len(x.shape) <= axis or x.shape[axis] != num_layers:
      name = jax.tree_util.keystr(path)
      raise ValueError(
        f"layers{name} has shape {tuple(x.shape)}: not stacked over {num_layers} layers"
      )

  jax.tree_util.tree_map_with_path(check, node)
  return {i: jax.tree.map(lambda x, i=i: _index(x, i, axis), node) for i in range(num_layers)}


def _index(x, i: int, axis: int = 0):
  if isinstance(x, jax.ShapeDtypeStruct):
    shape = x.shape[:axis] + x.shape[axis + 1 :]
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=_spec_at(x.sharding, axis, insert=False))
  return jnp.take(x, i, axis=axis) if axis else x[i]


class LayerViews:
  """Per-layer arrays (e.g. memory-mapped HF tensors) read as one array stacked over layers.

  Indexing reads only the layers and the slice asked for (a device's shard).
  """

  def __init__(self, views: list):
    self.views = views
    self.shape = (len(views), *views[0].shape)

  def __array__(self, dtype=None, copy=None):
    out = self[(slice(None),)]
    return out if dtype is None else out.astype(dtype)

  def __getitem__(self, index) -> np.ndarray:
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):  # spelled out: one slice per axis it covers
      at = next(j for j, i in enumerate(index) if i is Ellipsis)
      fill = (slice(None),) * (len(self.shape) - len(index) + 1)
      index = (*index[:at], *fill, *index[at + 1 :])
    first, rest = (index[0], index[1:]) if index else (slice(None), ())
    if isinstance(first, (int, np.integer)):
      return np.asarray(self.views[first][rest])
    layers = range(len(self.views))[first]
    return np.stack([np.asarray(self.views[i][rest]) for i in layers])


def stack_views(views: dict, num_layers: int) -> dict:
  """`views` by our per-layer path, with ("layers", i, *rest) rows joined as ("layers", *rest)."""
  out: dict = {}
  for ours, view in views.items():
    if ours[0] == LAYERS_KEY:
      out.setdefault((ours[0], *ours[2:]), [None] * num_layers)[ours[1]] = view
    else:
      out[ours] = view
  return {k: LayerViews(v) if isinstance(v, list) else v for k, v in out.items()}
