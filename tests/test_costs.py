"""Tests for the run's cost accounting (offpolicy_jax.step.costs)."""

import pytest

from offpolicy_jax.step import costs


def test_a_split_step_costs_its_phases_and_tokens():
  row = {
    "sampled_tokens": 40.0,
    "sampled_prompt_tokens": 12.0,
    "tokens": 80.0,
    "time/sample_s": 0.5,
    "time/reward_s": 0.25,
    "time/train_s": 1.0,
    "episode/env_s": 0.125,
  }
  c = costs.of_row(row)
  assert c == costs.Costs(40.0, 12.0, 80.0, 0.5, 1.0, 0.0, 0.25, 0.125, 0.0)


def test_an_async_step_counts_the_producer_and_the_batches_it_dropped():
  row = {
    "sampled_tokens": 40.0,
    "async_dropped_tokens": 30.0,
    "time/sample_s": 0.5,  # the batch's own sampling: part of the producer's
    "async_sampler_busy_s": 1.5,
    "time/train_s": 1.0,
    "reshard_time_s": 0.25,
  }
  c = costs.of_row(row)
  assert (c.sampled_tokens, c.sampler_busy_s, c.learner_busy_s, c.sync_s) == (70, 1.5, 1, 0.25)


def test_totals_add_up_and_each_side_is_busy_or_idle():
  scanned = costs.of_row({"time/device_s": 2.0, "sampled_tokens": 5.0})
  split = costs.of_row({"time/sample_s": 1.0, "time/train_s": 3.0, "sampled_tokens": 7.0})
  total = costs.add(costs.add(costs.Costs(), scanned), split)
  out = costs.fields(total, wall_s=10.0)
  assert out["cost/sampled_tokens"] == 12.0
  assert out["time/run_device_busy_s"] == 2.0
  # A fused step's device time is busy time of both sides.
  assert out["time/run_sampler_idle_s"] == 10.0 - 1.0 - 2.0
  assert out["time/run_learner_idle_s"] == 10.0 - 3.0 - 2.0
  for side in ("sampler", "learner"):
    busy = out[f"time/run_{side}_busy_s"] + out["time/run_device_busy_s"]
    assert busy + out[f"time/run_{side}_idle_s"] == pytest.approx(10.0)
  assert "time/run_sampler_idle_s" not in costs.fields(total, wall_s=None)


def test_the_checkpoint_record_round_trips_and_a_bad_one_is_refused():
  total = costs.Costs(sampled_tokens=3.0, learner_busy_s=1.5)
  assert costs.from_meta(costs.to_meta(total)) == total
  assert costs.from_meta(None) is None  # a checkpoint from before cost accounting
  with pytest.raises(ValueError, match="unknown totals \\['sampled_tokenz'\\]"):
    costs.from_meta({"sampled_tokenz": 1.0})
  full = costs.to_meta(total)
  for bad in ("1", float("nan"), -1.0, True):
    with pytest.raises(ValueError, match="\\['sync_s'\\] are not finite numbers >= 0"):
      costs.from_meta({**full, "sync_s": bad})
  with pytest.raises(ValueError, match="totals \\['sampled_tokens'\\] are missing"):
    costs.from_meta({k: v for k, v in full.items() if k != "sampled_tokens"})
  with pytest.raises(ValueError, match="not a record of totals \\(str\\)"):
    costs.from_meta("oops")
