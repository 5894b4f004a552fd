"""Stopping a run on SIGTERM or SIGINT without losing work.

A scheduler sends SIGTERM before it preempts a job; a person presses Ctrl-C.
Inside `with Stop() as stop:` the first of either signal only sets a flag:
the loop finishes the steps in flight (a chunk of up to `Stop.chunk` steps
runs as one program), writes a checkpoint and the metrics so far,
and raises `errors.Interrupted` ("stopped at step N; the same command
resumes"), which the binaries turn into exit status 128 + the signal's
number. A second signal ends the process at once.

Across processes: one process may see the signal before the others (or
alone), so `agreed()` reduces the flag over all processes; every process
stops after the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stop:
  """The stop request of a run: a context that holds SIGTERM and SIGINT."""

  def __init__(self) -> None:
    self.signum: int | None = None
    self.chunk: int | None = None  # the steps one program runs (the loop sets it per chunk)
    self._previous: dict[int, object] = {}

  def __enter__(self) -> Stop:
    # Signal handlers can only be set from the main thread (a run driven from
    # another thread, e.g. a notebook's worker, keeps the default behaviour).
    if threading.current_thread() is threading.main_thread():
      for s in SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)  # type: ignore[arg-type]
    self._previous.clear()

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum is not None:
      print(f"{name} again: stopping now, without saving", file=sys.stderr, flush=True)
      os._exit(128 + signum)
    self.signum = signum
    steps = "" if not self.chunk else f" (up to {self.chunk} steps run as one program)"
    print(
      f"{name}: finishing the steps in flight{steps}, then saving (a second signal stops at once)",
      file=sys.stderr,
      flush=True,
    )

  def agreed(self) -> int | None:
    """The signal any process received (the same answer on every process), or None."""
    mine = self.signum or 0
    if jax.process_count() > 1:
      mine = int(np.max(multihost_utils.process_allgather(np.int32(mine))))
    return mine or None
