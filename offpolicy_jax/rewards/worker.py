"""The worker-process side of the verifier pool, and the protocol it speaks.

`worker_main` is the target of every process `verifiers.VerifierPool` starts
(from its forkserver). It starts its program template (`isolation`: the
small, separately confined process that forks a fresh process for every
program the code task grades), confines itself with `sandbox.apply` before it
sees any model output, then answers calls until told to stop.

Protocol, over two one-way pipes per worker:

  trainer -> worker (pickled; the trusted direction)
    ("fn", fn_id, data)                          a reward, `data` its pickle,
                                                 unpickled on first use
    (kind, i, fn_id, example, text, timeout_s)   kind "call": score row i;
                                                 kind "load": only load fn_id
    None                                         stop

  worker -> trainer (one JSON object per message, at most `MAX_REPLY_BYTES`)
    {"ready": [missing, ...]} or {"fatal": msg}  once, after `sandbox.apply`
    {"i": i, "score": float}                     the call returned
    {"i": i, "error": msg}                       the call raised
    {"i": i, "error": msg, "timed_out": true}    it raised TimeoutError (a
                                                 program ran past its time)
    {"i": i, "load_error": msg}                  the reward could not be loaded
    {"i": i, ..., "recycle": true}               the call left threads behind;
                                                 the worker exits after replying

The trainer reads replies with `parse_reply` as data and never unpickles
anything a worker sends, so a worker taken over by the code it runs can at
worst forge its own scores (and graded programs never run in a worker:
they run in processes of their own, see `isolation`).

A reward reaches a worker by pickling: a module-level function, a
`functools.partial` of one, or a `RebuildReward` that the worker resolves to
`factory(**kwargs).reward` once.
"""

import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from offpolicy_jax.rewards import isolation, sandbox

# Bound of one reply: a worker truncates its own to it, the trainer reads no more.
MAX_REPLY_BYTES = 1 << 16


class RebuildReward:
  """A reward the worker rebuilds as `factory(**kwargs).reward`, for closures.

  The factory is pickled by reference (it must be importable: a module-level
  function of an importable module); the worker builds the task once and keeps
  its reward.
  """

  def __init__(self, factory: Callable[..., Any], kwargs: dict[str, Any], name: str):
    self.factory, self.kwargs, self.name = factory, dict(kwargs), name

  def resolve(self) -> Callable[[Any, str], float]:
    reward = self.factory(**self.kwargs).reward
    return getattr(reward, "fn", reward)


def parse_reply(raw: bytes) -> dict[str, Any]:
  """A worker's reply as a JSON object (parsed as data, never unpickled).

  Raises:
    ValueError: `raw` is not JSON or not an object.
  """
  msg = json.loads(raw)
  if not isinstance(msg, dict):
    raise ValueError("reply is not an object")
  return msg


def _reply(conn, obj: dict) -> None:
  conn.send_bytes(json.dumps(obj).encode()[:MAX_REPLY_BYTES])


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
    fns[fn_id] = fn.resolve() if isinstance(fn, RebuildReward) else fn
  return fns[fn_id]


def worker_main(calls, replies, limits: sandbox.Limits, strict: bool) -> None:
  """Worker loop: confine, then answer `(kind, i, fn_id, example, text, timeout_s)` calls.

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
    isolation.start_template(limits, strict)  # it forks; this process may not once confined
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
    kind, i, fn_id, example, text, timeout_s = msg
    sandbox.set_cpu_limit(timeout_s + 1.0)
    isolation.set_deadline(time.monotonic() + timeout_s)
    try:
      fn = _load(fns, fn_id)
    except BaseException as e:  # noqa: BLE001  the reward cannot be loaded here
      _reply(replies, {"i": i, "load_error": f"{type(e).__name__}: {e}"[:500]})
      continue
    try:
      out: dict[str, Any] = {"i": i, "score": 0.0 if kind == "load" else float(fn(example, text))}
    except BaseException as e:  # noqa: BLE001  any verifier failure scores 0
      out = {"i": i, "error": f"{type(e).__name__}: {e}"[:500]}
      if isinstance(e, TimeoutError):
        out["timed_out"] = True
    leftover = threading.active_count() > 1
    if leftover:
      out["recycle"] = True
    _reply(replies, out)
    if leftover:
      os._exit(0)  # threads the call started die with the process
