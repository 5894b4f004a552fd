"""Disaggregated sampler and trainer meshes: the device split, weight transfer, end-to-end runs.

The runs use 8 fake CPU devices (conftest.py): 2 sampler devices and a 6-device
trainer mesh (data=2, tensor=3). They are the default job, shortened, from a
fresh model with the task's partial-credit reward and a higher learning rate
(the warm start's compilation on the tensor-parallel trainer mesh would about
double the file's time).
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import default  # noqa: E402
from offpolicy_jax import lag  # noqa: E402
from offpolicy_jax.rewards import tasks  # noqa: E402
from offpolicy_jax.run import components, loop, validation  # noqa: E402
from offpolicy_jax.scale import disagg, sharding  # noqa: E402
from tests.conftest import FAST_COMPILE  # noqa: E402

# Wall-clock metrics and the disaggregated run's own metrics.
TIMING = ("tokens_per_s", "step_time_s", "compiles", "reshard_time_s", "reshard_bytes")


def _fake_devices(processes: int, per_process: int, shuffle: bool = False):
  ids = list(range(processes * per_process))
  if shuffle:
    ids = ids[::-1]
  return [SimpleNamespace(id=i, process_index=i // per_process) for i in ids]


# ------------------------------------------------------------------ layout


def test_split_gives_every_process_devices_of_both_roles():
  # Simulated 2 processes x 4 devices: ids 0-3 on process 0, 4-7 on process 1.
  for shuffle in (False, True):
    layout = disagg.split_devices(_fake_devices(2, 4, shuffle), 2)
    assert [d.id for d in layout.sampler] == [0, 4]
    assert [d.id for d in layout.trainer] == [1, 2, 3, 5, 6, 7]
  layout = disagg.split_devices(_fake_devices(2, 4), 4)
  assert [d.id for d in layout.sampler] == [0, 1, 4, 5]
  assert [d.id for d in layout.trainer] == [2, 3, 6, 7]
  # One process: any split.
  layout = disagg.split_devices(_fake_devices(1, 8), 3)
  assert [d.id for d in layout.sampler] == [0, 1, 2]
  assert [d.id for d in layout.trainer] == [3, 4, 5, 6, 7]


@pytest.mark.parametrize(
  "devices,count,match",
  [
    (_fake_devices(2, 4), 0, "must be an int >= 1"),
    (_fake_devices(2, 4), -2, "must be an int >= 1"),
    (_fake_devices(2, 4), True, "must be an int >= 1"),
    (_fake_devices(2, 4), 2.0, "must be an int >= 1"),
    (_fake_devices(2, 4), 3, "does not split evenly over 2 processes"),
    (_fake_devices(2, 4), 8, "leaves the trainer no device"),
    (_fake_devices(1, 8), 9, "leaves the trainer no device"),
    (_fake_devices(1, 3) + [SimpleNamespace(id=9, process_index=1)], 2, "different numbers"),
  ],
)
def test_split_rejects_bad_layouts_naming_the_field(devices, count, match):
  with pytest.raises(ValueError, match=f"^mesh.sampler_devices: .*{match}"):
    disagg.split_devices(devices, count)


def test_meshes_on_eight_devices():
  sampler_mesh, trainer_mesh = disagg.make_meshes(jax.devices(), 2, (2, 1, 3))
  assert dict(sampler_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1}
  assert dict(trainer_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 3}
  assert [d.id for d in sampler_mesh.devices.flat] == [0, 1]
  assert [d.id for d in trainer_mesh.devices.flat] == [2, 3, 4, 5, 6, 7]
  assert trainer_mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
  _, filled = disagg.make_meshes(jax.devices(), 2, (-1, 1, 1))
  assert dict(filled.shape) == {"data": 6, "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match="^mesh: .*exactly the other 6 devices"):
    disagg.make_meshes(jax.devices(), 2, (2, 1, 1))


def _config(**overrides):
  c = default.base_config()
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  c.lock()
  return c


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"mesh.sampler_devices": 8}, "mesh.sampler_devices"),
    ({"mesh.sampler_devices": 2}, "mesh"),  # mesh.data=1 would leave 5 trainer devices idle
    ({"mesh.sampler_devices": 3, "mesh.data": 5}, "prompts_per_step"),  # 64 rows over 5
    ({"mesh.sampler_devices": 4, "mesh.data": 4, "prompts_per_step": 6}, "prompts_per_step"),
  ],
)
def test_config_errors_name_the_field(overrides, field):
  with pytest.raises(ValueError, match=f"^config.{field}:"):
    validation.validate_config(_config(**overrides))


def test_config_with_a_disaggregated_layout_passes():
  validation.validate_config(
    _config(**{"mesh.sampler_devices": 2, "mesh.data": 2, "mesh.tensor": 3})
  )
  validation.validate_config(_config(**{"mesh.sampler_devices": 4, "mesh.data": -1}))


# ------------------------------------------------------------------ transfer


def test_transfer_reshards_params_and_rows_between_meshes():
  sampler_mesh, trainer_mesh = disagg.make_meshes(jax.devices(), 2, (2, 1, 3))
  full = np.arange(36.0, dtype=np.float32).reshape(6, 6)
  x = jax.device_put(full, NamedSharding(trainer_mesh, P("data", "tensor")))
  rows = np.arange(24, dtype=np.int32).reshape(8, 3)
  r = jax.device_put(rows, sharding.batch_sharding(sampler_mesh, 2))
  # One process: jax.device_put; the process-local path (the multi-process one) agrees.
  for move in (disagg.transfer, disagg._transfer_local):
    y = move(x, NamedSharding(sampler_mesh, P()), gather=True)
    assert y.sharding.mesh == sampler_mesh and y.sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(y), full)
    t = move(r, sharding.batch_sharding(trainer_mesh, 2), gather=False)
    assert {d.id for d in t.sharding.device_set} == {2, 3, 4, 5, 6, 7}
    np.testing.assert_array_equal(np.asarray(t), rows)
  key = jax.device_put(np.int32(7), sharding.replicated(trainer_mesh))
  assert int(disagg._transfer_local(key, sharding.replicated(sampler_mesh), gather=False)) == 7


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# Two real processes x 4 CPU devices: the layout, jax.device_put's refusal, disagg.transfer.
TRANSFER_SCRIPT = """
import json, sys
import jax
jax.distributed.initialize(
    coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from offpolicy_jax.scale import disagg, sharding

sampler_mesh, trainer_mesh = disagg.make_meshes(jax.devices(), 2, (2, 1, 3))
p = jax.process_index()
full = np.arange(36.0, dtype=np.float32).reshape(6, 6)
x = jax.make_array_from_callback(
    full.shape, NamedSharding(trainer_mesh, P("data", "tensor")), lambda i: full[i])
try:
  jax.device_put(x, NamedSharding(sampler_mesh, P()))
  refused = ""
except ValueError as e:
  refused = str(e).splitlines()[0]
y = disagg.transfer(x, NamedSharding(sampler_mesh, P()), gather=True)
rows = np.arange(24, dtype=np.int32).reshape(8, 3)
r = jax.make_array_from_process_local_data(
    sharding.batch_sharding(sampler_mesh, 2), rows[4 * p : 4 * p + 4])
t = disagg.transfer(r, sharding.batch_sharding(trainer_mesh, 2))
try:
  disagg.transfer(r, sharding.replicated(trainer_mesh))
  foreign = ""
except ValueError as e:
  foreign = str(e)
print("RESULT " + json.dumps({
    "sampler": [[d.id, d.process_index] for d in sampler_mesh.devices.flat],
    "trainer": [[d.id, d.process_index] for d in trainer_mesh.devices.flat],
    "refused": refused,
    "params_local": all(np.array_equal(np.asarray(s.data), full) for s in y.addressable_shards),
    "rows": np.asarray(multihost_utils.process_allgather(t, tiled=True)).tolist(),
    "foreign": foreign,
}))
"""


def _env():
  return {
    **os.environ,
    "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
  }


def test_two_processes_transfer_with_each_owning_both_roles(tmp_path):
  script = tmp_path / "transfer.py"
  script.write_text(TRANSFER_SCRIPT)
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), f"localhost:{port}", str(i)],
      cwd=ROOT,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=120)[0].decode() for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  for out in outs:
    res = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    # Each process gives its first local device to the sampler, the other three to the trainer.
    assert [pi for _, pi in res["sampler"]] == [0, 1]
    assert [pi for _, pi in res["trainer"]] == [0, 0, 0, 1, 1, 1]
    assert "cross-host reshard" in res["refused"]  # the limit disagg.transfer works around
    assert res["params_local"]
    assert res["rows"] == np.arange(24).reshape(8, 3).tolist()
    assert "are not on process" in res["foreign"]


# ------------------------------------------------------------------ end to end

RUN = {
  "task_kwargs.partial_credit": True,
  "sft.enabled": False,
  "optimizer.learning_rate": 1e-3,  # from scratch, a visible gain within 60 steps
  "mesh.data": 2,
  "mesh.tensor": 3,
  "eval_every": 0,
  "eval_prompts": 16,
  "eval_samples": 1,
  "checkpoint_every": 0,
  "progress": False,
  "tensorboard": False,
}


def _train_rows(rows):
  return [r for r in rows if "loss" in r]


def _numbers(row):
  return {k: v for k, v in row.items() if k not in TIMING and not k.startswith("time/")}


def _fifths(rows, key="reward_mean"):
  r = np.array([row[key] for row in rows])
  n = len(r) // 5
  return r[:n].mean(), r[-n:].mean()


SYNC_STEPS = 60


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
  """Training rows of a one-process disaggregated sync-mode run (2 sampler + 6 trainer devices)."""
  config = _config(**RUN, total_steps=SYNC_STEPS, **{"mesh.sampler_devices": 2})
  return _train_rows(loop.train_and_evaluate(config, str(tmp_path_factory.mktemp("sync"))))


def test_sync_disaggregated_run_equals_the_shared_mesh_run(sync_run, tmp_path):
  steps, got = SYNC_STEPS, sync_run
  want = _train_rows(
    loop.train_and_evaluate(_config(**RUN, total_steps=steps), str(tmp_path / "s"))
  )
  assert [r["step"] for r in got] == list(range(1, steps + 1))
  params_bytes = got[0]["reshard_bytes"]
  assert params_bytes > 100_000 * 4  # the tiny model, float32
  for a, b in zip(got, want, strict=True):
    t = a["step"]
    # The same numbers as one shared mesh: same behaviour parameters, keys and batches (the
    # sampler's reductions differ between the meshes in the last bits: ~1e-9 in a log-prob).
    assert _numbers(a).keys() == _numbers(b).keys()
    for k, v in _numbers(b).items():
      np.testing.assert_allclose(a[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k}, step {t}")
    # Staleness follows the schedule (sync_interval 4) exactly.
    assert a["staleness_max"] == lag.staleness(t, 4, 0) == a["staleness_mean"]
    assert a["behavior_version"] == lag.behavior_version(t, 4, 0)
    # The sampler's copy is resharded exactly when v(t) changes: t = 1, 5, 9, ...
    synced = (t - 1) % 4 == 0
    assert (a["reshard_time_s"] > 0) == synced and a["reshard_bytes"] == params_bytes * synced
  first, last = _fifths(got)
  print(f"reward over the first / last fifth of steps: {first:.4f} / {last:.4f}")
  assert last > first  # it learns


def test_async_disaggregated_run_learns_with_exact_staleness(tmp_path):
  steps = 60
  config = _config(
    **RUN,
    total_steps=steps,
    **{"mesh.sampler_devices": 2, "lag.mode": "async", "lag.max_staleness": 2},
  )
  rows = _train_rows(loop.train_and_evaluate(config, str(tmp_path / "a")))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  for r in rows:
    # Every batch records the version that sampled it: staleness is the trainer's lag behind it.
    assert r["staleness_max"] == r["staleness_mean"] == r["step"] - 1 - r["behavior_version"]
    assert 0 <= r["staleness_max"] <= 2
    assert r["reshard_time_s"] > 0 and r["reshard_bytes"] > 0
  # Sampling overlaps training: a step takes less than sampling plus training one batch.
  later = rows[5:]
  step = np.mean([r["step_time_s"] for r in later])
  assert step < np.mean([r["time/sample_s"] + r["time/train_s"] for r in later])
  first, last = _fifths(rows)
  print(f"reward over the first / last fifth of steps: {first:.4f} / {last:.4f}; step {step:.4f} s")
  assert last > first  # it learns


def _text_reward(example, text):
  """A deterministic host reward: the fraction of the reference answer's characters in the text."""
  answer = str(example["answer"])
  return sum(ch in text for ch in answer) / max(len(answer), 1)


@pytest.mark.slow  # 35-50 s (verifier workers, two more compilations); run with -m slow
def test_host_reward_and_offset_schedule_match_the_shared_mesh(tmp_path, monkeypatch):
  """Host rewards score the rollout on the trainer mesh; v(t) of sync_interval 2, offset 3
  comes from the trainer's snapshots, resharded when it changes (t = 1, 6)."""
  real_get_task = tasks.get_task

  def get_task(name, **kw):
    return dataclasses.replace(real_get_task(name, **kw), reward=_text_reward, device_reward=None)

  monkeypatch.setattr(tasks, "get_task", get_task)
  components.clear_cache()
  base = {
    **RUN,
    "total_steps": 6,
    "eval_prompts": 0,
    "mesh.data": -1,
    "mesh.tensor": 1,
    "lag.sync_interval": 2,
    "lag.sync_offset": 3,
    "reward_workers": 1,
  }
  try:
    got = _train_rows(
      loop.train_and_evaluate(_config(**base, **{"mesh.sampler_devices": 4}), str(tmp_path / "d"))
    )
    want = _train_rows(loop.train_and_evaluate(_config(**base), str(tmp_path / "s")))
  finally:
    components.clear_cache()
  assert [r["step"] for r in got if r["reshard_bytes"]] == [1, 6]
  for a, b in zip(got, want, strict=True):
    assert a["staleness_max"] == lag.staleness(a["step"], 2, 3)
    assert _numbers(a).keys() == _numbers(b).keys()
    for k, v in _numbers(b).items():
      if k != "reward_time_s":
        np.testing.assert_allclose(a[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k}, step {a['step']}")
  assert any(r["reward_mean"] > 0 for r in got)


# The two processes' config file: RUN, 8 steps, 1 sampler + 3 trainer devices on each process.
CONFIG_FILE = """
import json
from configs import default

def get_config():
  c = default.base_config()
  for key, value in json.loads({overrides!r}).items():
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  c.lock()
  return c
"""


def test_two_process_disaggregated_run_matches_one_process(sync_run, tmp_path):
  steps = 8
  overrides = {**RUN, "total_steps": steps, "mesh.sampler_devices": 2}
  config_file = tmp_path / "config.py"
  config_file.write_text(CONFIG_FILE.format(overrides=json.dumps(overrides)))
  workdir, port = tmp_path / "run", _free_port()
  procs = []
  for i in range(2):
    cmd = [
      sys.executable,
      "-m",
      "experiments.train",
      f"--config={config_file}",
      f"--workdir={workdir}",
      f"--coordinator_address=localhost:{port}",
      "--num_processes=2",
      f"--process_id={i}",
    ]
    procs.append(
      subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    )
  outs = [p.communicate(timeout=240)[0].decode()[-3000:] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  with open(workdir / "metrics.jsonl") as f:
    got = _train_rows([json.loads(line) for line in f])
  assert [r["step"] for r in got] == list(range(1, steps + 1))
  for a, b in zip(got, sync_run[:steps], strict=True):
    assert _numbers(a).keys() == _numbers(b).keys()
    for k, v in _numbers(b).items():
      np.testing.assert_allclose(a[k], v, rtol=1e-4, atol=1e-5, err_msg=f"{k}, step {a['step']}")
    assert a["reshard_bytes"] == b["reshard_bytes"]  # resharded at the same steps
