"""Integrity of checkpoint steps: manifests of sha256 digests, checks before a restore.

Orbax checksums only tensorstore's index nodes, not the array bytes: a data
file overwritten in place restores silently as wrong numbers. So once orbax has
committed a step, `write_manifest` records in `<step>/_MANIFEST.json` the size
and sha256 of every other file of the step directory, and `check` compares the
files on disk with it before a restore. `check` takes a selection of files, so
a restore of some items hashes only the files it reads.

The manifest is written atomically (a `.tmp` file renamed into place); a step
without one (its run died between orbax's commit and the manifest) checks as
`NO_MANIFEST`.

Before reading items, `missing_items` and `is_flat_format` (the old format of
offpolicy_jax 0.1.x: one item, leaves under "000000", ...)
tell a step that is intact but not readable by name. A corrupt step fails with
a one-line reason (`summary` shortens orbax's and tensorstore's errors;
`quiet` drops their logs and late asyncio noise), and `move_aside` takes it out
of orbax's sight without deleting it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from offpolicy_jax.files import write_text_atomic

MANIFEST = "_MANIFEST.json"
NO_MANIFEST = "no manifest"
_CORRUPT_DIR = "corrupt"
_log = logging.getLogger(__name__)


def summary(e: BaseException) -> str:
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
      if not rel.startswith(MANIFEST):  # also skips a half-written `_MANIFEST.json.tmp`
        sizes[rel] = os.path.getsize(path)
  return sizes


def _digests(step_dir: str, rels: Iterable[str]) -> dict[str, str]:
  rels = sorted(rels)
  with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:  # hashlib drops the GIL
    paths = [os.path.join(step_dir, rel) for rel in rels]
    return dict(zip(rels, pool.map(_sha256, paths), strict=True))


def write_manifest(step_dir: str) -> None:
  """Writes `<step_dir>/_MANIFEST.json`: size and sha256 of every other file, atomically."""
  sizes = _file_sizes(step_dir)
  digests = _digests(step_dir, sizes)
  files = {rel: {"size": sizes[rel], "sha256": digests[rel]} for rel in sorted(sizes)}
  text = json.dumps({"algorithm": "sha256", "files": files}, indent=1)
  write_text_atomic(os.path.join(step_dir, MANIFEST), text, sync=True)


def in_items(names: Iterable[str]) -> Callable[[str], bool]:
  """Selects the files orbax reads to restore the items `names`: theirs and the step's own.

  Args:
    names: item directory names, e.g. `("params", "meta")`.

  Returns:
    A predicate on '/'-separated paths relative to the step directory.
  """
  prefixes = tuple(f"{name}/" for name in names)
  return lambda rel: "/" not in rel or rel.startswith(prefixes)


def missing_items(step_dir: str, names: Iterable[str]) -> str | None:
  """`"no item 'replay' (it holds meta, params)"` when an item of `names` is absent, or None."""
  if not (missing := [name for name in names if not os.path.isdir(os.path.join(step_dir, name))]):
    return None
  held = sorted(n for n in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, n)))
  return f"no item {', '.join(map(repr, missing))} (it holds {', '.join(held)})"


def is_flat_format(step_dir: str, item: str) -> bool:
  """Whether `<step_dir>/<item>` is an orbax pytree of flat keys "000000", "000001", ...."""
  try:
    with open(os.path.join(step_dir, item, "_METADATA")) as f:
      entries = json.load(f)["tree_metadata"].values()
    keys = [[k["key"] for k in entry["key_metadata"]] for entry in entries]
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return False
  return bool(keys) and all(len(k) == 1 and re.fullmatch(r"\d{6}", str(k[0])) for k in keys)


def check(step_dir: str, keep: Callable[[str], bool] | None = None) -> str | None:
  """Why the files of `step_dir` (those `keep` selects) differ from its manifest, or None.

  Args:
    step_dir: a committed step directory.
    keep: which files to check (see `in_items`); None for all.

  Returns:
    None when sizes and digests all match; otherwise one line: `NO_MANIFEST`,
    `"unreadable manifest (...)"`, `"missing file params/_METADATA"`,
    `"unexpected file ..."`, `"size mismatch in params/d/1f2e: 12 bytes, 411
    expected"` or `"digest mismatch in meta/metadata"`.
  """
  keep = keep or (lambda rel: True)
  try:
    with open(os.path.join(step_dir, MANIFEST)) as f:
      files = json.load(f)["files"]
    expected = {rel: (int(e["size"]), str(e["sha256"])) for rel, e in files.items() if keep(rel)}
  except FileNotFoundError:
    return NO_MANIFEST
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f"unreadable manifest ({summary(e)})"
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
def quiet() -> Iterator[None]:
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


def move_aside(directory: str, step: int) -> None:
  """Moves `<directory>/<step>` to `<directory>/corrupt/<step>[.k]`; logs, never raises."""
  base = dest = os.path.join(directory, _CORRUPT_DIR, str(step))
  k = 0
  while os.path.exists(dest):
    k += 1
    dest = f"{base}.{k}"
  try:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.rename(os.path.join(directory, str(step)), dest)
  except OSError as e:  # the restore succeeded: do not lose it over this
    _log.warning("could not move corrupt checkpoint step %d aside: %s", step, summary(e))
    return
  _log.warning("moved corrupt checkpoint step %d to %s", step, dest)
