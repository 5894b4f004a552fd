"""Tests for offpolicy_jax.checkpointing: named items, round trips, keep-last-N, integrity."""

import json
import logging
import os
import shutil
import time
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from offpolicy_jax.store import checkpointing
from offpolicy_jax.store import integrity as checkpoint_integrity


class _Buf(NamedTuple):
  tokens: jax.Array
  ptr: jax.Array


def _params(scale):
  """An `nnx.State` of Variables, as `nnx.split` gives for a model."""
  return nnx.split(nnx.Linear(4, 2, rngs=nnx.Rngs(int(scale))))[1]


def _state(scale):
  params = _params(scale)
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
  assert isinstance(restored["buffer"], _Buf) and isinstance(restored["params"], nnx.State)
  assert isinstance(restored["params"]["kernel"], nnx.Param)
  assert meta == {"step": 3, "data_state": b"\x00it", "nested": {"a": [1]}}
  older, meta2 = ck.restore(_state(0), step=2)
  _assert_equal(older, _state(2))
  assert ck.restore_meta(2)["step"] == 2
  ck.close()


def test_items_read_by_name_with_plain_orbax(tmp_path):
  ck = checkpointing.Checkpointer(str(tmp_path))
  state = _state(7)
  ck.save(7, {**state, "snapshots": None, "counters": {}}, {"step": 7})
  ck.close()
  assert sorted(os.listdir(tmp_path / "7")) == [
    "_CHECKPOINT_METADATA",
    "_MANIFEST.json",
    "buffer",
    "commit_success.txt",
    "key",
    "meta",
    "opt",
    "params",
  ]
  read = lambda name: ocp.StandardCheckpointer().restore(str(tmp_path / "7" / name))
  params = read("params")  # nnx.State paths; each Variable is its value
  assert jax.tree.map(np.shape, params) == {"kernel": (4, 2), "bias": (2,)}
  np.testing.assert_array_equal(params["kernel"], state["params"]["kernel"].get_value())
  buffer = read("buffer")  # NamedTuple fields
  assert set(buffer) == {"tokens", "ptr"} and int(buffer["ptr"]) == 7
  opt = read("opt")  # optax's tuple of states: indices, then field names
  assert set(opt) == {"0"} and set(opt["0"]) == {"count", "mu", "nu"}
  assert jax.tree.map(np.shape, opt["0"]["mu"]) == {"kernel": (4, 2), "bias": (2,)}
  # A single leaf is {"value": leaf}; a typed PRNG key is its key data.
  np.testing.assert_array_equal(read("key")["value"], jax.random.key_data(state["key"]))


def test_restore_only_params_reads_only_their_files(tmp_path, monkeypatch):
  ck = checkpointing.Checkpointer(str(tmp_path))
  ck.save(1, _state(1), {"step": 1})
  ck.close()
  # Other items' files are damaged or gone: neither verified nor read.
  shutil.rmtree(tmp_path / "1" / "opt")
  _garble(_data_file(tmp_path / "1", "buffer"))
  hashed = []
  sha256 = checkpoint_integrity._sha256
  monkeypatch.setattr(checkpoint_integrity, "_sha256", lambda p: hashed.append(p) or sha256(p))
  ck = checkpointing.Checkpointer(str(tmp_path))
  items, meta = ck.restore({"params": jax.eval_shape(lambda: _params(0))})
  assert list(items) == ["params"] and meta == {"step": 1}
  _assert_equal(items["params"], _params(1))
  rels = [os.path.relpath(p, tmp_path / "1") for p in hashed]
  assert rels and all(r.split(os.sep)[0] in ("params", "meta") or os.sep not in r for r in rels)
  assert ck.verify(1).startswith("missing file opt/")
  with pytest.raises(checkpointing.CheckpointError, match="step 1 is corrupt"):
    ck.restore(_state(0))
  ck.close()


