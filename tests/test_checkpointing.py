"""Tests for offpolicy_jax.checkpointing: round trips, keep-last-N, torn saves, JSON meta."""

import os
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

from offpolicy_jax import checkpointing


class _Buf(NamedTuple):
  tokens: jax.Array
  ptr: jax.Array


def _state(scale):
  params = {"w": jnp.full((3, 4), scale, jnp.float32), "b": jnp.arange(4.0) * scale}
  return {
    "params": params,
    "opt": optax.adamw(1e-3).init(params),
    "buffer": _Buf(jnp.arange(6, dtype=jnp.int32).reshape(2, 3) * int(scale), jnp.int32(scale)),
    "key": jax.random.key(int(scale)),
  }


def _assert_equal(a, b):
  kd = lambda t: jax.tree.map(
    lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
    t,
  )
  chex.assert_trees_all_equal(kd(a), kd(b))


def test_round_trip_latest_and_keep_last_n(tmp_path):
  ck = checkpointing.Checkpointer(str(tmp_path), max_to_keep=2)
  for step in (1, 2, 3):
    ck.save(step, _state(step), {"step": step, "data_state": b"\x00it", "nested": {"a": [1]}})
  ck.wait()
  assert ck.all_steps() == [2, 3]
  assert ck.latest_step() == 3
  restored, meta = ck.restore(_state(0))
  _assert_equal(restored, _state(3))
  assert isinstance(restored["buffer"], _Buf)
  assert meta == {"step": 3, "data_state": b"\x00it", "nested": {"a": [1]}}
  older, meta2 = ck.restore(_state(0), step=2)
  _assert_equal(older, _state(2))
  assert ck.restore_meta(2)["step"] == 2
  ck.close()


def test_reopen_and_torn_save_is_ignored(tmp_path):
  ck = checkpointing.Checkpointer(str(tmp_path), async_save=False)
  ck.save(5, _state(5), {"step": 5})
  ck.close()
  # A save killed half-way leaves only a temporary directory behind.
  os.makedirs(tmp_path / "6.orbax-checkpoint-tmp-123" / "arrays")
  ck = checkpointing.Checkpointer(str(tmp_path))
  assert ck.latest_step() == 5
  restored, _ = ck.restore(_state(0))
  _assert_equal(restored, _state(5))
  ck.close()


def test_missing_checkpoint_raises(tmp_path):
  ck = checkpointing.Checkpointer(str(tmp_path))
  assert ck.latest_step() is None
  with pytest.raises(FileNotFoundError):
    ck.restore(_state(0))
  ck.close()
