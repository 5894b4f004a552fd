"""Untrusted Python in a fresh process of its own; only JSON data comes back.

  with isolation.Session(program, timeout_s=5.0) as prog:
    y = prog.call("f", 2, 3)   # f(2, 3) ran in the program's process; y is data

The code task's grader (`tasks.code_reward`) runs every response's program
through a `Session`, and so must any grader of untrusted code: the
environments and tool workers of multi-turn tasks included (the tool call
runs in a session, its answer comes back as data, and nothing the policy
writes survives into the next session).

Where things run:

* the *grader* (the caller: a verifier worker) holds the expected values and
  never runs the program; it sends calls and reads replies as data;
* a *template*: a small fresh interpreter (stdlib, this module and `sandbox`
  only: no JAX, no verifier libraries), started once per grader, confined by
  `sandbox.apply(processes=True)` and never sent an example. It keeps one
  child forked ahead of time and hands it over on request;
* a *program process*: that child, confined further (`sandbox.confine_program`:
  no fork, no signals to others, a CPU limit, dies with the template), runs
  one program for one grading, then is killed. Nothing it does survives into
  the next session, and it never holds another example or an expected value.

Messages are JSON lines of at most `MAX_MESSAGE_BYTES`, values at most
`MAX_DEPTH` deep. Values keep their exact type (`encode` / `decode`): None,
bool, int, float, str and list are JSON; tuple, set, frozenset, dict, bytes,
complex, range and exhausted iterators are tagged objects; an instance of a
class the grader trusts (passed as `classes`, e.g. a linked list node of a
test's setup) travels as its class name and attributes and is rebuilt from the
grader's own class; anything else stays in the program's process and the
grader gets a `Remote` handle, which can be called and have attributes read
but has no truth value and equals only itself. The program can write any bytes
to its pipe: the grader parses them as data, so the worst a program can do is
return wrong values.

A program's exception reaches the grader as a builtin exception of the same
name (message dropped), else as `ProgramError`; a program past its deadline
raises `TimeoutError` in the grader, and its process is killed.

Why fork from a separate template rather than from the grader: the grader has
the example in memory, and a fork would hand the expected values to the
program. Why not a fresh interpreter per session: a fork of a small process
costs about a millisecond, a Python start-up tens of milliseconds.
"""

import builtins
import os
import time
from typing import Any

from offpolicy_jax.rewards.isolation_processes import template
from offpolicy_jax.rewards.isolation_wire import Lines, ProgramError, decode, encode

_MARGIN_S = 0.25  # a session ends this long before the caller's deadline
# Exceptions a program's exception may become in the grader (others: ProgramError).
_NOT_RERAISED = ("StopIteration", "StopAsyncIteration", "GeneratorExit")


# ------------------------------------------------------------ the grader side

_deadline: float | None = None


def set_deadline(deadline: float | None) -> None:
  """Sessions opened from now on end by `deadline` (time.monotonic) at the latest.

  A verifier worker sets it to the end of each call's timeout, so a program
  that runs too long raises `TimeoutError` in time to be reported as one.
  """
  global _deadline
  _deadline = deadline


class Remote:
  """A program's object (or function) the grader can call and read attributes of.

  It has no truth value and no order, equals only itself, and its calls run in
  the program's process and return data (or further `Remote`s).
  """

  __slots__ = ("_session", "_ref")

  def __init__(self, session: "Session", ref: dict[str, Any]):
    self._session, self._ref = session, ref

  def __call__(self, *args, **kwargs):
    return self._session._op({"op": "call", **self._ref}, args, kwargs)

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    return self._session._op({"op": "getattr", "attr": name, **self._ref}, (), {})

  def __bool__(self) -> bool:
    raise TypeError("an object of the graded program has no truth value in trusted code")

  def __repr__(self) -> str:
    return f"<program object {self._ref}>"


