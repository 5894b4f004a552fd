"""Orbax save/restore of a run as named items (params, optimizer state, buffer...) + JSON meta.

Step `t` of a checkpoint directory holds one orbax item per name, as in flax's
gemma example:

- `<t>/<name>/` for each item given to `save` (e.g. `params`, `opt_state`,
  `replay`): a standard orbax pytree of nested dicts keyed by the names along
  the item's tree paths (dict keys, NamedTuple fields, list indices "0", "1",
  `nnx.State` paths). An `nnx.Variable` is stored as its value, a typed PRNG
  key as its key data, an item that is a single array as `{"value": array}`.
  So plain orbax reads an item by name, without templates:
  `ocp.StandardCheckpointer().restore(f"{directory}/{t}/params")`.
- `<t>/meta/`: a JSON dict (step, seed, data iterator state...); `bytes`
  values are stored base64-encoded and decoded back.

Restores read only the items they are given templates for, into the
templates' pytree types (NamedTuples, `nnx.State`, optax states), shapes,
dtypes and shardings, matching leaves by path name.

Saves are atomic (orbax renames a complete temporary directory), keep the last
`max_to_keep` steps, and are asynchronous: `save` returns once the arrays are
off the device. Each committed step gets a manifest of its files' sha256
digests (`integrity`; written in the background after an
asynchronous save, and `save`, `wait`, `close` and every read wait for it).
Restores check the files they will read first: their items', meta's and the
step's own; a step without a manifest restores unverified, with a warning.
`restore_latest` falls back past corrupt steps, then moves them to
`<directory>/corrupt/<t>` so the run can save `t` again.

Checkpoints of offpolicy_jax 0.1.x held one item, `arrays`,
its leaves flat under "000000", "000001", ...: their meta reads, their arrays
raise a `CheckpointError`.

Multi-process runs: every process calls `save` and the restores; process 0
alone writes the manifests and moves corrupt steps aside.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

# orbax 0.12.8 (pinned) names its default jax.Array handler's metadata store only here.
from orbax.checkpoint._src.metadata import array_metadata_store

from offpolicy_jax import errors
from offpolicy_jax.store import integrity
from offpolicy_jax.store import items as named

_META = "meta"
_FLAT_ITEM = "arrays"  # the one item of the old flat-index format
_FLAT = "old flat-index format"
_FLAT_FORMAT = (
  "checkpoint step {step} under {directory} is in the old flat-index format (one item 'arrays', "
  "leaves under 000000, 000001, ...) written by offpolicy_jax 0.1.x, which cannot be restored "
  "by name; resume it with offpolicy_jax 0.1.x (or start a fresh run)"
)
_ITEM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_log = logging.getLogger(__name__)


class MissingCheckpoint(errors.WorkdirError, FileNotFoundError):
  """No checkpoint at the step asked for (or none at all)."""


class CheckpointError(RuntimeError):
  """A checkpoint step is corrupt or unreadable by name, or no step could be restored.

  Attributes:
    failures: `(step, reason)` for every step tried, newest first.
  """

  def __init__(self, message: str, failures: Sequence[tuple[int, str]] = ()):
    super().__init__(message)
    self.failures = list(failures)


class _Corrupt(Exception):
  """Internal: one step failed verification or restore; the message is the reason."""


def _check_names(names: Iterable[str]) -> None:
  for name in names:
    if not _ITEM_NAME.fullmatch(name) or name in (_META, _FLAT_ITEM):
      raise ValueError(f"checkpoint item name {name!r}: not {_ITEM_NAME.pattern}, or reserved")


def _listdir(path: str) -> list[str]:
  try:
    return os.listdir(path)
  except (FileNotFoundError, NotADirectoryError):
    return []


def _whole_replicas_on_cpu() -> None:
  """On CPU, orbax saves each replicated array from one device instead of slicing it.

  Orbax splits the write of an array replicated over R devices into R slices,
  one per device, to run the device-to-host copies in parallel (it turns this
  off itself on GPU). Each slice is a program compiled per device and shape. On
  CPU the devices' memory is the host's, so the split only adds compilations:
  the main job's parameters and Adam state on 8 CPU devices took 2.1 s and 72
  compiled programs to save the first time with it, 0.13 s without
  (`benchmarks/checkpoint_save.py`, docs/results/speed.md). The arrays read
  back the same; only their chunking on disk differs (one chunk instead of R),
  and steps written with the split restore as before. The setting is orbax's
  process-wide jax.Array handler, as `register_type_handler` is meant for; TPU
  and GPU keep orbax's default.
  """
  if jax.default_backend() != "cpu":
    return
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  if isinstance(handler, _WholeReplicaArrayHandler):
    return
  ocp.type_handlers.register_type_handler(jax.Array, _WholeReplicaArrayHandler(), override=True)


class _WholeReplicaArrayHandler(ocp.type_handlers.ArrayHandler):
  """Orbax's default jax.Array handler with replica-parallel saving off."""

  def __init__(self):
    super().__init__(array_metadata_store=array_metadata_store.Store(), use_replica_parallel=False)


