"""Reading the small JSON files a run depends on, with errors that name the file."""

import json
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
