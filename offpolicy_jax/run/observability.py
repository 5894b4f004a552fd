"""Counting compilations and tracing steps with `jax.profiler`.

`CompileCounter` listens to JAX's own monitoring event for each XLA backend
compilation (`jax.monitoring`), so a metrics row can show that nothing
recompiles after warm-up. `Profiler` writes a `jax.profiler` trace of a window
of loop steps, viewable in TensorBoard's profile plugin or XProf.
"""

from __future__ import annotations

import threading
import warnings

import jax

# The event JAX records once per XLA compilation (jax/_src/dispatch.py).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Counts XLA compilations in this process since it was created."""

  def __init__(self):
    self._count = 0
    self._lock = threading.Lock()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == _COMPILE_EVENT:
      with self._lock:
        self._count += 1

  @property
  def count(self) -> int:
    return self._count

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)


class Profiler:
  """Traces whole chunks covering at least `steps` loop steps, from the second chunk on.

  The first chunk of a run (or of a resume) compiles, so it is never traced; a
  run that is one chunk long gets no trace, and `stop` says so.

  Args:
    log_dir: where the trace goes (`<workdir>/profile`).
    steps: how many loop steps to trace; 0 disables tracing.
  """

  def __init__(self, log_dir: str, steps: int):
    self._dir, self._steps = log_dir, steps
    self._active = False
    self._until: int | None = None
    self._started = False

  def before(self, step: int, n: int, *, first: bool) -> None:
    """Called before the chunk of steps `step .. step + n - 1`."""
    if not self._steps or self._started or first:
      return
    jax.profiler.start_trace(self._dir)
    self._active = self._started = True
    self._until = step + self._steps - 1

  def after(self, step: int) -> None:
    """Called after the chunk ending at `step`."""
    if self._active and self._until is not None and step >= self._until:
      self.stop()

  def stop(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False
    elif self._steps and not self._started:
      self._started = True  # warn once
      warnings.warn(
        f"config.profile_steps={self._steps}: no trace written, the run had no chunk after "
        "its first (lower log_every or run longer)",
        stacklevel=2,
      )
