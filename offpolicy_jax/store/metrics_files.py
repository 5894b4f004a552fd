"""Reading and repairing `metrics.jsonl`: torn lines skipped, rows past a resume dropped.

Readers skip an unreadable line (torn by a kill, or corrupted) with a warning
naming the file and line, and keep every valid row around it; a resume keeps
the rows up to its checkpoint and moves unreadable lines to
`metrics.jsonl.bad`, never destroying them. `metrics.MetricsWriter` writes the
file; this module reads it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from offpolicy_jax import files

METRICS_FILE = "metrics.jsonl"
# Suffix of the file that keeps the lines a resume dropped as unreadable.
BAD_SUFFIX = ".bad"


class _Scan(NamedTuple):
  """A metrics file read line by line: its valid rows and its unreadable lines."""

  rows: list[dict[str, Any]]
  # (1-based line number, the raw line without its newline).
  bad: list[tuple[int, bytes]]


def _parse_row(raw: bytes) -> dict[str, Any] | None:
  """A row is a JSON object with an integer `step`; None for anything else."""
  try:
    row = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    return None
  if not isinstance(row, dict):
    return None
  step = row.get("step")
  return row if isinstance(step, int) and not isinstance(step, bool) else None


def _scan(path: str) -> _Scan:
  """Reads every line of `path` (missing file: empty), sorting valid rows from bad lines."""
  scan = _Scan([], [])
  try:
    f = open(path, "rb")
  except FileNotFoundError:
    return scan
  with f:
    for lineno, line in enumerate(f, start=1):
      raw = line.rstrip(b"\r\n")
      if not raw.strip():
        continue
      row = _parse_row(raw)
      if row is None:
        scan.bad.append((lineno, raw))
      else:
        scan.rows.append(row)
  return scan


def _describe_lines(bad: list[tuple[int, bytes]]) -> str:
  numbers = ", ".join(str(lineno) for lineno, _ in bad[:5])
  if len(bad) > 5:
    numbers += f" and {len(bad) - 5} more"
  return f"{len(bad)} unreadable line(s) (line {numbers})"


def read_metrics(path: str) -> list[dict[str, Any]]:
  """Reads a metrics file (or the one inside a workdir), skipping unreadable lines.

  A line that is not a JSON object with an integer `step` (torn by a kill,
  corrupted on disk) is skipped with one warning naming the file and the line
  numbers; every valid row, before or after it, is kept.

  Args:
    path: a `metrics.jsonl` file or a directory holding one.

  Returns:
    The rows in file order.
  """
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  try:
    scan = _scan(path)
  except IsADirectoryError:
    # A workdir the run created after the check above (a reader polling a starting run).
    path = os.path.join(path, METRICS_FILE)
    scan = _scan(path)
  if scan.bad:
    warnings.warn(f"{path}: skipped {_describe_lines(scan.bad)}", stacklevel=2)
  return scan.rows


def split_rows(rows: Iterable[Mapping[str, Any]]) -> tuple[list[dict], list[dict]]:
  """Splits rows into (train rows, eval rows); eval rows hold any `eval/` key."""
  train: list[dict] = []
  evals: list[dict] = []
  for row in rows:
    (evals if any(k.startswith("eval/") for k in row) else train).append(dict(row))
  return train, evals


def fsync_dir(path: str) -> None:
  """Makes the entries of directory `path` (a created or renamed file) durable."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return  # Platforms that cannot open a directory (Windows) need no such sync.
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def truncate_metrics(path: str, last_step: int) -> int:
  """Keeps the valid rows with `step <= last_step`, rewriting the file atomically.

  Rows of later steps are dropped (a resumed run rewrites them). Valid rows of
  earlier steps are kept wherever they are in the file, also after an
  unreadable line; unreadable lines are appended to `path + ".bad"` (fsynced
  before the file is replaced) with one warning, so no byte is destroyed.

  Args:
    path: the metrics file.
    last_step: the step of the checkpoint the run resumes from.

  Returns:
    The number of rows kept.
  """
  scan = _scan(path)
  rows = [r for r in scan.rows if r["step"] <= last_step]
  if scan.bad:
    with open(path + BAD_SUFFIX, "ab") as f:
      f.writelines(raw + b"\n" for _, raw in scan.bad)
      f.flush()
      os.fsync(f.fileno())
    warnings.warn(
      f"{path}: dropped {_describe_lines(scan.bad)}; they are kept in {path}{BAD_SUFFIX}",
      stacklevel=2,
    )
  files.write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows), sync=True)
  fsync_dir(os.path.dirname(os.path.abspath(path)))
  return len(rows)