def test_restore_into_sharded_abstract_templates(tmp_path):
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  shardings = {"kernel": PartitionSpec("data", None), "bias": PartitionSpec("model")}
  ck = checkpointing.Checkpointer(str(tmp_path))
  ck.save(1, {"params": _params(1), "key": jax.random.key(3)}, {"step": 1})
  ck.wait()
  shard = lambda path, x: jax.ShapeDtypeStruct(
    x.shape, x.dtype, sharding=NamedSharding(mesh, shardings[path[0].key])
  )
  abstract = jax.tree_util.tree_map_with_path(shard, jax.eval_shape(lambda: _params(0)))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  items, _ = ck.restore({"params": abstract, "key": key})
  _assert_equal(items["params"], _params(1))
  _assert_equal(items["key"], jax.random.key(3))
  for name, spec in shardings.items():
    assert items["params"][name].get_value().sharding == NamedSharding(mesh, spec)
  ck.close()


def test_cpu_saves_replicated_arrays_whole_and_reads_split_ones(tmp_path, monkeypatch):
  """On CPU a replicated array is written as one chunk, not one slice per device; steps
  written with orbax's split (older runs) restore to the same values."""
  mesh = Mesh(np.array(jax.devices()), ("data",))
  tree = {
    "w": jax.device_put(jnp.arange(8 * 6.0).reshape(8, 6), NamedSharding(mesh, PartitionSpec())),
    "rows": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, PartitionSpec("data"))),
  }

  def chunks(step):
    with open(tmp_path / str(step) / "params" / "array_metadatas" / "process_0") as f:
      found = json.load(f)["array_metadatas"]
    return {m["array_metadata"]["param_name"]: m["array_metadata"]["chunk_shape"] for m in found}

  ck = checkpointing.Checkpointer(str(tmp_path), max_to_keep=None)
  ck.save(1, {"params": tree}, {"step": 1})
  ck.wait()
  assert chunks(1) == {"w": [8, 6], "rows": [2]}
  split = ocp.type_handlers.ArrayHandler(
    array_metadata_store=checkpointing.array_metadata_store.Store(), use_replica_parallel=True
  )
  monkeypatch.setattr(checkpointing, "_whole_replicas_on_cpu", lambda: None)
  whole = ocp.type_handlers.get_type_handler(jax.Array)
  ocp.type_handlers.register_type_handler(jax.Array, split, override=True)
  try:
    ck.save(2, {"params": tree}, {"step": 2})
    ck.wait()
  finally:
    ocp.type_handlers.register_type_handler(jax.Array, whole, override=True)
  assert chunks(2)["w"] != [8, 6]  # orbax's default split it across the replicas
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )
  for step in (1, 2):
    items, _ = ck.restore({"params": abstract}, step=step)
    _assert_equal(items["params"], tree)
  ck.close()


def test_items_vary_by_step_and_missing_items_raise(tmp_path):
  ck = checkpointing.Checkpointer(str(tmp_path), max_to_keep=3)
  ck.save(1, {"a": {"x": jnp.ones(2)}, "b": {"y": jnp.zeros(3)}}, {"step": 1})
  ck.save(2, {"a": {"x": jnp.ones(2) * 2}, "c": _Buf(jnp.ones(1), jnp.int32(2))}, {"step": 2})
  ck.wait()
  template = {"a": {"x": jnp.zeros(2)}, "c": _Buf(jnp.zeros(1), jnp.int32(0)), "d": None, "e": {}}
  items, _, step = ck.restore_latest(template)  # None and leafless templates come back unread
  assert step == 2 and items["d"] is None and items["e"] == {}
  _assert_equal(items["c"], _Buf(jnp.ones(1), jnp.int32(2)))
  items, _ = ck.restore({"b": {"y": jnp.ones(3)}}, step=1)
  _assert_equal(items["b"], {"y": jnp.zeros(3)})
  with pytest.raises(checkpointing.CheckpointError) as err:
    ck.restore_latest({"b": {"y": jnp.ones(3)}})
  assert str(err.value) == "checkpoint step 2 has no item 'b' (it holds a, c, meta)"
  assert ck.all_steps() == [1, 2]  # not corrupt: nothing moved aside
  for bad in ("meta", "arrays", "_x", "a/b"):
    with pytest.raises(ValueError, match="checkpoint item name"):
      ck.save(3, {bad: {"x": jnp.ones(1)}}, {})
  ck.close()


