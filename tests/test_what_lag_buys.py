"""The numbers docs/what_lag_buys.md quotes, recomputed from the runs' committed rows."""

import json
import os

import numpy as np
import pytest

from offpolicy_jax import timeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, "docs", "results", "what_lag_buys")
DOC = os.path.join(REPO, "docs", "what_lag_buys.md")


def _train(name: str) -> list[dict]:
  with open(os.path.join(RUNS, f"calculator_latency_{name}.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if "step_time_s" in r]


def _line(sync: list[dict]) -> str:
  later = sync[2:]  # steps 3-30: the first two compile
  mean = lambda k: f"{np.mean([r.get(k, 0.0) for r in later]):.3f}"
  last = sync[-1]
  wait = mean("time/wait_s") if "time/wait_s" in last else ""
  cells = [mean(k) for k in ("step_time_s", "time/sample_s", "episode/env_s", "time/train_s")]
  cells += [wait, f"{last['time/run_wall_s']:.0f} s"]
  for side in ("sampler", "learner"):
    busy = last[f"time/run_{side}_busy_s"] + last["time/run_device_busy_s"]
    cells.append(f"{busy:.0f} s / {last[f'time/run_{side}_idle_s']:.0f} s")
  return " | ".join(cells).replace("|  |", "| |") + " |"


def test_the_table_is_the_committed_runs():
  text = open(DOC).read()
  assert "| sync | " + _line(_train("sync")) in text
  assert "| async (max staleness 4) | " + _line(_train("async")) in text


def test_the_timeline_prediction_and_its_error():
  sync, run_async = _train("sync"), _train("async")
  costs = timeline.from_rows(sync)
  predicted = timeline.step_time(costs, timeline.Layout("async", 1))
  measured = np.mean([r["step_time_s"] for r in run_async[2:]])
  text = open(DOC).read()
  assert f"| async (staleness >= 1), shared devices | {predicted:.3g} | {measured:.3f} |" in text
  assert f"{(predicted / measured - 1):+.1%}" in text
  assert f"1.088 s a step, {np.mean([r['step_time_s'] for r in sync[2:]]) / measured:.2f}x" in text


def test_the_two_worker_run_timed_out_and_learnt_nothing():
  rows = _train("sync_2_workers")
  text = open(DOC).read()
  timeouts = sum(r["reward_timeouts"] for r in rows)
  assert f"({timeouts} timeouts in {len(rows)} steps)" in text
  assert f"about {timeouts / len(rows):.0f} of the 64" in text
  assert f"a step took {np.mean([r['step_time_s'] for r in rows[2:]]):.1f} s" in text
  assert rows[-1]["reward_mean"] == pytest.approx(0.0)
