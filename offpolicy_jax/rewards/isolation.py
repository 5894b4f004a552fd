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
import collections.abc
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from offpolicy_jax.rewards import sandbox

MAX_MESSAGE_BYTES = 1 << 20
MAX_DEPTH = 64
_MAX_ITEMS = 100_000  # items taken from an iterator a program returns
_MARGIN_S = 0.25
_START_TIMEOUT_S = 60.0  # a session ends this long before the caller's deadline
# Exceptions a program's exception may become in the grader (others: ProgramError).
_NOT_RERAISED = ("StopIteration", "StopAsyncIteration", "GeneratorExit")
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


# --------------------------------------------------------------------- values


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


class _Lines:
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
    self._chan = _Lines(rfd, wfd)
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


# The template runs this module without the package's __init__ (which imports JAX):
# bare stand-ins for the parent packages let `from offpolicy_jax.rewards import sandbox` work.
_BOOT = """
import sys, types
for name, path in (("offpolicy_jax", sys.argv[1]), ("offpolicy_jax.rewards", sys.argv[2])):
  sys.modules[name] = module = types.ModuleType(name)
  module.__path__ = [path]
from offpolicy_jax.rewards import isolation
isolation._serve_template(*sys.argv[3:])
"""


class _Template:
  """The grader's handle on its template process."""

  def __init__(self, limits: sandbox.Limits, strict: bool):
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    rewards_dir = os.path.dirname(os.path.abspath(__file__))
    args = [rewards_dir, str(theirs.fileno()), str(os.getpid()), str(limits.memory_mb), str(strict)]
    self.process = subprocess.Popen(
      [sys.executable, "-I", "-c", _BOOT, os.path.dirname(rewards_dir), *args],
      pass_fds=[theirs.fileno()],
      stdin=subprocess.DEVNULL,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    theirs.close()
    mine.settimeout(_START_TIMEOUT_S)  # a template that stopped answering fails, never hangs
    self.sock = mine
    if mine.recv(1) != b"R":  # else an error message follows
      why = mine.recv(4096).decode(errors="replace")
      mine.close()
      self.process.wait()
      raise sandbox.SandboxError(f"program template failed: {why or 'it died'}")

  def fork(self) -> tuple[int, int]:
    """(write end, read end) of the pipes of a fresh program process."""
    try:
      _, fds, _, _ = socket.recv_fds(self.sock, 1, 2)
    except OSError as e:
      raise sandbox.SandboxError(f"the program template did not answer ({e})") from None
    if len(fds) != 2:
      raise sandbox.SandboxError("the program template did not hand over a process")
    return fds[0], fds[1]

  def kill(self) -> None:
    """Kills the process `fork` handed out (one at a time)."""
    self.sock.sendall(b"K")

  def close(self) -> None:
    self.sock.close()
    self.process.wait(10.0)


_template: _Template | None = None


def start_template(limits: sandbox.Limits | None = None, strict: bool = True) -> None:
  """Starts this process's program template (a verifier worker does, before its sandbox)."""
  global _template
  _template = _Template(limits or sandbox.Limits(), strict)


def template() -> _Template:
  """This process's program template, started on first use outside a worker."""
  if _template is None:
    start_template()
  assert _template is not None
  return _template


# -------------------------------------------------------- the template process


def _serve_template(sock_fd: str, parent: str, memory_mb: str, strict: str) -> None:
  """The template's loop: hands out forked children; b"K" kills the oldest one handed out."""
  sandbox.die_with_parent(int(parent))
  sock = socket.socket(fileno=int(sock_fd))
  try:
    sandbox.apply(sandbox.Limits(memory_mb=int(memory_mb)), strict=strict == "True", processes=True)
  except BaseException as e:  # noqa: BLE001  reported to the grader, which refuses to grade
    sock.sendall(f"X{type(e).__name__}: {e}".encode()[:4000])
    return
  seccomp_filter = sandbox.program_filter()
  # Warm the compiler and the codec once here: each child would pay its first use again.
  warm = compile("def f(a, b):\n  return [a, (b,), {a: b}]\n", "<warm-up>", "exec")
  json.loads(json.dumps(encode(warm.co_consts, {}, str)))
  sock.sendall(b"R")
  # Two children are handed out ahead: the grader's next one is ready while it grades.
  handed: collections.deque[int] = collections.deque()
  killed: list[int] = []  # reaped without waiting; until then no pid can be reused
  while True:
    while len(handed) < 2:
      pid, fds = _fork_program(sock, seccomp_filter)
      socket.send_fds(sock, [b"F"], list(fds))
      for fd in fds:
        os.close(fd)
      handed.append(pid)
    if sock.recv(1) != b"K":  # the grader is done with its oldest child (or gone)
      return
    pid = handed.popleft()
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)
    killed[:] = [p for p in killed if os.waitpid(p, os.WNOHANG)[0] == 0]