def test_old_flat_format_gives_a_clear_error(tmp_path):
  # What offpolicy_jax 0.1.x wrote: all leaves in one item, by index.
  leaves = jax.tree.leaves({**_state(4), "key": jax.random.key_data(jax.random.key(4))})
  manager = ocp.CheckpointManager(str(tmp_path), item_names=("arrays", "meta"))
  manager.save(
    4,
    args=ocp.args.Composite(
      arrays=ocp.args.StandardSave({f"{i:06d}": x for i, x in enumerate(leaves)}),
      meta=ocp.args.JsonSave({"step": 4}),
    ),
  )
  manager.wait_until_finished()
  manager.close()
  ck = checkpointing.Checkpointer(str(tmp_path))
  for restore in (ck.restore, ck.restore_latest):
    with pytest.raises(checkpointing.CheckpointError) as err:
      restore({"params": _params(0)})
    message = str(err.value)
    assert "step 4" in message and "old flat-index format" in message and "\n" not in message
    assert "written by offpolicy_jax 0.1.x" in message
  assert ck.restore_meta() == {"step": 4}
  assert ck.all_steps() == [4] and not (tmp_path / "corrupt").exists()
  ck.close()


# Integrity: manifests of digests, verified restore with fallback.


def _big(scale):
  """`_state` plus an item large enough for orbax to store its array out of line."""
  return {**_state(scale), "big": {"w": jax.random.normal(jax.random.key(scale), (128, 512))}}


def _saved(path, steps=(1, 2), **kwargs):
  ck = checkpointing.Checkpointer(str(path), **kwargs)
  for step in steps:
    ck.save(step, _big(step), {"step": step})
  ck.close()
  return checkpointing.Checkpointer(str(path), **kwargs)


def _data_file(step_dir, item="big"):
  """The largest file of `item`: array bytes, which orbax does not checksum."""
  files = [os.path.join(r, n) for r, _, names in os.walk(step_dir / item) for n in names]
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
    items, meta, step = ck.restore_latest(_big(0))
  assert (step, meta) == (1, {"step": 1})
  _assert_equal(items, _big(1))
  first = _warnings(caplog)[0]
  assert first.startswith("checkpoint step 2 is corrupt (size mismatch in big/")
  assert first.endswith("; falling back to step 1") and "\n" not in first
  # Set aside, not deleted; the run can save step 2 again and keep-last-N
  # drops the intact step 1 only once newer steps exist.
  assert (tmp_path / "corrupt" / "2" / "big").is_dir()
  assert ck.all_steps() == [1]
  ck.save(2, _big(2), {"step": 2})
  ck.wait()
  assert ck.all_steps() == [1, 2]
  ck.save(3, _big(3), {"step": 3})
  ck.close()
  ck = checkpointing.Checkpointer(str(tmp_path), max_to_keep=2)
  items, _, step = ck.restore_latest(_big(0))
  assert step == 3 and ck.all_steps() == [2, 3]
  _assert_equal(items, _big(3))
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
    items, _, step = ck.restore_latest(_big(0))
  assert step == 1
  _assert_equal(items, _big(1))
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
  assert "step 2: size mismatch in big/" in message
  assert "step 1: digest mismatch in big/" in message
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
    items, _, step = ck.restore_latest(_big(0))
  assert step == 2
  _assert_equal(items, _big(2))
  assert "checkpoint step 2 has no manifest" in _warnings(caplog)[0]
  ck.close()


def test_unverified_step_that_fails_to_restore_falls_back_quietly(tmp_path, caplog):
  _saved(tmp_path).close()
  os.remove(tmp_path / "2" / "_MANIFEST.json")
  (tmp_path / "2" / "big" / "_METADATA").write_text('{"tree_metadata": ')
  (tmp_path / "2" / "_CHECKPOINT_METADATA").write_text("{")  # orbax logs an ERROR on opening
  with caplog.at_level(logging.WARNING):
    ck = checkpointing.Checkpointer(str(tmp_path))
    items, _, step = ck.restore_latest(_big(0))
  assert step == 1
  _assert_equal(items, _big(1))
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
