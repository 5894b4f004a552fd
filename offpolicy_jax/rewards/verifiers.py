"""A pool of sandboxed, killable verifier worker processes.

Host rewards run third-party verifier code (math-verify, reasoning-gym, the
code task's unit tests) on model output. None of it runs in the trainer:

  pool = verifiers.get_pool(num_workers=4)
  result = pool.score(task.reward, examples, texts, timeout_s=10.0)
  batch = pool.call(fn, [(x, y), ...], timeout_s=10.0)   # any JSON-data function

Each worker is a separate process, started from a `forkserver` (so it inherits
no JAX runtime state, threads or device handles of the trainer) that has
already imported the verifier libraries (a restart costs a fork, not an
import), and confined by `sandbox.apply` before it sees any model output.

Why `multiprocessing` directly rather than a pool library (pebble,
`concurrent.futures`): the trainer must never unpickle what a worker sends,
because code running in a worker (a hostile program of the code task) could
write a crafted pickle to its pipe. Workers receive pickled calls from the
trainer (trusted direction) and answer with bounded JSON lines parsed as data,
so a worker taken over can at worst forge its own scores (graded programs
never run in a worker: see `isolation`). A
`ProcessPoolExecutor` also cannot stop a running call.

`score` (rewards: a float per row) and `call` (any function whose value is
JSON data, such as the environments of multi-turn tasks, see `environments`)
share one dispatch loop, `_Batch`.

Timeouts: a call that runs longer than `timeout_s` in its worker fails (a
reward scores 0), is counted as a timeout, and its worker is killed (SIGKILL)
and replaced; a batch that is not done `batch_timeout_s` after it started
(default `2 * timeout_s`) kills every worker still busy and fails what never
started as timeouts. Nothing keeps running after `score` or `call` returns.

Replies cannot be forged across calls: each call carries a random id that its
reply must echo, and a worker that sends more than one reply to a call is
replaced (its call fails as crashed). So code that takes over a worker's pipe
can at worst forge the value of its own call, never that of a later one.

Lanes: calls made inside `with verifiers.lane(i)` (i > 0) go to the workers of
the pool's lane i, a pool of its own with the same settings (started on its
first call), never to the pool's own. A pool serves one batch at a time, so
threads that each keep a batch in flight (the async sampler's, `lag.
sampler_threads`) give each its lane: their environments' waits overlap
instead of queuing behind one another.

Callables reach a worker by pickling: a module-level function, a
`functools.partial` of one, or a `worker.Rebuild` (`RebuildReward`,
`environments.RebuildEnv`) that rebuilds a registered task in the worker from
its factory and keyword arguments. `check` probes this at start-up, so a
reward that cannot reach a worker fails there, naming it.

This module is the trainer's side. What runs inside a worker (`worker_main`),
the messages on its pipes and `RebuildReward` are in `worker`.
"""

import atexit
import collections
import contextlib
import logging
import math
import multiprocessing.connection as mp_connection
import os
import pickle
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from offpolicy_jax.rewards import sandbox
from offpolicy_jax.rewards.verifier_process import (
  WorkerProcess,
  closed_after_reply,
  forkserver_context,
)
from offpolicy_jax.rewards.verifier_results import (
  CRASHED,
  ERROR,
  GARBAGE,
  TIMEOUT,
  CallResult,
  Outcome,
  RewardResult,
)
from offpolicy_jax.rewards.worker import MAX_REPLY_BYTES, Rebuild, RebuildReward, parse_reply

_FLOAT32_MAX = float(np.finfo(np.float32).max)