def _fork_program(sock: socket.socket, seccomp_filter) -> tuple[int, tuple[int, int]]:
  """A confined child waiting for its program; returns (pid, (its stdin, its stdout))."""
  in_r, in_w = os.pipe()
  out_r, out_w = os.pipe()
  parent = os.getpid()
  gc.freeze()  # the child's collections skip the template's objects: fewer copied pages
  pid = os.fork()
  if pid == 0:
    try:
      sock.close()
      os.close(in_w)
      os.close(out_r)
      _serve_program(parent, in_r, out_w, seccomp_filter)
    finally:
      os._exit(0)
  os.close(in_r)
  os.close(out_w)
  return pid, (in_w, out_r)


# ---------------------------------------------------------- the program process


def _serve_program(parent: int, rfd: int, wfd: int, seccomp_filter) -> None:
  """Runs one program and answers the grader's calls on it (the untrusted side)."""
  sandbox.die_with_parent(parent)
  low, high = sorted((rfd, wfd))
  for a, b in ((3, low), (low + 1, high), (high + 1, 1 << 16)):
    os.closerange(a, b)
  sandbox.confine_program(seccomp_filter)
  chan = _Lines(rfd, wfd)
  msg = chan.recv()
  sandbox.set_cpu_limit(float(msg["cpu_s"]))
  setup_ns: dict[str, Any] = {"__name__": "__setup__"}
  ns: dict[str, Any] = {"__name__": "__program__"}
  handles: dict[int, Any] = {}
  try:
    exec(msg["setup"], setup_ns)
    classes = {n: setup_ns[n] for n in msg["classes"] if isinstance(setup_ns.get(n), type)}
    exec(compile(msg["program"], "<program>", "exec"), ns)
  except BaseException as e:  # noqa: BLE001  reported as data
    chan.send({"raised": type(e).__name__})
    return
  by_type = {cls: n for n, cls in classes.items()}

  def handle(value):
    if isinstance(value, collections.abc.Iterator):
      items = []
      for v in value:
        items.append(enc(v))
        if len(items) > _MAX_ITEMS:
          raise ValueError("iterator too long")
      return {"iter": items}
    handles.setdefault(id(value), value)
    return {"handle": id(value)}

  enc = lambda v: encode(v, by_type, handle)  # noqa: E731
  chan.send({"ok": None})
  while True:
    msg = chan.recv()
    if msg["op"] == "map":
      chan.send({"ok": [_call(ns[msg["name"]], args, {}, enc) for args in msg["calls"]]})
      continue
    try:
      target = ns[msg["name"]] if "name" in msg else handles[msg["handle"]]
      args = decode(msg["args"], classes, handles.__getitem__)
      kwargs = decode(msg["kwargs"], classes, handles.__getitem__)
      value = getattr(target, msg["attr"]) if msg["op"] == "getattr" else target(*args, **kwargs)
      reply = {"ok": enc(value)}
    except BaseException as e:  # noqa: BLE001  reported as data
      reply = {"raised": type(e).__name__}
    chan.send(reply)


def _call(fn, args, kwargs, enc) -> dict[str, Any]:
  try:
    return {"ok": enc(fn(*args, **kwargs))}
  except BaseException as e:  # noqa: BLE001  reported as data
    return {"raised": type(e).__name__}
