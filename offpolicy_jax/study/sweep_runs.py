"""How a sweep runs each of its runs (a study each of its cells): in a worker process, or here.

`run_in_process(config, workdir)` trains one run in a fresh (spawned) Python
process whose stdout and stderr go to `workdir/sweep_run.log`. Whatever ends
that process (an exception, a segmentation fault inside XLA, the kernel's OOM
killer, a hung compile stopped by a signal) ends that run only, and what the
process held (compiled programs, device buffers, threads) goes with it, so a
sweep of hundreds of runs keeps a flat memory. Runs sharing compiled shapes
still share compilations, through a persistent compilation cache under the
sweep's workdir (or the one `JAX_COMPILATION_CACHE_DIR` names). `run_inline`
trains in this process (for debugging: one traceback, pdb, no start-up cost).
`in_worker(target, args, ...)` is the same for any module-level function: the
study runs its cells with it.

Signals: the worker runs in its own process group, so Ctrl-C at a terminal
reaches this process only, which passes SIGINT or SIGTERM on to the worker
once: the worker saves at its current step and stops
(`offpolicy_jax.run.stopping`), and the sweep stops after it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from offpolicy_jax import errors, files

LOG_FILE = "sweep_run.log"
CACHE_DIR = ".jax_cache"  # under the sweep's workdir, shared by its workers
POLL_S = 2.0  # how often `run_worker` polls a running worker's progress


def _error_line(e: BaseException) -> str:
  """`Type: message` on one line (newlines and runs of spaces collapsed)."""
  return " ".join(f"{type(e).__name__}: {e}".split())


def _train_run(config: Any, workdir: str) -> None:
  """Trains one sweep run; a run directory holding another config is named with the
  sweep's remedy (a sweep has no `--allow_config_change`)."""
  from offpolicy_jax.run import loop
  from offpolicy_jax.store import workdir as workdir_lib

  try:
    loop.train_and_evaluate(config, workdir)
  except workdir_lib.ConfigChanged as e:
    if not e.changes:
      raise
    raise workdir_lib.ConfigChanged(
      f"run directory {workdir} holds a run started with other values ({e.changes}). "
      "Delete that directory to rerun it with the sweep's values, or give the sweep a new "
      "--workdir.",
      e.changes,
    ) from None


def run_inline(config: Any, workdir: str) -> str | None:
  """Trains here; returns None, or the run's error on one line (its traceback printed)."""
  try:
    _train_run(config, workdir)
  except errors.Interrupted:
    raise
  except Exception as e:
    traceback.print_exc()
    return _error_line(e)
  return None


def error_path(log_path: str) -> str:
  """Where a worker writes the exception that ended it: the log's name with `.error`."""
  return os.path.splitext(log_path)[0] + ".error"


def redirect_output(log_path: str) -> None:
  """This process's stdout and stderr (file descriptors 1 and 2) append to `log_path`."""
  sys.stdout.flush()
  sys.stderr.flush()
  log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(log, 1)
  os.dup2(log, 2)
  os.close(log)


def record_error(e: BaseException, log_path: str) -> None:
  """The traceback of `e` to stderr, its one-line error to `error_path(log_path)`."""
  traceback.print_exc()
  sys.stderr.flush()
  # Whole, for a parent reading it while this process runs.
  files.write_text_atomic(error_path(log_path), _error_line(e))


