"""The wire between a grader and a program (`rewards.isolation`): values as data, JSON lines.

`encode` / `decode` keep a value's exact type (the module docstring of
`rewards.isolation`: what travels as data, what as a `Remote` handle);
`Lines` carries JSON lines of at most `MAX_MESSAGE_BYTES` over a pair of
pipes. Standard library only: the template process imports this module.
"""

import builtins
import json
import os
import select
import time
from typing import Any

MAX_MESSAGE_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_ITEMS = 100_000  # items taken from an iterator a program returns
_TAGS = (
  "tuple",
  "set",
  "frozenset",
  "dict",
  "bytes",
  "complex",
  "range",
  "iter",
  "handle",
  "object",
)


class ProgramError(Exception):
  """The program raised, ended, or answered with something that is not data."""


def encode(value: Any, classes: dict[type, str], handle, depth: int = 0) -> Any:
  """`value` as JSON-able data (see the module docstring); `handle(v)` stands in for others.

  Raises:
    ValueError: nested deeper than `MAX_DEPTH`.
  """
  t = type(value)
  if value is None or t in (bool, int, float, str):
    return value
  if depth >= MAX_DEPTH:
    raise ValueError(f"value nested deeper than {MAX_DEPTH}")
  enc = lambda v: encode(v, classes, handle, depth + 1)  # noqa: E731
  if t is list:
    return [enc(v) for v in value]
  if t in (tuple, set, frozenset):
    return {t.__name__: [enc(v) for v in value]}
  if t is dict:
    return {"dict": [[enc(k), enc(v)] for k, v in value.items()]}
  if t is bytes:
    return {"bytes": value.decode("latin-1")}
  if t is complex:
    return {"complex": [value.real, value.imag]}
  if t is range:
    return {"range": [value.start, value.stop, value.step]}
  if t in classes and isinstance(getattr(value, "__dict__", None), dict):
    return {"object": classes[t], "attrs": enc(dict(vars(value)))}
  return handle(value)


def decode(data: Any, classes: dict[str, type], remote, depth: int = 0) -> Any:
  """The value `data` (parsed JSON) stands for; `remote(i)` makes handle `i`.

  Raises:
    ValueError: `data` is not an encoding of a value.
  """
  t = type(data)
  if data is None or t in (bool, int, float, str):
    return data
  if depth >= MAX_DEPTH:
    raise ValueError(f"value nested deeper than {MAX_DEPTH}")
  dec = lambda v: decode(v, classes, remote, depth + 1)  # noqa: E731
  if t is list:
    return [dec(v) for v in data]
  if t is not dict or not data or next(iter(data)) not in _TAGS:
    raise ValueError(f"not an encoded value: {type(data).__name__}")
  tag, body = next(iter(data.items()))
  if tag in ("tuple", "set", "frozenset", "iter") and type(body) is list and len(data) == 1:
    items = [dec(v) for v in body]
    return iter(items) if tag == "iter" else getattr(builtins, tag)(items)
  if tag == "dict" and type(body) is list and all(type(kv) is list and len(kv) == 2 for kv in body):
    return {dec(k): dec(v) for k, v in body}
  if tag == "bytes" and type(body) is str:
    return body.encode("latin-1")
  if tag == "complex" and type(body) is list and [type(x) for x in body] == [float, float]:
    return complex(*body)
  if tag == "range" and type(body) is list and all(type(x) is int for x in body):
    return range(*body)
  if tag == "handle" and type(body) is int:
    return remote(body)
  if tag == "object" and body in classes and type(attrs := data.get("attrs")) is dict:
    cls: Any = classes[body]
    obj = cls.__new__(cls)
    obj.__dict__.update({k: v for k, v in dec(attrs).items() if type(k) is str})
    return obj
  raise ValueError(f"malformed encoded {tag!r}")


# ------------------------------------------------------------------- channels


class Lines:
  """JSON lines over a pair of pipes; the reading side bounds lines and waits with a deadline."""

  def __init__(self, rfd: int, wfd: int):
    self.rfd, self.wfd, self.buf = rfd, wfd, b""

  def send(self, obj: Any, deadline: float | None = None) -> None:
    data = json.dumps(obj).encode() + b"\n"
    while data:
      if deadline is not None and not select.select([], [self.wfd], [], _left(deadline))[1]:
        raise TimeoutError("the program did not read its input in time")
      try:
        data = data[os.write(self.wfd, data[: 1 << 16]) :]
      except BrokenPipeError:
        raise ProgramError("the program's process ended") from None

  def recv(self, deadline: float | None = None) -> Any:
    while b"\n" not in self.buf:
      if len(self.buf) > MAX_MESSAGE_BYTES:
        raise ProgramError(f"message longer than {MAX_MESSAGE_BYTES} bytes")
      if deadline is not None and not select.select([self.rfd], [], [], _left(deadline))[0]:
        raise TimeoutError("the program did not answer in time")
      chunk = os.read(self.rfd, 1 << 16)
      if not chunk:
        raise ProgramError("the program's process ended")
      self.buf += chunk
    line, self.buf = self.buf.split(b"\n", 1)
    try:
      return json.loads(line)
    except (ValueError, RecursionError) as e:
      raise ProgramError(f"the program's answer is not JSON ({e})") from None


def _left(deadline: float) -> float:
  left = deadline - time.monotonic()
  if left <= 0:
    raise TimeoutError("the program did not answer in time")
  return left
