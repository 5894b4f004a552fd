"""The worker-process side of the verifier pool, and the protocol it speaks.

`worker_main` is the target of every process `verifiers.VerifierPool` starts
(from its forkserver). It starts its program template (`isolation`: the
small, separately confined process that forks a fresh process for every
program the code task grades), confines itself with `sandbox.apply` before it
sees any model output, then answers calls until told to stop.

Protocol, over two one-way pipes per worker:

  trainer -> worker (pickled; the trusted direction)
    ("fn", fn_id, data)                   a callable, `data` its pickle,
                                          unpickled on first use
    (kind, i, fn_id, args, timeout_s)     a call of `fn(*args)`; i: a random id
                                          that the reply echoes; kind "score":
                                          the value is `float(fn(*args))`;
                                          "call": `fn(*args)`, which must be JSON
                                          data (`is_json_data`); "load": none,
                                          only load fn_id
    None                                  stop

  worker -> trainer (one JSON object per message, at most `MAX_REPLY_BYTES`)
    {"ready": [missing, ...]} or {"fatal": msg}  once, after `sandbox.apply`
    {"i": i, "value": value}                     the call returned
    {"i": i, "error": msg}                       the call raised
    {"i": i, "error": msg, "timed_out": true}    it raised TimeoutError (a
                                                 program ran past its time)
    {"i": i, "error": msg, "garbage": true}      it returned something that is
                                                 not JSON data, or too large
    {"i": i, "load_error": msg}                  the callable could not be loaded
    {"i": i, ..., "recycle": true}               the call left threads behind;
                                                 the worker exits after replying

The trainer reads replies with `parse_reply` as data and never unpickles
anything a worker sends, so a worker taken over by the code it runs can at
worst forge its own scores (and graded programs never run in a worker:
they run in processes of their own, see `isolation`).

A callable reaches a worker by pickling: a module-level function, a
`functools.partial` of one, or a `Rebuild` that the worker resolves once:
`RebuildReward` to `factory(**kwargs).reward`, `environments.RebuildEnv` to the
environment `factory(**kwargs)` carries.
"""

import json
import math
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from offpolicy_jax.rewards import isolation, isolation_processes, sandbox

# Bound of one reply: a worker truncates its own to it, the trainer reads no more.
MAX_REPLY_BYTES = 1 << 16


class Rebuild:
  """A callable the worker rebuilds from `factory(**kwargs)`, for closures.

  The factory is pickled by reference (it must be importable: a module-level
  function of an importable module); the worker calls `resolve` once per
  worker and keeps what it returns. Subclasses say what to take from the
  factory's result.
  """

  def __init__(self, factory: Callable[..., Any], kwargs: dict[str, Any], name: str):
    self.factory, self.kwargs, self.name = factory, dict(kwargs), name

  def resolve(self) -> Callable[..., Any]:
    """The callable, built in the worker."""
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.name or self.factory!r})"


class RebuildReward(Rebuild):
  """A reward the worker rebuilds as `factory(**kwargs).reward`."""

  def resolve(self) -> Callable[[Any, str], float]:
    reward = self.factory(**self.kwargs).reward
    return getattr(reward, "fn", reward)


def is_json_data(value: Any, depth: int = 0) -> bool:
  """True iff `value` is exactly JSON data: None, bool, int, finite float, str, list, dict.

  Dict keys must be str (`json` would turn other keys into strings and tuples
  into lists, so a value would not come back as it left); at most 64 levels deep.
  """
  t = type(value)
  if value is None or t in (bool, int, str):
    return True
  if t is float:
    return math.isfinite(value)
  if depth >= 64:
    return False
  if t is list:
    return all(is_json_data(v, depth + 1) for v in value)
  if t is dict:
    return all(type(k) is str and is_json_data(v, depth + 1) for k, v in value.items())
  return False


def parse_reply(raw: bytes) -> dict[str, Any]:
  """A worker's reply as a JSON object (parsed as data, never unpickled).

  Raises:
    ValueError: `raw` is not JSON or not an object.
  """
  try:
    msg = json.loads(raw)
  except RecursionError:  # nested too deep for the parser
    raise ValueError("reply nested too deep") from None
  if not isinstance(msg, dict):
    raise ValueError("reply is not an object")
  return msg