def _worker(target: Callable, args: tuple, log_path: str, cache_dir: str) -> None:
  """The worker process: its own process group, output to the log, then `target(*args)`."""
  os.setpgrp()
  redirect_output(log_path)
  import jax

  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # a cache the user chose wins
    jax.config.update("jax_compilation_cache_dir", cache_dir)
  try:
    target(*args)
  except errors.Interrupted as e:
    print(e, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(e.exit_code)
  except Exception as e:
    record_error(e, log_path)
    os._exit(1)


def _tail(path: str, n: int) -> list[str]:
  """The last `n` non-empty lines of a log, progress bars left out."""
  try:
    with open(path, errors="replace") as f:
      lines = [x.rstrip() for x in f.read()[-20000:].splitlines() if x.strip()]
  except OSError:
    return []
  return [x for x in lines if "%|" not in x][-n:]


def _last_line(path: str) -> str:
  last = _tail(path, 1)
  return " ".join(last[0].split()) if last else ""


def describe_exit(code: int, log_path: str) -> str:
  """One line for a worker's exit status: how it ended, and its error or its log's last line."""
  how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
  error = error_path(log_path)
  last = _last_line(error) if os.path.exists(error) else _last_line(log_path)
  return f"{how}: {last}" if last else how


def run_in_process(config: Any, workdir: str, sweep_dir: str) -> str | None:
  """Trains in a worker process; returns None, or how it failed on one line.

  Raises:
    errors.Interrupted: this process got SIGINT or SIGTERM; the worker was
      asked to save and stop, and did.
  """
  os.makedirs(workdir, exist_ok=True)
  return in_worker(
    _train_run,
    (config, workdir),
    log_path=os.path.join(workdir, LOG_FILE),
    cache_dir=os.path.join(sweep_dir, CACHE_DIR),
    what=f"sweep stopped during run {os.path.basename(workdir)}",
  )


def in_worker(target: Callable, args: tuple, *, log_path: str, cache_dir: str, what: str):
  """Calls `target(*args)` in a spawned worker process; returns None, or how it failed.

  `target` is a module-level function (the worker imports it); its output goes
  to `log_path`, the exception that ends it to `error_path(log_path)` on one
  line, and its compilations to the persistent cache `cache_dir`. On failure
  the log's last lines go to stderr and the return value is one line: how
  the process ended and its error (or its log's last line).

  Raises:
    errors.Interrupted: this process got SIGINT or SIGTERM, passed it on to the
      worker once and waited for it (`what` starts the message).
  """
  code = run_worker(target, args, log_path=log_path, cache_dir=cache_dir, what=what)
  if code == 0:
    return None
  print_tail(log_path)
  return describe_exit(code, log_path)


def print_tail(log_path: str) -> None:
  """The last lines of a failed worker's log, to stderr."""
  tail = _tail(log_path, 12)
  print(f"--- the last lines of {log_path}:", *tail, "---", sep="\n", file=sys.stderr, flush=True)


def run_worker(
  target: Callable,
  args: tuple,
  *,
  log_path: str,
  cache_dir: str,
  what: str,
  poll: Callable[[], None] | None = None,
) -> int:
  """`in_worker`'s process: returns the worker's exit status (negative: the signal that ended it).

  `poll()`, if given, is called every `POLL_S` seconds while the worker runs (to
  report its progress).

  Raises:
    errors.Interrupted: this process got SIGINT or SIGTERM, passed it on to the
      worker once and waited for it (`what` starts the message).
  """
  with contextlib.suppress(FileNotFoundError):
    os.remove(error_path(log_path))  # a previous attempt's
  proc = multiprocessing.get_context("spawn").Process(
    target=_worker, args=(target, args, log_path, cache_dir), daemon=False
  )
  received: list[int] = []

  def forward(signum, frame):
    del frame
    if not received and proc.pid is not None:
      os.kill(proc.pid, signum)  # once: a second signal would stop it without saving
    received.append(signum)

  main = threading.current_thread() is threading.main_thread()  # handlers: main thread only
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM) if main}
  try:
    proc.start()
    while proc.exitcode is None:
      proc.join(POLL_S if poll is not None else None)
      if poll is not None and proc.exitcode is None:
        poll()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  code = proc.exitcode if proc.exitcode is not None else -signal.SIGKILL
  if received:
    raise errors.Interrupted(
      f"{what} ({describe_exit(code, log_path)}); rerunning the same command resumes it",
      128 + received[0],
    )
  return code
