"""A run's console progress: plain lines in a log, a bar on a terminal, ETAs after compiling."""

import io
import re

from offpolicy_jax.store import progress


def test_a_log_gets_plain_lines_about_every_tenth_of_the_run(monkeypatch):
  clock = iter([100.0, 101.0, 102.0, 103.0, 104.0, 105.0])
  monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
  out = io.StringIO()
  bar = progress.Progress(100, 0, stream=out)  # a StringIO is not a terminal
  bar.write("eval at step 0: ...")
  for step in (10, 20, 30, 40, 100):
    bar.update(step, reward=0.25)
  bar.close()
  lines = out.getvalue().splitlines()
  assert "\r" not in out.getvalue()
  assert lines[0] == "steps 0 -> 100: compiling the first chunk of steps"
  assert lines[1] == "eval at step 0: ..."
  # The first chunk (compilation) has no rate; the next ones' rate excludes it: 10 steps/s.
  assert lines[2] == "step 10/100, reward=0.250"
  assert lines[3] == "step 20/100, 10 steps/s, about 8 s left, reward=0.250"
  assert lines[-1] == "step 100/100, 22.5 steps/s, about 0 s left, reward=0.250"
  assert len(lines) == 7


def test_the_rate_starts_after_the_first_chunks_rows_and_a_finished_run_compiles_nothing(
  monkeypatch,
):
  # The first chunk's 3 rows arrive together after compiling; the next 10 steps take 1 s.
  clock = iter([100.0, 100.01, 100.02, 101.02])
  monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
  out = io.StringIO()
  bar = progress.Progress(30, 0, stream=out)
  for step in (1, 2, 3, 13):
    bar.update(step)
  assert out.getvalue().splitlines()[-1] == "step 13/30, 10 steps/s, about 2 s left"
  done = io.StringIO()
  progress.Progress(30, 30, stream=done).close()
  assert done.getvalue() == ""


def test_a_resumed_log_counts_its_tenths_from_the_resumed_step():
  out = io.StringIO()
  bar = progress.Progress(200, 80, stream=out)
  for step in range(81, 201):
    bar.update(step)
  steps = [int(m) for m in re.findall(r"^step (\d+)/200", out.getvalue(), re.M)]
  assert steps == [81, 92, 104, 116, 128, 140, 152, 164, 176, 188, 200]


def test_a_terminal_bar_reads_compiling_then_times_only_the_steps_after_it():
  out = io.StringIO()
  bar = progress.Progress(50, 0, stream=out, terminal=True)
  assert bar._bar.desc == "compiling"
  bar.update(5, reward=0.5)
  assert bar._bar.desc == "" and bar._bar.initial == bar._bar.n == 5
  bar.update(10, reward=0.5)
  assert bar._bar.n == 10
  bar.close()


def test_durations_read_as_people_say_them():
  assert progress._duration(42.4) == "42 s"
  assert progress._duration(95) == "1 min 35 s"
  assert progress._duration(4000) == "1 h 6 min"