class VerifierPool:
  """`num_workers` sandboxed verifier processes (see the module docstring).

  Args:
    num_workers: worker processes (None: `os.cpu_count()`).
    memory_mb: address-space limit of each worker in MiB.
    sandbox_mode: "strict" (refuse to run verifiers unconfined) or "warn"
      (run with what the platform offers, and log what is missing).
  """

  def __init__(self, num_workers: int | None = None, memory_mb: int = 2048, sandbox_mode="strict"):
    if sandbox_mode not in ("strict", "warn"):
      raise ValueError(f"sandbox_mode must be 'strict' or 'warn', got {sandbox_mode!r}")
    self.settings = (int(num_workers or os.cpu_count() or 1), int(memory_mb), sandbox_mode)
    self.lane = 0  # `get_pool` sets the lane of the pools it makes
    self._ctx = forkserver_context()
    self._limits = sandbox.Limits(memory_mb=int(memory_mb))
    self._strict = sandbox_mode == "strict"
    self._lock = threading.Lock()
    self._fn_ids: dict[bytes, int] = {}
    self.restarts = 0
    n = int(num_workers or os.cpu_count() or 1)
    self._workers: list[WorkerProcess] = []
    try:
      for _ in range(n):
        self._workers.append(self._start())
    except BaseException:
      self.close()
      raise

  def _start(self) -> WorkerProcess:
    w = WorkerProcess(self._ctx, self._limits, self._strict)
    missing = w.wait_ready()
    if missing and not getattr(self, "_warned", False):
      self._warned = True
      logging.warning("verifier sandbox is incomplete: %s", "; ".join(missing))
    return w

  @property
  def num_workers(self) -> int:
    return len(self._workers)

  def pids(self) -> list[int]:
    """Process ids of the live workers."""
    return [w.process.pid for w in self._workers if w.process.pid is not None]

  def _fn_id(self, fn, name: str = "") -> tuple[int, bytes]:
    try:
      data = pickle.dumps(getattr(fn, "ref", fn), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
      raise ValueError(_unreachable(name or getattr(fn, "name", ""), fn, e)) from e
    return self._fn_ids.setdefault(data, len(self._fn_ids)), data

  def check(self, fn, name: str = "", timeout_s: float = 60.0) -> None:
    """Makes a worker load `fn`; raises ValueError naming `name` if it cannot."""
    fn_id, data = self._fn_id(fn, name)
    with self._lock:
      w = self._send(self._workers[0], fn_id, data, ("load", -1, fn_id, (), timeout_s))
      if not w.replies.poll(timeout_s):
        self._replace(w)
        raise ValueError(_unreachable(name, fn, f"loading took over {timeout_s} s"))
      msg = parse_reply(w.replies.recv_bytes(MAX_REPLY_BYTES))
      if msg.get("recycle"):
        self._replace(w)
    if "load_error" in msg or "error" in msg:
      raise ValueError(_unreachable(name, fn, msg.get("load_error") or msg["error"]))

  def _send(self, w: WorkerProcess, fn_id: int, data: bytes, msg: tuple) -> WorkerProcess:
    """Sends `msg` (after the reward, if `w` lacks it); a dead worker is replaced first."""
    for attempt in range(2):
      try:
        if fn_id not in w.known:
          w.calls.send(("fn", fn_id, data))
          w.known.add(fn_id)
        w.calls.send(msg)
        return w
      except (OSError, EOFError):  # died while idle (e.g. SIGXCPU from a stray thread)
        if attempt:
          raise
        w = self._replace(w)
    return w

  def _replace_dead(self) -> None:
    for w in list(self._workers):
      if not w.process.is_alive():
        self._replace(w)

  def _replace(self, w: WorkerProcess) -> WorkerProcess:
    w.kill()
    self.restarts += 1
    new = self._start()
    self._workers[self._workers.index(w)] = new
    return new

  def score(
    self,
    fn,
    examples: Sequence[Any],
    texts: Sequence[str],
    timeout_s: float = 10.0,
    batch_timeout_s: float | None = None,
  ) -> RewardResult:
    """Scores `fn(examples[b], texts[b])` for every b in the workers.

    Args:
      fn: host reward `fn(example, text) -> float` that pickles (see module docstring).
      examples: B examples (picklable).
      texts: B responses.
      timeout_s: limit of one call, from the moment a worker starts it.
      batch_timeout_s: limit of the whole batch (default `2 * timeout_s`).

    Returns:
      RewardResult (failures score 0).
    """
    if len(examples) != len(texts):
      raise ValueError(f"examples ({len(examples)}) and texts ({len(texts)}) differ in length.")
    args = [(ex, str(t)) for ex, t in zip(examples, texts, strict=True)]
    res = self._run(fn, "score", args, timeout_s, batch_timeout_s)
    n = len(args)
    scores = np.zeros(n, np.float32)
    failed = np.zeros(n, bool)
    timed_out = np.zeros(n, bool)
    errors = list(res.errors)
    for i, out in enumerate(res.outcomes):
      score = out.value
      if out.failure:
        failed[i], timed_out[i] = True, out.failure == TIMEOUT
      elif type(score) not in (int, float) or not (
        math.isfinite(score) and abs(score) <= _FLOAT32_MAX
      ):
        failed[i] = True
        if len(errors) < 5:
          errors.append(f"row {i}: score {score!r} is not finite in float32")
      else:
        scores[i] = score
    return RewardResult(scores, failed, timed_out, res.seconds, res.restarts, tuple(errors))

  def call(
    self,
    fn,
    args: Sequence[Sequence[Any]],
    timeout_s: float = 10.0,
    batch_timeout_s: float | None = None,
  ) -> CallResult:
    """Runs `fn(*args[b])` for every b in the workers; values come back as JSON data.

    The value of a call must be JSON data (`worker.is_json_data`: None, bool,
    int, finite float, str, lists, dicts with str keys; the reply at most
    `worker.MAX_REPLY_BYTES`): anything else fails as `GARBAGE`. A call that
    raises fails as `ERROR` (as `TIMEOUT` if it raised TimeoutError), one past
    its timeout as `TIMEOUT`, one whose worker dies as `CRASHED`; the others
    still return. Failures are for the caller to count.

    Args:
      fn: `fn(*row) -> JSON data` that pickles (see the module docstring).
      args: B argument tuples (picklable).
      timeout_s: limit of one call, from the moment a worker starts it.
      batch_timeout_s: limit of the whole batch (default `2 * timeout_s`).

    Returns:
      CallResult with one `Outcome` per row.
    """
    return self._run(fn, "call", [tuple(a) for a in args], timeout_s, batch_timeout_s)

  def _run(self, fn, kind, args, timeout_s, batch_timeout_s) -> CallResult:
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
      raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s}")
    lane = getattr(_LANE, "value", 0)
    if lane != self.lane:  # this thread's calls go to its own lane's workers
      return get_pool(*self.settings, lane=lane)._run(fn, kind, args, timeout_s, batch_timeout_s)
    fn_id, data = self._fn_id(fn)
    with self._lock:
      try:
        return _Batch(self, fn_id, data, kind, args, timeout_s, batch_timeout_s).run()
      except _LoadError as e:
        raise ValueError(_unreachable(getattr(fn, "name", ""), fn, e)) from None

  def close(self) -> None:
    """Stops every worker (idempotent)."""
    for w in self._workers:
      try:
        w.calls.send(None)
      except OSError:
        pass
    for w in self._workers:
      w.process.join(1.0)
      w.kill()
    self._workers = []


