"""Tests for the timeline model of a step (offpolicy_jax.timeline)."""

import pytest

from offpolicy_jax import timeline
from offpolicy_jax.timeline import Layout, PhaseCosts

# Sample 1.0 s of which 0.75 s waiting on environments, rewards 0.5, train 2.0, sync 0.25,
# host 0.125 (binary fractions: the sums below are exact).
COSTS = PhaseCosts(sample_s=1.0, train_s=2.0, env_s=0.75, reward_s=0.5, sync_s=0.25, host_s=0.125)


@pytest.mark.parametrize(
  "layout,want",
  [
    (Layout("sync"), 1.0 + 0.5 + 2.0 + 0.125),
    (Layout("sync", 0, True), 1.0 + 0.5 + 2.0 + 0.25 + 0.125),
    # Shared devices: the device runs its 0.25 s of sampling and the 2 s of learning in turn;
    # the environments and the rewards (1.5 s) overlap with them.
    (Layout("async", 1), max(0.25 + 2.0, 1.0 + 0.5) + 0.125),
    (Layout("async", 4, True), max(1.0 + 0.5, 2.0 + 0.25) + 0.125),
    (Layout("async", 0), 1.0 + 0.5 + 2.0 + 0.125),  # no staleness allowed: nothing overlaps
    # Four batches in flight: each batch's 1.5 s of sampling and rewards overlap the others';
    # the devices still run the sampling and the learning in turn (0.25 + 2.0).
    (Layout("async", 4, False, 4), max(0.25 + 2.0, (1.0 + 0.5) / 4) + 0.125),
    (Layout("async", 4, True, 4), max(0.25, (1.0 + 0.5) / 4, 2.0 + 0.25) + 0.125),
  ],
)
def test_step_time_by_hand(layout, want):
  assert timeline.step_time(COSTS, layout) == want


def test_the_slower_side_sets_an_async_pipeline_and_scaling_moves_it():
  sampler_bound = COSTS._replace(sample_s=5.0, env_s=0.0)
  own = Layout("async", 1, True)
  assert timeline.step_time(sampler_bound, own) == 5.5 + 0.125
  # Twice the sampler's devices halve its device work; environments do not scale.
  doubled = timeline.scaled(sampler_bound, sampler_factor=2.0, learner_factor=1.0)
  assert doubled.sample_s == 2.5 and doubled.train_s == 2.0
  assert timeline.scaled(COSTS, 2.0, 4.0) == COSTS._replace(sample_s=0.875, train_s=0.5)
  # Asynchrony never predicts a slower step than sync on the same devices.
  for costs in (COSTS, sampler_bound, doubled):
    for own_devices in (False, True):
      sync = timeline.step_time(costs, Layout("sync", 0, own_devices))
      assert timeline.step_time(costs, Layout("async", 2, own_devices)) <= sync
  rows = timeline.table(COSTS, {"sync": Layout("sync"), "async": Layout("async", 1)})
  assert rows[0] == ("sync", 3.625, 1.0) and rows[1][2] == pytest.approx(3.625 / 2.375)


def _rows(n: int, **fields):
  return [{"step": i + 1, "step_time_s": 9.0, **fields} for i in range(n)]


def test_costs_from_a_runs_rows_skip_compilation():
  rows = _rows(2, **{"time/sample_s": 100.0}) + _rows(
    4,
    **{
      "time/sample_s": 1.0,
      "time/train_s": 2.0,
      "episode/env_s": 0.75,
      "time/reward_s": 0.5,
      "reshard_time_s": 0.25,
      "time/other_s": 0.125,
    },
  )
  rows.append({"step": 6, "eval/accuracy": 0.5})  # an eval row: not a step
  assert timeline.from_rows(rows) == COSTS
  with pytest.raises(ValueError, match="no training rows after the first 2"):
    timeline.from_rows(rows[:2])
  with pytest.raises(ValueError, match="only time/device_s"):
    timeline.from_rows(_rows(4, **{"time/device_s": 1.0}))


@pytest.mark.parametrize(
  "costs,layout,match",
  [
    (COSTS._replace(train_s=-1.0), Layout(), "train_s must be a finite number"),
    (COSTS._replace(sync_s=float("nan")), Layout(), "sync_s must be a finite number"),
    (COSTS._replace(env_s=2.0), Layout(), "env_s .* is part of sample_s"),
    (COSTS, Layout("sometimes"), "mode must be 'sync' or 'async'"),
    (COSTS, Layout("async", -1), "max_staleness must be an int >= 0"),
    (COSTS, Layout("async", 0.5), "max_staleness must be an int >= 0"),  # type: ignore[arg-type]
    (COSTS, Layout("async", 1, "no"), "own_sampler_devices must be True or False"),  # type: ignore[arg-type]
    (COSTS._replace(train_s="2"), Layout(), "train_s must be a finite number"),  # type: ignore[arg-type]
    (COSTS, Layout("async", 4, False, 0), "inflight must be an int >= 1"),
    (COSTS, Layout("sync", 0, False, 2), "2 batches in flight need mode 'async'"),
  ],
)
def test_bad_input_is_refused_naming_the_field(costs, layout, match):
  with pytest.raises(ValueError, match=match):
    timeline.step_time(costs, layout)


def test_the_report_prints_each_layout():
  costs = PhaseCosts(sample_s=1.0, train_s=1.0)
  text = timeline.report(costs)
  lines = {line[:46].strip(): line[46:].split() for line in text.splitlines()[2:]}
  assert lines["sync, shared devices"] == ["2", "1.00x"]
  assert lines["async (staleness >= 1), own sampler devices"] == ["1", "2.00x"]
  # Sampling bound by its environments: four batches in flight divide it by four.
  waits = PhaseCosts(sample_s=4.0, train_s=0.5, env_s=3.8)
  lines = {line[:46].strip(): line[46:].split() for line in timeline.report(waits).splitlines()[2:]}
  assert lines["async, 4 batches in flight, shared devices"] == ["1", "4.50x"]
  with pytest.raises(ValueError, match="sampler_factor must be a finite number > 0"):
    timeline.report(costs, sampler_factor=0.0)
