"""A run's checkpoint read in the other layout of the decoder blocks (`model_scan_layers`).

A checkpoint records how its parameters store the decoder blocks (meta
``layers``: "per layer" or "stacked", `models.layout`). A run whose model
stores them the other way (a resume with `--config.model_scan_layers` changed,
with `--allow_config_change`; an evaluation or export of the checkpoint)
restores each item that holds parameters into a template converted to the
checkpoint's layout, abstract (no second copy of the state is allocated),
and converts what it read back, onto the run's own shardings. The numbers are
the same; only where they are stored changes:

  items, meta = relayout.restore(ckpt, templates, step=None, stacked=True, workdir=...)

The items that hold parameters and the axis of their layers are `LAYER_AXIS`
(the lag snapshots stack their parameters over slots first); the others
(replay buffer, counters, the rollout's carried state) hold none and are read
as they are. The layout is read per step: a resume that falls back past a
corrupt step reads an older one in the layout that step recorded (a workdir
resumed in the other layout holds both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from offpolicy_jax import models
from offpolicy_jax.models import layout
from offpolicy_jax.store import checkpointing
from offpolicy_jax.store import workdir as workdir_lib

# The checkpoint items (`run_state.state_items`) that hold parameters: the axis of their layers.
LAYER_AXIS = {"params": 0, "opt_state": 0, "ref_params": 0, "snapshots": 1}
STACKED, PER_LAYER = "stacked", "per layer"


def layout_of(params) -> str:
  """How a parameter tree stores its decoder blocks: `STACKED` or `PER_LAYER`."""
  node = params[layout.LAYERS_KEY] if layout.LAYERS_KEY in params else None
  return STACKED if node is not None and not layout.is_per_layer(node) else PER_LAYER


def recorded(ckpt, step: int | None) -> str | None:
  """The layout checkpoint `step` (None: the latest) records, or None when its meta is
  unreadable (a corrupt step: the restore reports it)."""
  try:
    meta = ckpt.restore_meta(step)
  except checkpointing.CheckpointError:
    return None
  return meta.get("layers", PER_LAYER)  # written before stacking existed: per layer


def restore(
  ckpt, templates: Mapping[str, Any], *, step: int | None, stacked: bool, workdir: str, latest=False
) -> tuple[dict[str, Any], dict[str, Any], int]:
  """`(items, meta, step)` of a checkpoint written in either layout, as `templates` store them.

  Args:
    ckpt: the run's `checkpointing.Checkpointer`.
    templates: the items by name, in this run's layout (`run_state.state_items`).
    step: the step to read (None: the latest), or with `latest` the newest intact one
      (`Checkpointer.restore_latest`, falling back past corrupt steps).
    stacked: whether this run's model stacks its blocks (`ModelParts.stacked`).
    workdir: the run's directory (for the message).

  Raises:
    workdir.ConfigChanged: naming `model_scan_layers`, a checkpoint whose blocks
      cannot be converted to this run's (another number of layers).
  """
  has = STACKED if stacked else PER_LAYER
  layers = layout.num_layers(templates["params"])
  there = lambda t, ax: layout.unstack(t, layers, ax) if stacked else layout.stack(t, ax)
  other = []  # the layouts of steps read in the other one

  def read_for(at: int | None) -> Mapping[str, Any]:
    """The templates in the layout step `at` records (the latest: None)."""
    had = recorded(ckpt, at)
    if had is None or had == has:
      return templates
    other.append(had)
    return {
      k: _converted(there, _abstract(v), k) if k in LAYER_AXIS else v for k, v in templates.items()
    }

  try:
    if latest:
      items, meta, step = ckpt.restore_latest(templates, templates_for=read_for)
    else:
      items, meta = ckpt.restore(read_for(step), step)
      step = meta.get("step", step)
  except (ValueError, checkpointing.CheckpointError) as e:
    if not other:
      raise
    raise workdir_lib.ConfigChanged(
      f"config.model_scan_layers: {workdir}'s checkpoint stores the decoder blocks "
      f"{other[0]} and cannot be read as this run's {has} ones ({e})"
    ) from None
  had = meta.get("layers", PER_LAYER)
  if had != has:
    back = lambda t, ax: layout.stack(t, ax) if stacked else layout.unstack(t, layers, ax)
    # Item by item, each read copy dropped once converted: one item's worth of extra memory.
    for k in [k for k in items if k in LAYER_AXIS]:
      items[k] = _placed_like(templates[k], _converted(back, items.pop(k), k))
    if jax.process_index() == 0:
      print(f"read the checkpoint of step {step}'s decoder blocks {had} as {has}", flush=True)
  return items, meta, step


def fingerprint_matches(recorded: str | None, base, stacked: bool, own: str | None = None) -> bool:
  """Whether `recorded` (a checkpoint's record of a LoRA run's frozen base) is `base`'s
  fingerprint in either layout: a checkpoint written in the other layout recorded the
  digits of its own (`models.lora.fingerprint`, the other view computed without a copy).
  `own`: `base`'s own digits when the caller has them already."""
  if recorded == (own or models.lora.fingerprint(base)):
    return True
  layers = layout.num_layers(base)
  other = (lambda t: layout.unstack(t, layers)) if stacked else layout.stack
  return recorded == models.lora.fingerprint(base, view=other)


def _converted(fn, item, name: str):
  return fn(item, LAYER_AXIS[name]) if name in LAYER_AXIS else item


def _abstract(item):
  """`item` as ShapeDtypeStructs with its shardings (a template that allocates nothing)."""
  if not _all_arrays(item):
    return item
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return jax.tree.map(sds, item)


def _all_arrays(item) -> bool:
  return all(isinstance(x, jax.Array) for x in jax.tree.leaves(item))


def _placed_like(template, tree):
  """`tree` (converted back, plain mappings) in `template`'s structure and shardings, matched
  leaf by key path."""
  if not _all_arrays(template):
    return tree
  by_path = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  leaves = [jax.device_put(by_path[jax.tree_util.keystr(p)], t.sharding) for p, t in paths]
  return jax.tree.unflatten(treedef, leaves)
