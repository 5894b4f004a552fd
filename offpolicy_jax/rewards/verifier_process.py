"""The trainer's handle on one verifier worker process (`rewards.verifiers`; its inside: `worker`).

A worker starts from a `forkserver` that has imported the verifier libraries
once (`forkserver_context`), reports ready (or fatal) on its reply pipe, and is
killed (SIGKILL) when it times out, dies or misbehaves.
"""

import importlib.util
import multiprocessing as mp

from offpolicy_jax.rewards import sandbox
from offpolicy_jax.rewards.worker import MAX_REPLY_BYTES, parse_reply, worker_main

_START_TIMEOUT_S = 120.0
# Verifier libraries the forkserver imports once, when installed.
# The forkserver imports these once; every worker forks with them loaded, so a call's first
# unpickling (a task, an environment and the modules it comes from) does not spend its
# timeout importing. `offpolicy_jax.models` brings flax and the tokenizers, which tasks and
# environments defined beside the library's code import.
_PRELOAD = (
  "offpolicy_jax.rewards.tasks",
  "offpolicy_jax.models",
  "sympy",
  "math_verify",
  "reasoning_gym",
)


class WorkerProcess:
  """One verifier worker process and its two pipes (calls in, replies out)."""

  def __init__(self, ctx, limits: sandbox.Limits, strict: bool):
    self.calls_r, self.calls = ctx.Pipe(duplex=False)
    self.replies, replies_w = ctx.Pipe(duplex=False)
    self.process = ctx.Process(
      target=worker_main, args=(self.calls_r, replies_w, limits, strict), daemon=True
    )
    self.process.start()
    replies_w.close()
    self.calls_r.close()
    self.known: set[int] = set()
    self.busy: tuple[int, float] | None = None  # (row, start time)
    self.call_id = -1  # of the call in flight

  def wait_ready(self) -> list[str]:
    if not self.replies.poll(_START_TIMEOUT_S):
      self.kill()
      raise sandbox.SandboxError(f"verifier worker did not start within {_START_TIMEOUT_S} s")
    msg = parse_reply(self.replies.recv_bytes(MAX_REPLY_BYTES))
    if "fatal" in msg:
      self.kill()
      raise sandbox.SandboxError(str(msg["fatal"]))
    return list(msg.get("ready", []))

  def kill(self) -> None:
    if self.process.is_alive():
      self.process.kill()
    self.process.join(5.0)
    for conn in (self.calls, self.replies):
      conn.close()


def forkserver_context():
  """The `forkserver` context workers start from (preloading the verifier libraries)."""
  ctx = mp.get_context("forkserver")
  # Takes effect when the forkserver starts (the first pool of the process).
  ctx.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m) is not None])
  return ctx


def closed_after_reply(w: WorkerProcess) -> bool:
  """After a reply, the worker's pipe is readable: True if it closed (the worker died after
  replying; the reply stands).

  Raises:
    ValueError: it holds another message. A worker sends one reply per call,
      so the call wrote to the pipe itself, e.g. replies for the rows it
      expects next; the reply and the worker are both dropped.
  """
  try:
    w.replies.recv_bytes(MAX_REPLY_BYTES)
  except EOFError:
    return True
  except OSError:
    pass
  raise ValueError("the worker sent more than one reply to one call")