class _LoadError(Exception):
  """A worker could not load the reward (not importable there)."""


class _Batch:
  """The dispatch loop of one `VerifierPool.score` or `VerifierPool.call`."""

  def __init__(self, pool, fn_id, data, kind, args, timeout_s, batch_timeout_s):
    self.pool, self.fn_id, self.data, self.kind = pool, fn_id, data, kind
    self.args, self.timeout_s = args, float(timeout_s)
    self.outcomes = [Outcome()] * len(args)
    self.errors: list[str] = []
    self.pending = collections.deque(range(len(args)))
    self.start = time.monotonic()
    self.deadline = self.start + (batch_timeout_s or 2.0 * self.timeout_s)
    self.restarts0 = pool.restarts

  def _fail(self, i: int, failure: str, why: str) -> None:
    self.outcomes[i] = Outcome(None, failure, why)
    if len(self.errors) < 5:
      self.errors.append(f"row {i}: {why}")

  def _dispatch(self, w: WorkerProcess, i: int) -> None:
    # A random id, not the row: a call that writes to its pipe cannot answer for later calls.
    call_id = secrets.randbits(62)
    msg = (self.kind, call_id, self.fn_id, self.args[i], self.timeout_s)
    w = self.pool._send(w, self.fn_id, self.data, msg)
    w.busy, w.call_id = (i, time.monotonic()), call_id

  def _receive(self, w: WorkerProcess) -> None:
    i = w.busy[0] if w.busy else -1
    try:
      msg = parse_reply(w.replies.recv_bytes(MAX_REPLY_BYTES))
      if msg.get("i") != w.call_id:
        raise ValueError(f"reply to call {msg.get('i')!r}, expected {w.call_id}")
      dead = not msg.get("recycle") and w.replies.poll(0) and closed_after_reply(w)
    except (EOFError, OSError, ValueError) as e:  # died (SIGXCPU, os._exit) or garbled its pipe
      code = w.process.exitcode
      self._fail(i, CRASHED, f"worker lost ({type(e).__name__}: {e}; exit code {code})")
      self.pool._replace(w)
      return
    w.busy = None
    if "load_error" in msg:
      raise _LoadError(str(msg["load_error"]))
    if msg.get("recycle") or dead:
      self.pool._replace(w)
    if "error" in msg or "value" not in msg:
      kind = TIMEOUT if msg.get("timed_out") is True else ERROR
      kind = GARBAGE if msg.get("garbage") is True else kind
      self._fail(i, kind, str(msg.get("error", "no value"))[:500])
    else:
      self.outcomes[i] = Outcome(msg["value"])

  def run(self) -> CallResult:
    pool = self.pool
    pool._replace_dead()
    try:
      self._loop()
    except _LoadError:
      for w in list(pool._workers):  # drop the calls still in flight
        if w.busy is not None:
          pool._replace(w)
      raise
    seconds = time.monotonic() - self.start
    return CallResult(self.outcomes, seconds, pool.restarts - self.restarts0, tuple(self.errors))

  def _loop(self) -> None:
    pool = self.pool
    while True:
      for w in pool._workers:
        if w.busy is None and self.pending:
          self._dispatch(w, self.pending.popleft())
      busy = [w for w in pool._workers if w.busy is not None]
      if not busy:
        break
      now = time.monotonic()
      wake = min(self.deadline, *(w.busy[1] + self.timeout_s for w in busy))
      ready = set(mp_connection.wait([w.replies for w in busy], timeout=max(0.0, wake - now)))
      for w in busy:
        if w.replies in ready:
          self._receive(w)
      now = time.monotonic()
      for w in list(pool._workers):
        if w.busy is not None and (now >= w.busy[1] + self.timeout_s or now >= self.deadline):
          self._fail(w.busy[0], TIMEOUT, f"timed out after {now - w.busy[1]:.1f} s")
          pool._replace(w)
      if now >= self.deadline:
        for i in self.pending:
          self._fail(i, TIMEOUT, "batch timed out before the call started")
        break