def _reply(conn, obj: dict) -> None:
  conn.send_bytes(json.dumps(obj).encode()[:MAX_REPLY_BYTES])


def _result(kind: str, i: int, fn, args: tuple) -> dict[str, Any]:
  """The reply to one call: its value as JSON data, or why there is none."""
  if kind == "load":
    return {"i": i, "value": None}
  try:
    value = float(fn(*args)) if kind == "score" else fn(*args)
  except BaseException as e:  # noqa: BLE001  any failure of the callable is reported
    out: dict[str, Any] = {"i": i, "error": f"{type(e).__name__}: {e}"[:500]}
    if isinstance(e, TimeoutError):
      out["timed_out"] = True
    return out
  if kind == "score":
    return {"i": i, "value": value}  # may be nan or inf: the pool counts those
  try:
    if not is_json_data(value):
      raise TypeError(f"{type(value).__name__} value is not JSON data")
    size = len(json.dumps({"i": i, "value": value}, allow_nan=False).encode())
    if size > MAX_REPLY_BYTES:
      raise ValueError(f"reply of {size} bytes is over the limit of {MAX_REPLY_BYTES}")
  except BaseException as e:  # noqa: BLE001  what the callable returned is garbage
    return {"i": i, "error": f"{type(e).__name__}: {e}"[:500], "garbage": True}
  return {"i": i, "value": value}


def _close_inherited_fds(keep: set[int]) -> None:
  """Closes every descriptor but stdio and `keep`.

  A forked worker inherits pipes of the forkserver and of multiprocessing's
  resource tracker; Landlock does not govern descriptors already open, so
  they are closed before any model output arrives.
  """
  fd_dir = "/proc/self/fd"
  fds = [int(f) for f in os.listdir(fd_dir)] if os.path.isdir(fd_dir) else range(3, 1024)
  for fd in fds:
    if fd > 2 and fd not in keep:
      try:
        os.close(fd)
      except OSError:
        pass


def _load(fns: dict[int, Any], fn_id: int):
  if isinstance(fns[fn_id], bytes):
    fn = pickle.loads(fns[fn_id])
    fns[fn_id] = fn.resolve() if isinstance(fn, Rebuild) else fn
  return fns[fn_id]


def worker_main(calls, replies, limits: sandbox.Limits, strict: bool) -> None:
  """Worker loop: confine, then answer `(kind, i, fn_id, args, timeout_s)` calls.

  A call that leaves threads behind ends its worker after replying (the pool
  starts a fresh one), so nothing a verifier started outlives its call.

  Args:
    calls: read end of the trainer's call pipe.
    replies: write end of the reply pipe.
    limits: resource limits passed to `sandbox.apply`.
    strict: refuse to answer calls unless the sandbox is complete.
  """
  devnull = os.open(os.devnull, os.O_RDWR)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  _close_inherited_fds({calls.fileno(), replies.fileno()})
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when workers stop
  try:
    # It forks; this process may not once confined.
    isolation_processes.start_template(limits, strict)
    missing = sandbox.apply(limits, strict=strict)
  except BaseException as e:  # noqa: BLE001  reported to the pool, which refuses to score
    _reply(replies, {"fatal": f"{type(e).__name__}: {e}"})
    return
  _reply(replies, {"ready": missing})
  fns: dict[int, Any] = {}
  while True:
    msg = calls.recv()
    if msg is None:
      return
    if msg[0] == "fn":  # ("fn", fn_id, pickled reward): loaded on first use
      fns[msg[1]] = msg[2]
      continue
    kind, i, fn_id, args, timeout_s = msg
    sandbox.set_cpu_limit(timeout_s + 1.0)
    isolation.set_deadline(time.monotonic() + timeout_s)
    try:
      fn = _load(fns, fn_id)
    except BaseException as e:  # noqa: BLE001  the callable cannot be loaded here
      _reply(replies, {"i": i, "load_error": f"{type(e).__name__}: {e}"[:500]})
      continue
    out = _result(kind, i, fn, args)
    leftover = threading.active_count() > 1
    if leftover:
      out["recycle"] = True
    _reply(replies, out)
    if leftover:
      os._exit(0)  # threads the call started die with the process
