"""A run's progress on the console: a tqdm bar on a terminal, plain lines in a log.

On a terminal (`stream.isatty()`) the bar reads "compiling" until the first
chunk of steps is done, and its rate and ETA count only the steps after it:
the first chunk's time is mostly compilation, and counted as a step it makes
the first ETA read hours. Anywhere else (a log file, a pipe, a notebook's
captured output) tqdm's carriage returns would pile up, so the same facts go
out as one plain line about every tenth of the run.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

# A plain line is printed each time the run crosses another tenth of its steps.
_PLAIN_LINES = 10
# Rows of one chunk arrive together: the first rows, each this close to the one before, are
# the first chunk's.
_BURST_S = 0.05


def _duration(seconds: float) -> str:
  """`95` -> '1 min 35 s'; `4000` -> '1 h 7 min'."""
  s = int(round(seconds))
  if s < 60:
    return f"{s} s"
  if s < 3600:
    return f"{s // 60} min {s % 60} s"
  return f"{s // 3600} h {s % 3600 // 60} min"


def _shown(postfix: dict[str, Any]) -> dict[str, Any]:
  return {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in postfix.items()}


class Progress:
  """The progress of steps `start`..`total`: `update(step, **postfix)`, `write(text)`, `close()`.

  Args:
    total: the run's last step.
    start: the step the run starts from (a resume's checkpoint step).
    stream: where the bar or the lines go (default: stderr for the bar,
      stdout for plain lines).
    terminal: draw a tqdm bar; default: whether `stream` (stderr) is a terminal.
  """

  def __init__(
    self,
    total: int,
    start: int = 0,
    *,
    stream: IO[str] | None = None,
    terminal: bool | None = None,
  ):
    self.total, self.start = total, start
    if terminal is None:
      terminal = bool(getattr(stream or sys.stderr, "isatty", lambda: False)())
    self._stream = stream
    self._bar = None
    self._timed: tuple[int, float] | None = None  # (step, time) once the first chunk is done
    self._shown = -1  # the last tenth a plain line was printed for
    self._burst = True  # still in the first chunk's rows
    if terminal:
      from tqdm.auto import tqdm

      self._bar = tqdm(
        total=total,
        initial=start,
        unit="step",
        dynamic_ncols=True,
        desc="compiling",
        file=stream,
      )
    elif start < total:
      self.write(f"steps {start} -> {total}: compiling the first chunk of steps")

  def update(self, step: int, **postfix: Any) -> None:
    """The run is after `step`; `postfix` (e.g. reward=0.4) is shown beside it."""
    now = time.perf_counter()
    # The rate counts from the last row of the first chunk (its time was compilation).
    first = self._timed is None or (self._burst and now - self._timed[1] < _BURST_S)
    if first:
      self._timed = (step, now)
    else:
      self._burst = False
    if self._bar is not None:
      self._update_bar(step, postfix, first)
      return
    tenth = (step - self.start) * _PLAIN_LINES // max(self.total - self.start, 1)
    if tenth > self._shown or step >= self.total:
      self._shown = tenth
      self.write(self._line(step, postfix, now))

  def _update_bar(self, step: int, postfix: dict[str, Any], first: bool) -> None:
    bar = self._bar
    assert bar is not None
    if first:
      # Rate and ETA from here on: the first chunk's time was compilation.
      bar.reset(total=self.total)
      bar.initial = bar.n = step
      bar.set_description_str("")
    else:
      bar.update(step - bar.n)
    bar.set_postfix(_shown(postfix), refresh=True)

  def _line(self, step: int, postfix: dict[str, Any], now: float) -> str:
    line = f"step {step}/{self.total}"
    assert self._timed is not None
    done, since = step - self._timed[0], now - self._timed[1]
    if done > 0 and since > 0:
      rate = done / since
      line += f", {rate:.3g} steps/s, about {_duration((self.total - step) / rate)} left"
    return ", ".join([line, *(f"{k}={v}" for k, v in _shown(postfix).items())])

  def write(self, text: str) -> None:
    """Prints `text` on its own line without breaking the bar."""
    if self._bar is not None:
      self._bar.write(text, file=self._stream)
    else:
      print(text, file=self._stream or sys.stdout, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