class Session:
  """One program in a fresh, confined process (see the module docstring).

  Args:
    program: the program's source; it runs when the session opens.
    setup: trusted source run in the program's process in a namespace of its
      own, where `classes` are looked up by name to rebuild values sent there.
    classes: name -> class of the grader's trusted classes whose instances
      travel as values (in both directions).
    timeout_s: wall-clock limit of the whole session (capped by `set_deadline`).

  Raises (on opening):
    ProgramError: the program does not compile or raised while it ran.
    TimeoutError: it ran past the deadline.
  """

  def __init__(
    self,
    program: str,
    *,
    setup: str = "",
    classes: dict[str, type] | None = None,
    timeout_s: float = 10.0,
  ):
    self.deadline = time.monotonic() + timeout_s
    if _deadline is not None:
      self.deadline = min(self.deadline, _deadline - _MARGIN_S)
    self.timed_out = False
    self._classes = dict(classes or {})
    self._by_type = {cls: name for name, cls in self._classes.items()}
    self._remotes: dict[int, Remote] = {}
    self._template = template()
    wfd, rfd = self._template.fork()
    self._chan = Lines(rfd, wfd)
    for fd in (rfd, wfd):
      os.set_blocking(fd, False)
    self._loaded = False
    cpu_s = max(self.deadline - time.monotonic(), 0.0) + 1.0
    msg = {"program": program, "setup": setup, "classes": list(self._classes), "cpu_s": cpu_s}
    self._send(msg)  # its answer is read with the first call's (one round trip, not two)

  def load(self) -> None:
    """Waits until the program has run (idempotent).

    Raises:
      ProgramError: it does not compile or raised while it ran.
      TimeoutError: it ran past the deadline.
    """
    if self._loaded:
      return
    try:
      self._value(self._recv())
    except (TimeoutError, ProgramError):
      self.close()
      raise
    except Exception as e:  # the program raised while it ran
      self.close()
      raise ProgramError(f"the program raised {type(e).__name__}") from None
    self._loaded = True

  def remote(self, name: str) -> Remote:
    """The program's global `name` as a `Remote` (bound when first called)."""
    return Remote(self, {"name": name})

  def call(self, name: str, *args, **kwargs) -> Any:
    """`name(*args, **kwargs)` in the program's process, as data."""
    return self.remote(name)(*args, **kwargs)

  def map(self, name: str, calls: list[list[Any]]) -> list[Any]:
    """`[name(*args) for args in calls]` in one round trip; a raising call gives ProgramError."""
    enc = lambda v: encode(v, self._by_type, self._no_handle)  # noqa: E731
    replies = self._reply({"op": "map", "name": name, "calls": enc(list(calls))}, raw=True)
    if type(replies) is not list or len(replies) != len(calls):
      raise ProgramError("the program's answer is not one reply per call")
    out = []
    for reply in replies:
      try:
        out.append(self._value(reply))
      except Exception as e:  # noqa: BLE001  that call raised in the program
        out.append(e if isinstance(e, ProgramError) else ProgramError(type(e).__name__))
    return out

  def _op(self, msg: dict[str, Any], args, kwargs) -> Any:
    enc = lambda v: encode(v, self._by_type, self._no_handle)  # noqa: E731
    msg = {**msg, "args": enc(list(args)), "kwargs": enc(dict(kwargs))}
    return self._reply(msg)

  def _no_handle(self, value: Any) -> Any:
    if isinstance(value, Remote) and value._session is self and "handle" in value._ref:
      return {"handle": value._ref["handle"]}
    raise TypeError(f"cannot send a {type(value).__name__} to the program")

  def _remote(self, i: int) -> Remote:
    return self._remotes.setdefault(i, Remote(self, {"handle": i}))

  def _send(self, msg: dict[str, Any]) -> None:
    self._io(lambda chan: chan.send(msg, self.deadline))

  def _recv(self) -> Any:
    return self._io(lambda chan: chan.recv(self.deadline))

  def _io(self, fn) -> Any:
    if self._chan is None:
      raise (
        TimeoutError("the program ran past its time") if self.timed_out else ProgramError("closed")
      )
    try:
      return fn(self._chan)
    except TimeoutError:
      self.timed_out = True
      self.close()
      raise

  def _reply(self, msg: dict[str, Any], raw: bool = False) -> Any:
    try:
      self._send(msg)
    except ProgramError:
      self.load()  # the reason it ended, if it failed while it ran
      raise
    self.load()
    reply = self._recv()
    if raw and type(reply) is dict and type(reply.get("ok")) is list:
      return reply["ok"]
    return self._value(reply)

  def _value(self, reply: Any) -> Any:
    if type(reply) is not dict:
      raise ProgramError("the program's answer is not an object")
    if "ok" in reply:
      try:
        return decode(reply["ok"], self._classes, self._remote)
      except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise ProgramError(f"the program's answer is not a value ({e})") from None
    name = reply.get("raised")
    exc = getattr(builtins, name, None) if type(name) is str and name not in _NOT_RERAISED else None
    if isinstance(exc, type) and issubclass(exc, Exception):
      raise exc("raised by the program")
    raise ProgramError(f"the program raised {str(name)[:80]}")

  def close(self) -> None:
    """Kills the program's process (idempotent)."""
    if self._chan is not None:
      self._template.kill()
      for fd in (self._chan.rfd, self._chan.wfd):
        os.close(fd)
      self._chan = None  # type: ignore[assignment]

  def __enter__(self) -> "Session":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
