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

Integrity. Orbax checksums only tensorstore's index nodes, not the array bytes:
a data file overwritten in place restores silently as wrong numbers. So once
orbax has committed step `t`, `<t>/_MANIFEST.json` records the size and sha256
of every other file of the step directory (asynchronous saves get it from a
background thread; `save`, `wait`, `close` and every read wait for it).
Restores check the digests first, reading the files twice. A step without a
manifest (its run died between commit and manifest) restores unverified, with
a warning. `restore_latest` falls back to older steps, then moves the corrupt
newer ones to `<directory>/corrupt/<t>`, out of keep-last-N's sight, so the
run can save step `t` again.

Multi-process runs: every process calls `save` and the restores (orbax
writes each process's shards and commits once); process 0 alone writes the
manifests and moves corrupt steps aside, and the others wait for it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

_BYTES_TAG = "__bytes_b64__"
_MANIFEST = "_MANIFEST.json"
_NO_MANIFEST = "no manifest"
_CORRUPT_DIR = "corrupt"
_log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
  """A checkpoint step is corrupt, or no step could be restored intact.

  Attributes:
    failures: `(step, reason)` for every step tried, newest first.
  """

  def __init__(self, message: str, failures: Sequence[tuple[int, str]] = ()):
    super().__init__(message)
    self.failures = list(failures)


class _Corrupt(Exception):
  """Internal: one step failed verification or restore; the message is the reason."""


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
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _summary(e: BaseException) -> str:
  """`Type: message` on one line of at most ~170 chars, for tensorstore's long errors too.

  Orbax's "Encountered error while reading array index" gives way to its
  cause; tensorstore's spec dumps are cut; a long chain of "while doing X:"
  keeps its head (the status) and its tail (the root cause).
  """
  if e.__cause__ is not None and "See full TensorStore details" in str(e):
    e = e.__cause__
  text = re.split(r" See full TensorStore details| \[tensorstore_spec", str(e))[0]
  text = f"{type(e).__name__}: {' '.join(text.split())}"
  return text if len(text) <= 170 else f"{text[:50]} ... {text[-115:]}"


def _listing(rels: Iterable[str]) -> str:
  rels = sorted(rels)
  return rels[0] + (f" and {len(rels) - 1} more" if len(rels) > 1 else "")


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      digest.update(chunk)
  return digest.hexdigest()


def _file_sizes(step_dir: str) -> dict[str, int]:
  """Bytes of every file under `step_dir` but the manifest, by '/'-separated relative path."""
  sizes = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir).replace(os.sep, "/")
      if not rel.startswith(_MANIFEST):  # also skips a half-written `_MANIFEST.json.tmp`
        sizes[rel] = os.path.getsize(path)
  return sizes


def _digests(step_dir: str, rels: Iterable[str]) -> dict[str, str]:
  rels = sorted(rels)
  with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:  # hashlib drops the GIL
    paths = [os.path.join(step_dir, rel) for rel in rels]
    return dict(zip(rels, pool.map(_sha256, paths), strict=True))


def _write_manifest(step_dir: str) -> None:
  sizes = _file_sizes(step_dir)
  digests = _digests(step_dir, sizes)
  files = {rel: {"size": sizes[rel], "sha256": digests[rel]} for rel in sorted(sizes)}
  tmp = os.path.join(step_dir, _MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"algorithm": "sha256", "files": files}, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, _MANIFEST))


def _is_meta_file(rel: str) -> bool:
  """The files orbax reads to restore only `meta`: the item and the step's own metadata."""
  return rel.startswith("meta/") or "/" not in rel


def _check(step_dir: str, keep: Callable[[str], bool] | None = None) -> str | None:
  """Why the files of `step_dir` (those `keep` selects) differ from its manifest, or None."""
  keep = keep or (lambda rel: True)
  try:
    with open(os.path.join(step_dir, _MANIFEST)) as f:
      files = json.load(f)["files"]
    expected = {rel: (int(e["size"]), str(e["sha256"])) for rel, e in files.items() if keep(rel)}
  except FileNotFoundError:
    return _NO_MANIFEST
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f"unreadable manifest ({_summary(e)})"
  sizes = {rel: n for rel, n in _file_sizes(step_dir).items() if keep(rel)}
  if missing := expected.keys() - sizes.keys():
    return f"missing file {_listing(missing)}"
  if extra := sizes.keys() - expected.keys():
    return f"unexpected file {_listing(extra)}"
  for rel in sorted(sizes):
    if sizes[rel] != expected[rel][0]:
      return f"size mismatch in {rel}: {sizes[rel]} bytes, {expected[rel][0]} expected"
  digests = _digests(step_dir, sizes)
  bad = [rel for rel in sizes if digests[rel] != expected[rel][1]]
  return f"digest mismatch in {_listing(bad)}" if bad else None


