"""The processes that run untrusted programs (`rewards.isolation`): the template and its children.

A grader's *template* (`start_template`, `template`) is a small fresh
interpreter (standard library, `sandbox`, `isolation_wire` and this module
only) that keeps forked children ready; each child is a *program process*
that runs one program and answers the grader's calls on it as data.
"""

import collections.abc
import gc
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from offpolicy_jax.rewards import sandbox
from offpolicy_jax.rewards.isolation_wire import MAX_ITEMS, Lines, decode, encode

_START_TIMEOUT_S = 60.0  # a template that has not answered by then fails


# The template runs this module without the package's __init__ (which imports JAX):
# bare stand-ins for the parent packages let `from offpolicy_jax.rewards import sandbox` work.
_BOOT = """
import sys, types
for name, path in (("offpolicy_jax", sys.argv[1]), ("offpolicy_jax.rewards", sys.argv[2])):
  sys.modules[name] = module = types.ModuleType(name)
  module.__path__ = [path]
from offpolicy_jax.rewards import isolation_processes
isolation_processes._serve_template(*sys.argv[3:])
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
  chan = Lines(rfd, wfd)
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
        if len(items) > MAX_ITEMS:
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
