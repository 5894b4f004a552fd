"""Tests for offpolicy_jax.checkpointing: round trips, keep-last-N, torn saves, JSON meta."""

import json
import logging
import os
import time
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


# Integrity: manifests of digests, verified restore with fallback.


def _big(scale):
  """`_state` plus a random leaf large enough for orbax to store it out of line."""
  return {**_state(scale), "big": jax.random.normal(jax.random.key(scale), (128, 512))}


def _saved(path, steps=(1, 2), **kwargs):
  ck = checkpointing.Checkpointer(str(path), **kwargs)
  for step in steps:
    ck.save(step, _big(step), {"step": step})
  ck.close()
  return checkpointing.Checkpointer(str(path), **kwargs)


def _data_file(step_dir):
  """The largest file of the `arrays` item: array bytes, which orbax does not checksum."""
  files = [os.path.join(r, n) for r, _, names in os.walk(step_dir / "arrays") for n in names]
  return max(files, key=os.path.getsize)


def _garble(path):
  """Flips bytes in the middle of `path` in place; the size stays the same."""
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.seek(size // 2)
    chunk = f.read(64)
    f.seek(size // 2)
    f.write(bytes(b ^ 0x5A for b in chunk))
  assert os.path.getsize(path) == size


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_async_save_then_close_leaves_a_manifest_per_step(tmp_path):
  ck = _saved(tmp_path, steps=(1, 2, 3), max_to_keep=3)
  for step in (1, 2, 3):
    manifest = json.loads((tmp_path / str(step) / "_MANIFEST.json").read_text())
    on_disk = {
      os.path.relpath(os.path.join(r, n), tmp_path / str(step))
      for r, _, names in os.walk(tmp_path / str(step))
      for n in names
    }
    assert set(manifest["files"]) == on_disk - {"_MANIFEST.json"}
    assert ck.verify(step) is None
  ck.close()


def test_async_manifest_is_written_without_waiting(tmp_path):
  # A run killed between two saves still leaves its latest step verified.
  ck = checkpointing.Checkpointer(str(tmp_path))
  ck.save(1, _state(1), {"step": 1})
  manifest = tmp_path / "1" / "_MANIFEST.json"
  deadline = time.monotonic() + 10
  while not manifest.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert manifest.exists()
  ck.close()


def test_keep_last_n_with_manifests(tmp_path):
  ck = checkpointing.Checkpointer(str(tmp_path), max_to_keep=2)
  for step in (1, 2, 3, 4):
    ck.save(step, _state(step), {"step": step})
  ck.close()
  ck = checkpointing.Checkpointer(str(tmp_path), max_to_keep=2)
  assert ck.all_steps() == [3, 4]
  assert not (tmp_path / "1").exists() and not (tmp_path / "2").exists()
  assert ck.verify(3) is None and ck.verify(4) is None
  ck.close()


def test_truncated_latest_falls_back_and_run_goes_on(tmp_path, caplog):
  ck = _saved(tmp_path, max_to_keep=2)
  _truncate(_data_file(tmp_path / "2"))
  with caplog.at_level(logging.WARNING):
    arrays, meta, step = ck.restore_latest(_big(0))
  assert (step, meta) == (1, {"step": 1})
  _assert_equal(arrays, _big(1))
  first = _warnings(caplog)[0]
  assert first.startswith("checkpoint step 2 is corrupt (size mismatch in arrays/")
  assert first.endswith("; falling back to step 1") and "\n" not in first
  # Set aside, not deleted; the run can save step 2 again and keep-last-N
  # drops the intact step 1 only once newer steps exist.
  assert (tmp_path / "corrupt" / "2" / "arrays").is_dir()
  assert ck.all_steps() == [1]
  ck.save(2, _big(2), {"step": 2})
  ck.wait()
  assert ck.all_steps() == [1, 2]
  ck.save(3, _big(3), {"step": 3})
  ck.close()
  ck = checkpointing.Checkpointer(str(tmp_path), max_to_keep=2)
  arrays, _, step = ck.restore_latest(_big(0))
  assert step == 3 and ck.all_steps() == [2, 3]
  _assert_equal(arrays, _big(3))
  ck.close()


def test_same_size_garbage_is_detected(tmp_path, caplog):
  ck = _saved(tmp_path)
  path = _data_file(tmp_path / "2")
  _garble(path)
  rel = os.path.relpath(path, tmp_path / "2")
  assert ck.verify(2) == f"digest mismatch in {rel}"
  with pytest.raises(checkpointing.CheckpointError, match="step 2 is corrupt"):
    ck.restore(_big(0), step=2)
  with caplog.at_level(logging.WARNING):
    arrays, _, step = ck.restore_latest(_big(0))
  assert step == 1
  _assert_equal(arrays, _big(1))
  assert _warnings(caplog)[0] == (
    f"checkpoint step 2 is corrupt (digest mismatch in {rel}); falling back to step 1"
  )
  ck.close()


def test_every_step_corrupt_raises_one_line_error(tmp_path):
  ck = _saved(tmp_path)
  _truncate(_data_file(tmp_path / "2"))
  _garble(_data_file(tmp_path / "1"))
  with pytest.raises(checkpointing.CheckpointError) as err:
    ck.restore_latest(_big(0))
  message = str(err.value)
  assert "\n" not in message
  assert "step 2: size mismatch in arrays/" in message
  assert "step 1: digest mismatch in arrays/" in message
  assert [step for step, _ in err.value.failures] == [2, 1]
  assert ck.all_steps() == [1, 2] and not (tmp_path / "corrupt").exists()
  ck.close()


def test_step_without_manifest_restores_unverified(tmp_path, caplog):
  # A run killed between orbax's commit and the manifest write.
  ck = _saved(tmp_path)
  os.remove(tmp_path / "2" / "_MANIFEST.json")
  (tmp_path / "2" / "_MANIFEST.json.tmp").write_text('{"files": ')  # killed mid-write
  assert ck.verify(2) == "no manifest"
  with caplog.at_level(logging.WARNING):
    arrays, _, step = ck.restore_latest(_big(0))
  assert step == 2
  _assert_equal(arrays, _big(2))
  assert "checkpoint step 2 has no manifest" in _warnings(caplog)[0]
  ck.close()


def test_unverified_step_that_fails_to_restore_falls_back_quietly(tmp_path, caplog):
  _saved(tmp_path).close()
  os.remove(tmp_path / "2" / "_MANIFEST.json")
  (tmp_path / "2" / "arrays" / "_METADATA").write_text('{"tree_metadata": ')
  (tmp_path / "2" / "_CHECKPOINT_METADATA").write_text("{")  # orbax logs an ERROR on opening
  with caplog.at_level(logging.WARNING):
    ck = checkpointing.Checkpointer(str(tmp_path))
    arrays, _, step = ck.restore_latest(_big(0))
  assert step == 1
  _assert_equal(arrays, _big(1))
  messages = _warnings(caplog)
  assert messages[1].startswith("checkpoint step 2 is corrupt (unverified, restore raised ")
  assert messages[1].endswith("; falling back to step 1") and "\n" not in messages[1]
  assert all(r.name.startswith("offpolicy_jax") for r in caplog.records if r.levelno >= 30)
  ck.close()


def test_restore_meta_checks_only_the_meta_files(tmp_path):
  ck = _saved(tmp_path)
  _garble(_data_file(tmp_path / "2"))
  assert ck.restore_meta(2) == {"step": 2}
  meta_file = tmp_path / "2" / "meta" / "metadata"
  meta_file.write_text(meta_file.read_text().replace("2", "7"))
  with pytest.raises(checkpointing.CheckpointError, match="digest mismatch in meta/metadata"):
    ck.restore_meta()
  ck.close()