class _DropOrbaxNoise:
  """`sys.unraisablehook` dropping what orbax's aborted reads raise after a failed restore.

  Tensorstore completes the reads orbax abandoned on threads of its own, after
  orbax's event loop has closed: each raises "Event loop is closed" (or leaves
  an orbax coroutine's error unretrieved) long after the restore has returned.
  Everything else goes to the previous hook.
  """

  def __init__(self, previous: Callable[[Any], Any]):
    self.previous = previous

  def __call__(self, args: Any) -> None:
    exc, code = args.exc_value, getattr(args.object, "cr_code", None)
    closed_loop = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
    if closed_loop or (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename):
      _log.debug("dropped a late error of an aborted orbax read: %r", exc)
    else:
      self.previous(args)


class _DropOrbaxLogs(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return f"{os.sep}orbax{os.sep}" not in record.pathname


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """Drops orbax's own logs meanwhile, and (from now on) the late asyncio noise of failed reads.

  Corruption makes orbax log errors with whole file contents and tensorstore
  specs; the one-line reasons of `restore_latest` say the same.
  """
  if not isinstance(sys.unraisablehook, _DropOrbaxNoise):  # stays: the noise comes late
    sys.unraisablehook = _DropOrbaxNoise(sys.unraisablehook)
  absl_logger, drop = logging.getLogger("absl"), _DropOrbaxLogs()
  absl_logger.addFilter(drop)
  try:
    yield
  finally:
    absl_logger.removeFilter(drop)


class Checkpointer:
  """Keeps the last `max_to_keep` complete checkpoints of a run under `directory`.

  Every committed step gets a manifest of digests (see the module docstring);
  resume with `restore_latest`, which skips corrupt steps.

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
    with _quiet():  # orbax logs an ERROR per unreadable step metadata; `restore_latest` explains
      self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("arrays", "meta")
      )
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

  def save(self, step: int, arrays: Any, meta: dict[str, Any]) -> None:
    """Starts saving `arrays` (a pytree) and `meta` (JSON-able dict) as step `step`."""
    self._flush()
    saved = self._manager.save(
      int(step),
      args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(_flatten(arrays)),
        meta=ocp.args.JsonSave(_encode_json(dict(meta))),
      ),
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
      `"no manifest"`, `"missing file arrays/_METADATA"`, `"size mismatch in
      arrays/d/1f2e: 12 bytes, 411 expected"`, `"digest mismatch in meta/metadata"`.
    """
    self._flush()
    self._require(int(step))
    return _check(self._step_dir(int(step)))

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
    args = ocp.args.Composite(meta=ocp.args.JsonRestore())
    try:
      return _decode_json(self._read(step, args, _is_meta_file)["meta"])
    except _Corrupt as e:
      raise CheckpointError(f"checkpoint step {step} is corrupt ({e})", [(step, str(e))]) from None

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Restores exactly step `step` (default: latest) into the structure of `template`.

    Verifies the step's digests first; no fallback (see `restore_latest`).

    Args:
      template: a pytree with the structure, shapes, dtypes (and shardings) of
        what was saved: concrete arrays or `jax.ShapeDtypeStruct`s.
      step: which checkpoint; None for the latest.

    Returns:
      (arrays pytree shaped like `template`, meta dict).

    Raises:
      FileNotFoundError: no such step.
      CheckpointError: the step is corrupt or orbax failed to read it.
    """
    self._flush()
    step = self._require(step)
    try:
      return self._restore_step(template, step)
    except _Corrupt as e:
      raise CheckpointError(f"checkpoint step {step} is corrupt ({e})", [(step, str(e))]) from None

  def restore_latest(self, template: Any) -> tuple[Any, dict[str, Any], int]:
    """Restores the newest intact step, falling back past corrupt ones.

    A step is corrupt when a file is missing, unexpected, or differs from its
    manifest in size or digest, or when orbax's restore raises. Each logs one
    warning (`checkpoint step 40 is corrupt (...); falling back to step 36`).
    Once an older step restores, the corrupt newer ones are moved to
    `<directory>/corrupt/<step>` (never deleted); when none restores, nothing
    is moved.

    Args:
      template: as for `restore`.

    Returns:
      (arrays pytree shaped like `template`, meta dict, the step restored).

    Raises:
      FileNotFoundError: there is no checkpoint at all.
      CheckpointError: no step is intact; its one-line message lists each
        step tried and why it failed.
    """
    self._flush()
    steps = self.all_steps()[::-1]
    if not steps:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    failures: list[tuple[int, str]] = []
    for i, step in enumerate(steps):
      try:
        arrays, meta = self._restore_step(template, step)
      except _Corrupt as e:
        failures.append((step, str(e)))
        then = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no older step"
        _log.warning("checkpoint step %d is corrupt (%s); %s", step, e, then)
        continue
      self._set_aside([s for s, _ in failures])
      return arrays, meta, step
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
    if step is None or step not in self.all_steps():
      what = "checkpoint" if step is None else f"checkpoint step {step}"
      raise FileNotFoundError(f"no {what} under {self.directory}")
    return step

  def _write_manifests(self) -> None:
    """Waits for orbax to commit the pending saves (re-raising a failed one), writes manifests."""
    self._manager.wait_until_finished()
    committed = set(self._manager.all_steps())
    for step in self._pending:
      if step in committed and os.path.isdir(self._step_dir(step)):
        _write_manifest(self._step_dir(step))
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

  def _read(self, step: int, args: Any, keep: Callable[[str], bool] | None = None) -> Any:
    """Orbax's restore of `step` once the files `keep` selects match the manifest.

    Raises:
      _Corrupt: with the reason (mismatch, or the restore's exception summarised).
    """
    reason = _check(self._step_dir(step), keep)
    if reason == _NO_MANIFEST:
      _log.warning(
        "checkpoint step %d has no manifest (its run stopped before writing it); "
        "restoring it unverified",
        step,
      )
    elif reason is not None:
      raise _Corrupt(reason)
    try:
      with _quiet():
        return self._manager.restore(step, args=args)
    except Exception as e:
      _log.debug("restoring checkpoint step %d failed", step, exc_info=True)
      unverified = "unverified, " if reason else ""
      raise _Corrupt(f"{unverified}restore raised {_summary(e)}") from e

  def _restore_step(self, template: Any, step: int) -> tuple[Any, dict[str, Any]]:
    leaves, treedef = jax.tree.flatten(template)
    abstract = {f"{i:06d}": _abstract(x) for i, x in enumerate(leaves)}
    args = ocp.args.Composite(
      arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
    )
    out = self._read(step, args)
    restored = [
      jax.random.wrap_key_data(out["arrays"][f"{i:06d}"], impl=jax.random.key_impl(x))
      if _is_key(x)
      else out["arrays"][f"{i:06d}"]
      for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, restored), _decode_json(out["meta"])

  def _set_aside(self, steps: Sequence[int]) -> None:
    """Moves corrupt `steps` to `<directory>/corrupt/<step>[.k]`, out of orbax's tracking."""
    if jax.process_count() > 1:
      if self._primary:
        self._move_aside(steps)
      multihost_utils.sync_global_devices("checkpoint-set-aside")
    else:
      self._move_aside(steps)
    if steps:
      with _quiet():
        self._manager.reload()

  def _move_aside(self, steps: Sequence[int]) -> None:
    for step in steps:
      base = dest = os.path.join(self.directory, _CORRUPT_DIR, str(step))
      k = 0
      while os.path.exists(dest):
        k += 1
        dest = f"{base}.{k}"
      try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(self._step_dir(step), dest)
      except OSError as e:  # the restore succeeded: do not lose it over this
        _log.warning("could not move corrupt checkpoint step %d aside: %s", step, _summary(e))
        continue
      _log.warning("moved corrupt checkpoint step %d to %s", step, dest)
