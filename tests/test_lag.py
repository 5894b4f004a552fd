"""Tests for the lag schedule, snapshot store and bounded-staleness sampler."""

import contextlib
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import lag
from offpolicy_jax.step import producer
from offpolicy_jax.types import TrainBatch

SCHEDULES = [(1, 0), (1, 3), (4, 0), (3, 2), (10**9, 0)]


def _reference_version(t, m, n):
  # Independent reference: simulate syncs. The sampler holds version 0 until the
  # trainer has done n steps of lag; thereafter it re-syncs every m steps.
  held = 0
  for s in range(1, t + 1):
    if s > n and (s - n - 1) % m == 0:
      held = s - n - 1
  return held


@pytest.mark.parametrize("m,n", SCHEDULES)
def test_behavior_version_matches_simulation(m, n):
  for t in range(1, 40):
    v = lag.behavior_version(t, m, n)
    assert v == _reference_version(t, m, n)
    assert lag.staleness(t, m, n) == t - 1 - v
    assert 0 <= v <= t - 1


def test_schedule_shapes():
  assert [lag.staleness(t, 1, 0) for t in range(1, 6)] == [0] * 5
  assert [lag.staleness(t, 1, 3) for t in range(1, 8)] == [0, 1, 2, 3, 3, 3, 3]
  assert [lag.staleness(t, 4, 0) for t in range(1, 10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
  assert [lag.behavior_version(t, 3, 2) for t in range(1, 10)] == [0, 0, 0, 0, 0, 3, 3, 3, 6]
  assert all(lag.behavior_version(t, 10**9, 0) == 0 for t in range(1, 50))


@pytest.mark.parametrize("m,n", SCHEDULES[:4])
def test_snapshot_capacity_covers_schedule(m, n):
  cap = lag.snapshot_capacity(m, n)
  for t in range(1, 40):
    needed = {lag.behavior_version(s, m, n) for s in range(t, t + 60)}
    held = {v for v in needed if v <= t - 1}
    assert len(held) <= cap


@pytest.mark.parametrize(
  "kwargs,field",
  [
    (dict(step=0, sync_interval=1, sync_offset=0), "step"),
    (dict(step=1, sync_interval=0, sync_offset=0), "sync_interval"),
    (dict(step=1, sync_interval=1, sync_offset=-1), "sync_offset"),
  ],
)
def test_bad_schedule_names_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    lag.behavior_version(**kwargs)


def test_snapshot_store_ring_and_get():
  params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
  store = lag.snapshot_init(params, capacity=3, version=0)
  for v in range(1, 5):
    store = lag.snapshot_update(store, jax.tree.map(lambda x, v=v: x + v, params), v)
  assert sorted(np.asarray(store.versions).tolist()) == [2, 3, 4]
  for v in (2, 3, 4):
    got, found = lag.snapshot_get(store, v)
    assert bool(found)
    np.testing.assert_array_equal(got["w"], np.full((2, 3), v))
  _, found = lag.snapshot_get(store, 1)
  assert not bool(found)
  # Re-storing an existing version overwrites in place.
  store = lag.snapshot_update(store, jax.tree.map(lambda x: x + 9, params), 3)
  got, _ = lag.snapshot_get(store, 3)
  np.testing.assert_array_equal(got["b"], np.full(3, 9))
  assert sorted(np.asarray(store.versions).tolist()) == [2, 3, 4]


def _batch(version, rows=2, n=3):
  mask = np.ones((rows, n), np.float32)
  mask[1, 2] = 0
  return TrainBatch(
    prompt_tokens=jnp.zeros((rows, 2), jnp.int32),
    prompt_mask=jnp.ones((rows, 2)),
    tokens=jnp.zeros((rows, n), jnp.int32),
    mask=jnp.asarray(mask),
    behavior_logp=jnp.zeros((rows, n)),
    advantages=jnp.zeros(rows),
    rewards=jnp.zeros(rows),
    versions=jnp.full((rows, n), version, jnp.int32),
    weights=jnp.ones(rows),
    behavior_kept=jnp.zeros((rows, n), jnp.int32),
    old_logp=jnp.zeros((rows, n)),
  )


def test_row_staleness_and_weights():
  versions = jnp.array([[3, 4, 9], [1, 5, 5]])
  mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
  np.testing.assert_array_equal(lag.row_staleness(versions, mask, 6), [3, 1])
  np.testing.assert_array_equal(lag.staleness_weights(versions, mask, 6, 2, 0.5), [0.5, 1.0])


def test_async_sampler_drop_counts_stale_batches():
  calls = []
  gate = threading.Event()

  def sample_fn(params, version):
    calls.append(version)
    if len(calls) > 3:
      gate.wait(5)
    return _batch(version)

  sampler = producer.SamplerThread(sample_fn, None, 0, max_staleness=1, queue_size=2)
  try:
    assert int(sampler.get(current_version=0).versions[0, 0]) == 0
    # Trainer jumps ahead: queued version-0 batches are now too stale and dropped.
    deadline = time.monotonic() + 30
    while sampler.stats["produced"] < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
    sampler.publish(None, 5)
    gate.set()
    batch = sampler.get(current_version=5)
    assert int(batch.versions[0, 0]) == 5
    assert sampler.stats["dropped_batches"] >= 1
  finally:
    sampler.close()


def test_async_sampler_threads_keep_batches_in_flight_at_once():
  """`threads=3`: three batches are sampled at once (a barrier that needs all three passes),
  each thread inside its own context, and busy seconds count the time any was sampling."""
  barrier, entered, calls = threading.Barrier(3, timeout=20), [], itertools.count()

  @contextlib.contextmanager
  def context(i):
    entered.append(i)
    yield

  def sample_fn(params, version):
    if next(calls) < 3:  # one thread alone would wait here until the barrier breaks
      barrier.wait()
    return _batch(version)

  begin = time.perf_counter()
  sampler = producer.SamplerThread(
    sample_fn, None, 0, max_staleness=0, threads=3, thread_context=context, queue_size=4
  )
  try:
    batches = [sampler.get(current_version=0, timeout=30) for _ in range(6)]
    wall = time.perf_counter() - begin
    assert len(batches) == 6 and sorted(entered) == [0, 1, 2]
    assert not barrier.broken
    assert 0 < sampler.stats["busy_s"] <= wall
  finally:
    sampler.close()
  with pytest.raises(ValueError, match="threads must be >= 1"):
    producer.SamplerThread(sample_fn, None, 0, max_staleness=0, threads=0)


def test_async_sampler_weight_mode():
  sampler = producer.SamplerThread(
    lambda p, v: _batch(0), None, 0, max_staleness=2, mode="weight", stale_weight=0.25
  )
  try:
    batch = sampler.get(current_version=3)
    np.testing.assert_allclose(batch.weights, [0.25, 0.25])
    assert sampler.stats["downweighted_rows"] == 2
    batch = sampler.get(current_version=2)
    np.testing.assert_allclose(batch.weights, [1.0, 1.0])
  finally:
    sampler.close()


def test_async_sampler_surfaces_errors():
  def bad(params, version):
    raise RuntimeError("boom")

  sampler = producer.SamplerThread(bad, None, 0, max_staleness=0)
  try:
    with pytest.raises(RuntimeError, match="thread failed"):
      sampler.get(current_version=0, timeout=5)
  finally:
    sampler.close()
