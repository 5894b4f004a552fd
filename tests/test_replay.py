"""Tests for the device-resident replay ring buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax.learn import replay
from offpolicy_jax.scale import sharding
from offpolicy_jax.types import TrainBatch

K = 2  # rows per group
N = 3  # response length


def _groups(ids, version=0, reward=None):
  """A TrainBatch of len(ids) groups; every token of group i holds id i."""
  ids = np.asarray(ids, np.int32)
  rows = np.repeat(ids, K)
  b = rows.shape[0]
  rewards = rows.astype(np.float32) if reward is None else np.repeat(reward, K).astype(np.float32)
  return TrainBatch(
    prompt_tokens=np.tile(rows[:, None], (1, 2)),
    prompt_mask=np.ones((b, 2), np.float32),
    tokens=np.tile(rows[:, None], (1, N)),
    mask=np.ones((b, N), np.float32),
    behavior_logp=np.zeros((b, N), np.float32),
    advantages=np.zeros(b, np.float32),
    rewards=rewards,
    versions=np.full((b, N), version, np.int32),
    weights=np.ones(b, np.float32),
    behavior_kept=np.zeros((b, N), np.int32),
    old_logp=np.zeros((b, N), np.float32),
  )


def _ids(batch):
  t = np.asarray(batch.tokens)[::K, 0]
  return t.tolist()


def _put(x):
  return jax.device_put(x)


@pytest.fixture(scope="module")
def key():
  return jax.device_put(jax.random.key(0))


def test_fifo_order_and_one_pass(key):
  state = replay.init(4, _groups([0, 0]), K)
  state = replay.add(state, _put(_groups([1, 2])))
  state = replay.add(state, _put(_groups([3, 4])))
  state, batch, info = replay.sample(state, key, 2, "fifo", max_reuse=1)
  assert _ids(batch) == [1, 2]
  assert int(info.num_selected) == 2 and int(info.num_retired) == 2
  state, batch, info = replay.sample(state, key, 2, "fifo", max_reuse=1)
  assert _ids(batch) == [3, 4]
  assert int(info.size) == 0
  # Empty buffer: filler rows carry zero weight.
  state, batch, info = replay.sample(state, key, 2, "fifo", max_reuse=1)
  assert int(info.num_selected) == 0
  np.testing.assert_array_equal(batch.weights, np.zeros(2 * K))


def test_wrap_around_overwrites_oldest(key):
  state = replay.init(3, _groups([0]), K)
  for i in range(1, 6):
    state = replay.add(state, _put(_groups([i])))
  assert int(state.ptr) == 5 % 3 and int(state.num_added) == 5
  assert sorted(np.asarray(state.data.tokens)[:, 0, 0].tolist()) == [3, 4, 5]
  state, batch, _ = replay.sample(state, key, 3, "fifo", max_reuse=1)
  assert _ids(batch) == [3, 4, 5]


def test_add_keeps_only_the_kept_groups_in_order_across_the_wrap(key):
  state = replay.init(4, _groups([0, 0]), K)
  state = replay.add(state, _put(_groups([1, 2, 3])))
  state = replay.add(state, _put(_groups([4, 5, 6, 7])), jnp.array([False, True, False, True]))
  # 5 and 7 take slots 3 and 0 (the wrap); slots 1 and 2 keep 2 and 3; nothing else moves.
  assert int(state.ptr) == 1 and int(state.num_added) == 5
  assert np.asarray(state.data.tokens)[:, 0, 0].tolist() == [7, 2, 3, 5]
  state, batch, _ = replay.sample(state, key, 4, "fifo", max_reuse=1)
  assert _ids(batch) == [2, 3, 5, 7]
  state = replay.add(state, _put(_groups([8, 9])), jnp.array([False, False]))
  assert int(state.ptr) == 1 and int(state.num_added) == 5


def test_only_valid_slots_sampled(key):
  state = replay.init(8, _groups([0]), K)
  state = replay.add(state, _put(_groups([7, 8, 9])))
  for policy in replay.POLICIES:
    s = jax.tree.map(jnp.copy, state)
    s, batch, info = replay.sample(s, key, 5, policy, max_reuse=None)
    w = np.asarray(batch.weights)[::K]
    ids = np.asarray(_ids(batch))
    assert int(info.num_selected) == 3
    assert sorted(ids[w > 0].tolist()) == [7, 8, 9], policy
    assert np.all(w[3:] == 0)


def test_reuse_counts_and_limit(key):
  state = replay.init(4, _groups([0]), K)
  state = replay.add(state, _put(_groups([1, 2])))
  seen = []
  for i in range(3):
    state, batch, info = replay.sample(state, jax.random.fold_in(key, i), 2, "uniform", max_reuse=2)
    seen.append(int(info.num_selected))
  assert seen == [2, 2, 0]
  np.testing.assert_array_equal(np.asarray(state.reuse)[:2], [2, 2])
  assert int(info.size) == 0


def test_staleness_eviction_and_info(key):
  state = replay.init(4, _groups([0]), K)
  state = replay.add(state, _put(_groups([1], version=0)))
  state = replay.add(state, _put(_groups([2], version=3)))
  state = replay.add(state, _put(_groups([3], version=5)))
  state, batch, info = replay.sample(
    state, key, 2, "fifo", max_reuse=None, current_version=_put(jnp.int32(6)), max_staleness=3
  )
  assert _ids(batch) == [2, 3]
  assert int(info.num_evicted) == 1
  assert int(info.staleness_max) == 3
  assert float(info.staleness_mean) == pytest.approx(2.0)
  assert not bool(state.valid[0])


def test_weighted_policies_prefer(key):
  # Reward policy with a low temperature picks the high-reward groups.
  state = replay.init(6, _groups([0]), K)
  state = replay.add(state, _put(_groups([1, 2, 3, 4, 5, 6], reward=[0, 0, 0, 0, 1, 1])))
  _, batch, _ = replay.sample(state, key, 2, "reward", max_reuse=None, temperature=0.01)
  assert sorted(_ids(batch)) == [5, 6]
  state = replay.init(6, _groups([0]), K)
  for i, v in enumerate([0, 0, 9, 0, 9, 0]):
    state = replay.add(state, _put(_groups([i + 1], version=v)))
  _, batch, _ = replay.sample(
    state, key, 2, "staleness", max_reuse=None, current_version=jnp.int32(9), temperature=0.01
  )
  assert sorted(_ids(batch)) == [3, 5]


def test_add_and_sample_under_transfer_guard(key):
  state = replay.init(4, _groups([0, 0]), K)
  batch = _put(_groups([1, 2], version=1))
  version = _put(jnp.int32(2))
  # Warm up (compile) outside the guard, then run with transfers disallowed.
  state = replay.add(state, jax.tree.map(jnp.copy, batch))
  state, _, _ = replay.sample(state, key, 2, "staleness", max_reuse=2, current_version=version)
  with jax.transfer_guard("disallow"):
    state = replay.add(state, batch)
    state, out, info = replay.sample(
      state, key, 2, "staleness", max_reuse=2, current_version=version, max_staleness=4
    )
  assert _ids(out) is not None and int(info.num_selected) == 2


def test_bad_args_name_field(key):
  state = replay.init(2, _groups([0]), K)
  with pytest.raises(ValueError, match="policy"):
    replay.sample(state, key, 1, "lifo")
  with pytest.raises(ValueError, match="batch_size"):
    replay.sample(state, key, 3)
  with pytest.raises(ValueError, match="group_size"):
    replay.init(2, _groups([0]), 3)
  with pytest.raises(ValueError, match="capacity"):
    replay.add(state, _groups([1, 2, 3]))


def test_sharded_buffer_matches_single_device(key):
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2)
  state = replay.shard(replay.init(8, _groups([0]), K), mesh)
  assert state.data.tokens.sharding.spec[0] == ("data", "fsdp")
  state = replay.add(state, sharding.shard_batch(_groups([1, 2, 3, 4]), mesh))
  state, batch, _ = replay.sample(state, key, 4, "fifo")
  assert _ids(batch) == [1, 2, 3, 4]


def test_same_result_without_jit(key):
  def run():
    state = replay.init(4, _groups([0]), K)
    state = replay.add(state, _put(_groups([1, 2, 3], version=2)))
    return replay.sample(state, key, 2, "uniform", max_reuse=1, current_version=jnp.int32(3))

  _, jit_batch, jit_info = run()
  with jax.disable_jit():
    _, batch, info = run()
  jax.tree.map(np.testing.assert_array_equal, batch, jit_batch)
  jax.tree.map(np.testing.assert_array_equal, info, jit_info)
