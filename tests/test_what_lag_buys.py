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


GRID = os.path.join(RUNS, "calculator_latency_grid")


def _grid_steps() -> dict[tuple[str, int], list[dict]]:
  import csv

  out: dict[tuple[str, int], list[dict]] = {}
  with open(os.path.join(GRID, "steps.csv"), newline="") as f:
    for row in csv.DictReader(f):
      values = {k: float(v) for k, v in row.items() if k not in ("group", "seed") and v != ""}
      out.setdefault((row["group"], int(row["seed"])), []).append(values)
  return out


def test_the_grid_table_is_the_committed_per_seed_values():
  from offpolicy_jax.study import paired_runs

  runs = paired_runs.read_csv(os.path.join(GRID, "compare.csv"))
  assert {g: sorted(r) for g, r in runs.items()} == {g: list(range(8)) for g in runs}
  recs = {(r["group"], r["metric"]): r for r in paired_runs.compare(runs, "sync", margin=0.1)}
  iv = lambda x, f: f"{x.mean:{f}} [{x.low:{f}}, {x.high:{f}}]"
  text = open(DOC).read()
  for group, label in (
    ("sync", "sync"),
    ("async", "async, 1 thread"),
    ("async_t4", "async, 4 threads"),
  ):
    cells = [iv(recs[group, "wall_s"]["interval"], ".1f")]
    cells.append(iv(recs[group, "wall_s"]["ratio"], ".3f") if group != "sync" else "")
    cells.append(iv(recs[group, "sampled_tokens"]["interval"], ".0f"))
    cells.append(iv(recs[group, "sampled_tokens"]["ratio"], ".3f") if group != "sync" else "")
    cells.append(iv(recs[group, "final_accuracy"]["interval"], ".3f"))
    assert f"| {label} | " + " | ".join(cells).replace("|  |", "| |") + " |" in text, group
  assert recs["async_t4", "wall_s"]["verdict"] == "worse"  # lower: fewer seconds
  assert recs["async_t4", "final_accuracy"]["verdict"] == "indistinguishable"
  reached = {g: recs[g, "wall_s_to_threshold"]["reached"][0] for g in ("sync", "async", "async_t4")}
  assert reached == {"sync": 0, "async": 1, "async_t4": 1}


def test_the_grid_timeline_prediction_and_its_error():
  steps = _grid_steps()
  seeds = range(8)
  measured = {
    g: np.mean([np.mean([r["step_time_s"] for r in steps[g, s][2:]]) for s in seeds])
    for g in ("async", "async_t4")
  }
  layouts = {
    "async": timeline.Layout("async", 4),
    "async_t4": timeline.Layout("async", 4, False, 4),
  }
  predicted = {
    g: np.mean([timeline.step_time(timeline.from_rows(steps["sync", s]), lay) for s in seeds])
    for g, lay in layouts.items()
  }
  text = open(DOC).read()
  for g, name in (("async", "async (staleness >= 1)"), ("async_t4", "async, 4 batches in flight")):
    line = f"| {name}, shared devices | {predicted[g]:.3f} | {measured[g]:.3f} | "
    assert line + f"{predicted[g] / measured[g] - 1:+.1%} |" in text, g
  dropped = np.mean([steps["async_t4", s][-1]["async_dropped_batches"] for s in seeds])
  assert f"dropped {dropped:.1f} batches on average" in text
