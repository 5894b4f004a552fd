"""Orbax save/restore of a whole run: arrays (params, optimizer, buffer, snapshots) + JSON meta.

A checkpoint at step `t` holds two items:

- `arrays`: any pytree of arrays (the loop passes parameters, optimizer state,
  the replay buffer and the parameter snapshots the lag schedule still needs).
  It is stored flat, leaf `i` under the key `"%06d" % i`, so any pytree type
  (NamedTuples, `nnx.State`, optax states) round-trips through the template
  given at restore time; typed PRNG keys are stored as their raw key data.
- `meta`: a JSON dict (step, seed, data iterator state, snapshot versions...).
  `bytes` values are stored base64-encoded and decoded back on restore.

Writes are atomic (orbax writes into a temporary directory and renames it when
complete), keep the last `max_to_keep`, and are asynchronous: `save` returns
once arrays are copied off the device. A run killed mid-save restores the
previous complete step.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_BYTES_TAG = "__bytes_b64__"


def _encode_json(obj: Any) -> Any:
  if isinstance(obj, bytes):
    return {_BYTES_TAG: base64.b64encode(obj).decode("ascii")}
  if isinstance(obj, dict):
    return {str(k): _encode_json(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_encode_json(v) for v in obj]
  if isinstance(obj, np.generic):
    return obj.item()
  return obj


def _decode_json(obj: Any) -> Any:
  if isinstance(obj, dict):
    if set(obj) == {_BYTES_TAG}:
      return base64.b64decode(obj[_BYTES_TAG])
    return {k: _decode_json(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_decode_json(v) for v in obj]
  return obj


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _flatten(tree: Any) -> dict[str, Any]:
  leaves = jax.tree.leaves(tree)
  return {f"{i:06d}": (jax.random.key_data(x) if _is_key(x) else x) for i, x in enumerate(leaves)}


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  if _is_key(x):
    x = jax.eval_shape(jax.random.key_data, x)
  if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
    return x
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


class Checkpointer:
  """Keeps the last `max_to_keep` complete checkpoints of a run under `directory`.

  Args:
    directory: where step directories go (created if missing).
    max_to_keep: number of most recent checkpoints kept.
    async_save: write in a background thread after the device-to-host copy.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 2, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=True,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=("arrays", "meta")
    )

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of every complete checkpoint kept, ascending."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, arrays: Any, meta: dict[str, Any]) -> None:
    """Starts saving `arrays` (a pytree) and `meta` (JSON-able dict) as step `step`."""
    self._manager.save(
      int(step),
      args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(_flatten(arrays)),
        meta=ocp.args.JsonSave(_encode_json(dict(meta))),
      ),
    )

  def restore_meta(self, step: int | None = None) -> dict[str, Any]:
    """Reads only the JSON meta of `step` (default: latest)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return _decode_json(out["meta"])

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Restores step `step` (default: latest) into the structure of `template`.

    Args:
      template: a pytree with the structure, shapes, dtypes (and shardings) of
        what was saved: concrete arrays or `jax.ShapeDtypeStruct`s.
      step: which checkpoint; None for the latest.

    Returns:
      (arrays pytree shaped like `template`, meta dict).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    leaves, treedef = jax.tree.flatten(template)
    abstract = {f"{i:06d}": _abstract(x) for i, x in enumerate(leaves)}
    out = self._manager.restore(
      step,
      args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
      ),
    )
    restored = [
      jax.random.wrap_key_data(out["arrays"][f"{i:06d}"], impl=jax.random.key_impl(x))
      if _is_key(x)
      else out["arrays"][f"{i:06d}"]
      for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, restored), _decode_json(out["meta"])

  def wait(self) -> None:
    """Blocks until any pending asynchronous save has been committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager (orbax's close waits)."""
    self._manager.close()
