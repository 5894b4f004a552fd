"""Reading the small JSON files a run depends on, with errors that name the file; writing whole."""

import json
import os
from typing import Any


def read_json_object(path: str) -> dict[str, Any]:
  """The JSON object in `path`.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: `path` is not UTF-8 JSON holding an object; the message starts
      with the path and says what is wrong (line and column for syntax errors).
  """
  with open(path, "rb") as f:
    raw = f.read()
  try:
    obj = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: invalid JSON: not UTF-8 text ({e.reason})") from e
  if not isinstance(obj, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


def write_text_atomic(path: str, text: str, *, sync: bool = False) -> None:
  """Writes `text` to `path` whole: a reader (or a crash) sees the old file or the new one.

  `sync`: flush it to disk before it replaces the old one (records a resume trusts).
  """
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    if sync:
      f.flush()
      os.fsync(f.fileno())
  os.replace(tmp, path)