def _unreachable(name: str, fn, why) -> str:
  what = f"task {name!r}" if name else f"{fn!r}"
  return (
    f"{what}: its reward or environment cannot run in a sandboxed verifier worker ({why}). Make "
    "the reward a module-level function (or functools.partial of one) of an importable module, "
    "the environment an instance of a module-level class, or register the task with a "
    "module-level factory of an importable module."
  )


_POOLS: dict[tuple, VerifierPool] = {}
_POOLS_LOCK = threading.Lock()


_LANE = threading.local()


def get_pool(
  num_workers: int | None = None, memory_mb: int = 2048, sandbox_mode: str = "strict", lane=0
) -> VerifierPool:
  """The process-wide pool with these settings and lane (started on first use, stopped at exit)."""
  key = (int(num_workers or os.cpu_count() or 1), int(memory_mb), sandbox_mode, int(lane))
  with _POOLS_LOCK:
    if key not in _POOLS:
      _POOLS[key] = VerifierPool(*key[:3])
      _POOLS[key].lane = key[3]
    return _POOLS[key]


@contextlib.contextmanager
def lane(i: int):
  """Within it, this thread's calls to any pool go to that pool's lane `i` (module docstring)."""
  if int(i) < 0:
    raise ValueError(f"lane must be >= 0, got {i}")
  before = getattr(_LANE, "value", 0)
  _LANE.value = int(i)
  try:
    yield
  finally:
    _LANE.value = before


@atexit.register
def close_pools() -> None:
  """Stops every pool made by `get_pool`."""
  with _POOLS_LOCK:
    for pool in _POOLS.values():
      pool.close()
    _POOLS.clear()


__all__ = [
  "Rebuild",
  "RebuildReward",
  "VerifierPool",
  "close_pools",
  "get_pool",
  "lane",
]
