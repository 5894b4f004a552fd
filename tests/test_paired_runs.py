"""Paired comparisons of a sweep's seeded runs (`study.paired_runs`, `experiments.compare`)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from offpolicy_jax import errors
from offpolicy_jax.study import paired_runs, stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(path, accuracy, step_s, tokens_per_step, steps=4, eval_every=2):
  """A run's metrics.jsonl: `steps` training rows and evaluations at 0, 2, 4."""
  os.makedirs(path)
  rows = [{"step": 0, "eval/accuracy": accuracy[0]}]
  for t in range(1, steps + 1):
    rows.append(
      {
        "step": t,
        "loss": 0.1,
        "time/run_wall_s": 10.0 + step_s * t,  # 10 s of start-up before the first step
        "cost/sampled_tokens": tokens_per_step * t,
      }
    )
    if t % eval_every == 0:
      rows.append({"step": t, "eval/accuracy": accuracy[t // eval_every]})
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def _sweep(tmp_path, seeds=4):
  """`sync` takes 1 s a step and learns at step 4; `fast` takes 0.25 s and learns at step 2
  (one seed of it never learns); `fast` samples the same tokens per step."""
  for s in range(seeds):
    _write_run(tmp_path / f"sync-s{s}", [0.5, 0.55, 0.7 + 0.01 * s], 1.0, 100)
    late = s == 3
    acc = [0.5, 0.5, 0.52] if late else [0.5, 0.65 + 0.01 * s, 0.7 + 0.01 * s]
    _write_run(tmp_path / f"fast-s{s}", acc, 0.25, 100)
  return str(tmp_path)


def test_a_runs_values_count_seconds_and_tokens_to_the_threshold(tmp_path):
  _write_run(tmp_path / "a-s0", [0.5, 0.65, 0.7], 0.5, 10)
  v = paired_runs.run_values(str(tmp_path / "a-s0"))
  assert v["final_accuracy"] == 0.7 and v["steps_to_threshold"] == 2 and v["threshold_reached"] == 1
  # Wall clock from the end of step 1: one more step of 0.5 s (the start-up is not counted).
  assert v["wall_s_to_threshold"] == pytest.approx(0.5)
  assert v["tokens_to_threshold"] == 20 and v["wall_s"] == pytest.approx(1.5)
  assert v["sampled_tokens"] == 40
  _write_run(tmp_path / "b-s0", [0.5, 0.5, 0.55], 0.5, 10)  # never reaches 0.6: censored
  v = paired_runs.run_values(str(tmp_path / "b-s0"))
  assert (v["steps_to_threshold"], v["threshold_reached"], v["tokens_to_threshold"]) == (4, 0, 40)


def test_groups_are_compared_with_the_baseline_seed_by_seed(tmp_path):
  runs = paired_runs.read_runs(_sweep(tmp_path))
  assert set(runs) == {"sync", "fast"} and sorted(runs["fast"]) == [0, 1, 2, 3]
  records = paired_runs.compare(runs, "sync", margin=0.05)
  rec = {(r["group"], r["metric"]): r for r in records}
  time = rec["fast", "wall_s_to_threshold"]
  # Per seed: 0.25 s against 3 s for the three that learnt, 0.75 s (censored) against 3 s.
  want = [0.25 / 3, 0.25 / 3, 0.25 / 3, 0.75 / 3]
  assert time["ratio"].mean == pytest.approx(math.exp(np.mean(np.log(want))))
  assert time["reached"] == (3, 4) and time["comparison"].diff.mean == pytest.approx(-2.625)
  total = rec["fast", "wall_s"]["ratio"]
  assert total.mean == pytest.approx(0.25) and total.low == pytest.approx(0.25)
  assert rec["fast", "sampled_tokens"]["comparison"].diff.mean == 0
  acc = rec["fast", "final_accuracy"]
  assert acc["comparison"].diff.mean == pytest.approx((0 + 0 + 0 - 0.21) / 4)
  assert acc["verdict"] in (stats.SAME, stats.EQUIVALENT, stats.WORSE)
  assert "comparison" not in rec["sync", "final_accuracy"]
  with pytest.raises(ValueError, match="baseline: no group 'nope'"):
    paired_runs.compare(runs, "nope")


def test_the_binary_writes_the_report_the_table_and_the_pareto_plot(tmp_path):
  sweep = _sweep(tmp_path)
  cmd = [sys.executable, "-m", "experiments.compare", f"--workdir={sweep}", "--baseline=sync"]
  out = subprocess.run([*cmd, "--margin=0.05"], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  for name in ("compare.md", "compare.csv", "pareto.png"):
    assert os.path.getsize(os.path.join(sweep, name)) > 0
  md = open(os.path.join(sweep, "compare.md")).read()
  assert "## wall_s_to_threshold" in md and "| fast | 0.375 [" in md and "(3/4)" in md
  csv_rows = open(os.path.join(sweep, "compare.csv")).read().splitlines()
  assert csv_rows[0] == "group,seed,metric,value" and len(csv_rows) == 1 + 8 * 7
  bad = subprocess.run([*cmd[:-1], "--baseline=nope"], cwd=ROOT, capture_output=True, text=True)
  assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(
    "error: baseline: no group 'nope'"
  )
  empty = str(tmp_path / "empty")
  os.makedirs(empty)
  bad = subprocess.run(
    [*cmd[:3], f"--workdir={empty}", "--baseline=sync"], cwd=ROOT, capture_output=True, text=True
  )
  assert bad.returncode != 0 and "no run named <group>-s<seed>" in bad.stderr


def test_a_run_without_the_warm_start_evaluation_is_named(tmp_path):
  _write_run(tmp_path / "a-s0", [0.5, 0.6, 0.7], 0.5, 10)
  path = tmp_path / "a-s0" / "metrics.jsonl"
  rows = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] != 0]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(errors.WorkdirError, match=r"a-s0: evaluations at steps \[2, 4\]"):
    paired_runs.read_runs(str(tmp_path))


def test_the_pareto_front_keeps_the_groups_nothing_beats_on_both_axes():
  points = {"a": (1.0, 0.5), "b": (2.0, 0.7), "c": (2.0, 0.6), "d": (3.0, 0.7), "e": (0.5, 0.4)}
  assert paired_runs.pareto_front(points) == ["e", "a", "b"]


def test_the_csv_reads_back_the_values_it_was_written_from(tmp_path):
  sweep = _sweep(tmp_path)
  paired_runs.write(sweep, "sync")
  assert paired_runs.read_csv(os.path.join(sweep, "compare.csv")) == paired_runs.read_runs(sweep)
