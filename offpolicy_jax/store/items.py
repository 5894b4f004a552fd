"""How a pytree is stored as a named checkpoint item, and rebuilt from one.

A run-state field (parameters, optimizer state, replay buffer, ...) is stored
as nested dicts keyed by the names along its tree paths: dict keys, NamedTuple
field names, list indices ("0", "1"), `nnx.State` paths. An `nnx.Variable` is
stored as its value and a typed PRNG key as its key data, so plain orbax reads
the item without templates. `rebuild` puts stored leaves back into a
template's own pytree types, matching by path name. The JSON meta's `bytes`
values go through base64 (`encode_json` / `decode_json`).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

_BYTES_TAG = "__bytes_b64__"


def encode_json(obj: Any) -> Any:
  if isinstance(obj, bytes):
    return {_BYTES_TAG: base64.b64encode(obj).decode("ascii")}
  if isinstance(obj, dict):
    return {str(k): encode_json(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [encode_json(v) for v in obj]
  if isinstance(obj, np.generic):
    return obj.item()
  return obj


def decode_json(obj: Any) -> Any:
  if isinstance(obj, dict):
    if set(obj) == {_BYTES_TAG}:
      return base64.b64decode(obj[_BYTES_TAG])
    return {k: decode_json(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [decode_json(v) for v in obj]
  return obj


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _value(leaf: Any) -> Any:
  return leaf.get_value() if _is_variable(leaf) else leaf


def abstract(x: Any) -> jax.ShapeDtypeStruct:
  if _is_key(x):
    x = jax.eval_shape(jax.random.key_data, x)
  if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
    return x
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _key_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _named_leaves(tree: Any) -> tuple[list[tuple[str, ...]], list[Any], Any]:
  """(path names, leaves, treedef) of `tree`, each `nnx.Variable` one leaf."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
  paths = [tuple(_key_name(k) for k in path) or ("value",) for path, _ in flat]
  return paths, [leaf for _, leaf in flat], treedef


def nested(tree: Any, fn: Callable[[Any], Any]) -> dict[str, Any]:
  """`{name0: {name1: ... fn(value)}}` along each leaf's path names (empty without leaves)."""
  out: dict[str, Any] = {}
  for path, leaf in zip(*_named_leaves(tree)[:2], strict=True):
    node = out
    for name in path[:-1]:
      node = node.setdefault(name, {})
      if not isinstance(node, dict):
        raise ValueError(f"checkpoint item has a leaf and a subtree at {'/'.join(path)}")
    if path[-1] in node:
      raise ValueError(f"checkpoint item has two leaves at {'/'.join(path)}")
    node[path[-1]] = fn(_value(leaf))
  return out


def stored(x: Any) -> Any:
  return jax.random.key_data(x) if _is_key(x) else x


def rebuild(template: Any, stored: dict[str, Any]) -> Any:
  """The tree of `template` with each leaf taken from `stored` (nested as `nested` does)."""
  paths, leaves, treedef = _named_leaves(template)
  out = []
  for path, leaf in zip(paths, leaves, strict=True):
    x: Any = stored
    for name in path:
      x = x[name]
    if _is_key(value := _value(leaf)):
      # A ShapeDtypeStruct has no public accessor for its key implementation.
      sds = isinstance(value, jax.ShapeDtypeStruct)
      x = jax.random.wrap_key_data(x, impl=value.dtype._impl if sds else jax.random.key_impl(value))
    out.append(leaf.replace(x) if _is_variable(leaf) else x)
  return jax.tree.unflatten(treedef, out)
