"""Counting compilations and tracing steps with `jax.profiler`.

`CompileCounter` listens to JAX's own monitoring event for each XLA backend
compilation (`jax.monitoring`), so a metrics row can show that nothing
recompiles after warm-up. `Profiler` writes a `jax.profiler` trace of a window
of loop steps, viewable in TensorBoard's profile plugin or XProf.
`no_signal_warning` reads a run's first rows for a learning signal.
"""

from __future__ import annotations

import threading
import warnings

import jax
import numpy as np

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


# How many of a run's first steps are checked for a learning signal, and the
# mean share of groups without one (all K rewards equal) that draws a warning.
SIGNAL_STEPS = 10
NO_SIGNAL_SHARE = 0.9


def no_signal_warning(rows: list[dict], sft) -> str | None:
  """A warning, naming the field to change, when the first steps' groups teach next to nothing.

  A group whose K rewards are all equal has group-relative advantages of 0
  (`groups_all_equal` of each row): when nearly every group is so, the run
  spends its steps without a gradient. The usual cause is a warm start too
  short to leave the policy solving any prompt.

  Args:
    rows: the run's first train rows (`SIGNAL_STEPS` of them, or fewer in a short run).
    sft: the run's `sft` spec (`enabled`, `steps`).

  Returns:
    One line starting 'warning: ', or None when the groups carry a signal.
  """
  shares = [r["groups_all_equal"] for r in rows if "groups_all_equal" in r]
  if not shares or float(np.mean(shares)) < NO_SIGNAL_SHARE:
    return None
  reward = float(np.mean([r.get("reward_mean", 0.0) for r in rows]))
  head = (
    f"warning: in steps {rows[0]['step']}-{rows[-1]['step']}, {np.mean(shares):.0%} of the "
    f"groups had equal rewards (mean reward {reward:.3f}): their advantages are 0, so the "
    "run learns next to nothing"
  )
  if reward >= 0.5:
    fix = "the policy already solves nearly every prompt (a harder task, or fewer config.sft.steps)"
  elif sft.enabled:
    fix = (
      f"raise config.sft.steps (now {sft.steps}) so the warm start leaves it solving some prompts"
    )
  else:
    fix = "turn the warm start on (config.sft.enabled=True) or start from a model that solves some"
  return f"{head}; {fix}"