class Checkpointer:
  """Keeps the last `max_to_keep` complete checkpoints of a run under `directory`.

  Every committed step gets a manifest of digests (see the module docstring);
  resume with `restore_latest`, which skips corrupt steps.

  Args:
    directory: where step directories go (created if missing).
    max_to_keep: number of most recent checkpoints kept (None: every one).
    async_save: write in a background thread after the device-to-host copy.
    create: make `directory` if it is missing; False (readers: eval, export)
      raises `MissingCheckpoint` instead.
  """

  def __init__(
    self,
    directory: str,
    *,
    max_to_keep: int | None = 2,
    async_save: bool = True,
    create: bool = True,
  ):
    self.directory = os.path.abspath(directory)
    if not create and not any(name.isdigit() for name in _listdir(self.directory)):
      # Refused before orbax starts its threads (a reader then exits cleanly).
      raise MissingCheckpoint(f"no checkpoint under {self.directory} (none there yet)")
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=create,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
    )
    # No item names: orbax takes each step's from its `Composite` args. `quiet`: orbax
    # logs an ERROR per unreadable step metadata; `restore_latest` explains.
    # (`quiet` also drops the warning orbax logs when a type handler is replaced.)
    with integrity.quiet():
      _whole_replicas_on_cpu()
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._async = async_save
    # Process 0 writes the manifests and sets corrupt steps aside.
    self._primary = jax.process_index() == 0
    self._pending: list[int] = []  # saved by this process, manifest not yet written
    self._writer: threading.Thread | None = None

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step (intact or not), or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of every complete checkpoint kept, ascending."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Starts saving `items` and `meta` as step `step`.

    Args:
      step: the checkpoint's step.
      items: pytrees of arrays by item name, e.g. `{"params": ..., "opt_state":
        ..., "replay": ...}`; names match `[A-Za-z0-9][A-Za-z0-9_-]*` and are
        neither "meta" nor "arrays". None values and trees without arrays are
        not stored (their templates restore as themselves).
      meta: a JSON-able dict; `bytes` values are allowed.
    """
    _check_names(items)
    stored = {
      name: named.nested(tree, named.stored) for name, tree in items.items() if tree is not None
    }
    args = {name: ocp.args.StandardSave(tree) for name, tree in stored.items() if tree}
    self._flush()
    saved = self._manager.save(
      int(step),
      args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(named.encode_json(dict(meta)))),
    )
    if not saved or not self._primary:
      return
    self._pending.append(int(step))
    if self._async:
      self._writer = threading.Thread(
        target=self._write_manifests_in_background, name="checkpoint-manifests"
      )
      self._writer.start()
    else:
      self._write_manifests()

  def verify(self, step: int) -> str | None:
    """Checks every file of step `step` against its manifest.

    Returns:
      None when sizes and sha256 digests all match; otherwise the reason, e.g.
      `"no manifest"`, `"missing file params/_METADATA"`, `"size mismatch in
      replay/d/1f2e: 12 bytes, 411 expected"`, `"digest mismatch in meta/metadata"`.
    """
    self._flush()
    self._require(int(step))
    return integrity.check(self._step_dir(int(step)))

  def restore_meta(self, step: int | None = None) -> dict[str, Any]:
    """Reads only the JSON meta of `step` (default: latest), checking its files' digests.

    Only the `meta` item and the step's top-level files are hashed, so this
    stays cheap; it does not fall back (resume with `restore_latest`, which
    returns the meta of the step it restored).

    Raises:
      FileNotFoundError: no such step.
      CheckpointError: the meta files are corrupt or cannot be read.
    """
    self._flush()
    step = self._require(step)
    try:
      return named.decode_json(
        self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      )
    except _Corrupt as e:
      raise CheckpointError(f"checkpoint step {step} is corrupt ({e})", [(step, str(e))]) from None

  def restore(
    self, templates: Mapping[str, Any], step: int | None = None
  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores the items named in `templates` from exactly step `step` (default: latest).

    Only those items' files (and meta's) are verified and read; no fallback
    (see `restore_latest`). An eval binary restores `{"params": abstract}`
    without building the other items.

    Args:
      templates: by item name, a pytree with the structure, shapes, dtypes
        (and shardings) of what was saved: concrete arrays or
        `jax.ShapeDtypeStruct`s. A None template, or one without arrays,
        comes back as itself, unread.
      step: which checkpoint; None for the latest.

    Returns:
      (items by the names of `templates`, each shaped like its template; meta dict).

    Raises:
      FileNotFoundError: no such step.
      CheckpointError: the step is corrupt, lacks an item, is in the old
        flat-index format, or orbax failed to read it.
    """
    _check_names(templates)
    self._flush()
    step = self._require(step)
    try:
      return self._restore_step(templates, step)
    except _Corrupt as e:
      raise CheckpointError(f"checkpoint step {step} is corrupt ({e})", [(step, str(e))]) from None

  def restore_latest(
    self,
    templates: Mapping[str, Any],
    templates_for: Callable[[int], Mapping[str, Any]] | None = None,
  ) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Restores the items named in `templates` from the newest intact step, falling back.

    A step is corrupt when a file it reads is missing, unexpected, or differs
    from its manifest in size or digest, or when orbax's restore raises. Each
    logs one warning (`checkpoint step 40 is corrupt (...); falling back to
    step 36`). Once an older step restores, the corrupt newer ones are moved to
    `<directory>/corrupt/<step>` (never deleted); when none restores, nothing
    is moved. A step lacking an item or in the old flat-index format is not
    corrupt: it raises at once.

    Args:
      templates: as for `restore`.
      templates_for: `step -> templates` where a step's items are stored otherwise
        (`run.relayout`: another layout of the decoder blocks); default `templates`.

    Returns:
      (items by the names of `templates`, meta dict, the step restored).

    Raises:
      FileNotFoundError: there is no checkpoint at all.
      CheckpointError: no step is intact, or the newest intact one lacks an
        item or is in the old format; its one-line message says why.
    """
    _check_names(templates)
    self._flush()
    steps = self.all_steps()[::-1]
    if not steps:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    failures: list[tuple[int, str]] = []
    for i, step in enumerate(steps):
      try:
        items, meta = self._restore_step(templates_for(step) if templates_for else templates, step)
      except _Corrupt as e:
        failures.append((step, str(e)))
        then = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no older step"
        _log.warning("checkpoint step %d is corrupt (%s); %s", step, e, then)
        continue
      except CheckpointError as e:
        raise CheckpointError(str(e), failures + e.failures) from None
      self._set_aside([s for s, _ in failures])
      return items, meta, step
    tried = "; ".join(f"step {s}: {reason}" for s, reason in failures)
    raise CheckpointError(f"no intact checkpoint under {self.directory} ({tried})", failures)

  def wait(self) -> None:
    """Blocks until pending saves are committed and have their manifests."""
    self._flush()

  def close(self) -> None:
    """Waits for pending saves and their manifests, then releases the manager."""
    try:
      self._flush()
    finally:
      self._manager.close()

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _require(self, step: int | None) -> int:
    step = self.latest_step() if step is None else int(step)
    steps = self.all_steps()
    if step is None or step not in steps:
      what = "checkpoint" if step is None else f"checkpoint step {step}"
      have = f"steps there: {', '.join(map(str, steps))}" if steps else "none there yet"
      raise MissingCheckpoint(f"no {what} under {self.directory} ({have})")
    return step

  def _write_manifests(self) -> None:
    """Waits for orbax to commit the pending saves (re-raising a failed one), writes manifests."""
    self._manager.wait_until_finished()
    committed = set(self._manager.all_steps())
    for step in self._pending:
      if step in committed and os.path.isdir(self._step_dir(step)):
        integrity.write_manifest(self._step_dir(step))
    self._pending.clear()

  def _write_manifests_in_background(self) -> None:
    try:
      self._write_manifests()
    except Exception:  # the main thread's `_flush` retries and raises it
      _log.debug("background manifest write failed", exc_info=True)

  def _flush(self) -> None:
    if self._writer is not None:
      self._writer.join()
      self._writer = None
    self._write_manifests()

  def _read(self, step: int, args: ocp.args.Composite) -> Any:
    """Orbax's restore of the items of `args` once their files match the manifest.

    Raises:
      _Corrupt: with the reason (mismatch, or the restore's exception summarised).
      CheckpointError: the step lacks an item or is in the old flat-index format.
    """
    names, step_dir = list(args.keys()), self._step_dir(step)
    if set(names) != {_META} and integrity.is_flat_format(step_dir, _FLAT_ITEM):
      raise CheckpointError(
        _FLAT_FORMAT.format(step=step, directory=self.directory), [(step, _FLAT)]
      )
    reason = integrity.check(step_dir, integrity.in_items(names))
    if reason == integrity.NO_MANIFEST:
      _log.warning(
        "checkpoint step %d has no manifest (its run stopped before writing it); "
        "restoring it unverified",
        step,
      )
    elif reason is not None:
      raise _Corrupt(reason)
    if missing := integrity.missing_items(step_dir, names):
      raise CheckpointError(f"checkpoint step {step} has {missing}", [(step, missing)])
    try:
      with integrity.quiet():
        return self._manager.restore(step, args=args)
    except Exception as e:
      _log.debug("restoring checkpoint step %d failed", step, exc_info=True)
      unverified = "unverified, " if reason else ""
      raise _Corrupt(f"{unverified}restore raised {integrity.summary(e)}") from e

  def _restore_step(
    self, templates: Mapping[str, Any], step: int
  ) -> tuple[dict[str, Any], dict[str, Any]]:
    abstract = {
      name: named.nested(t, named.abstract) for name, t in templates.items() if t is not None
    }
    args = {name: ocp.args.StandardRestore(tree) for name, tree in abstract.items() if tree}
    out = self._read(step, ocp.args.Composite(**args, meta=ocp.args.JsonRestore()))
    items = {
      name: named.rebuild(t, out[name]) if name in args else t for name, t in templates.items()
    }
    return items, named.decode_json(out["meta"])

  def _set_aside(self, steps: Sequence[int]) -> None:
    """Moves corrupt `steps` to `<directory>/corrupt/<step>[.k]`, out of orbax's tracking."""
    if self._primary:
      for step in steps:
        integrity.move_aside(self.directory, step)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoint-set-aside")
    if steps:
      with integrity.quiet():
        self._manager.reload()
