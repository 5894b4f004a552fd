"""Two real processes x 4 CPU devices train on one 8-device mesh like one process does.

The processes run `experiments.train` on localhost (`jax.distributed` with
CPU collectives); the reference runs in this test process, which has 8 fake
CPU devices (conftest.py). The global batch, the PRNG keys and the mesh are the
same, so the metrics agree up to the order of floating-point reductions.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import default  # noqa: E402
from offpolicy_jax import loop  # noqa: E402

OVERRIDES = {
  # Partial credit: rewards vary within groups from the first step, so losses
  # and gradients are not zero.
  "task_kwargs.partial_credit": True,
  "total_steps": 12,
  "mesh.data": 8,
  "prompts_per_step": 8,
  "group_size": 4,
  "sft.steps": 20,
  "sft.batch_size": 16,
  "eval_every": 0,
  "eval_prompts": 8,
  "eval_samples": 2,
  "checkpoint_every": 6,
  "progress": False,
  "tensorboard": False,
}
# Wall-clock metrics differ between runs.
TIMING = ("tokens_per_s", "step_time_s", "reward_time_s", "compiles")
# Steps whose metrics must match the one-process run.
COMPARED_STEPS = 6
TIMEOUT_S = 240
# The processes' config file: the same `_config()` as the reference's.
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


def _config():
  c = default.base_config()
  for key, value in OVERRIDES.items():
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  c.lock()
  return c


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(workdir: str, num_processes: int = 2) -> list[subprocess.Popen]:
  """Starts `experiments.train` as `num_processes` processes of 4 CPU devices each."""
  env = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
  }
  port = _free_port()
  config_file = os.path.join(os.path.dirname(workdir), "config.py")
  with open(config_file, "w") as f:
    f.write(CONFIG_FILE.format(overrides=json.dumps(OVERRIDES)))
  procs = []
  for i in range(num_processes):
    cmd = [
      sys.executable,
      "-m",
      "experiments.train",
      f"--config={config_file}",
      f"--workdir={workdir}",
      f"--coordinator_address=localhost:{port}",
      f"--num_processes={num_processes}",
      f"--process_id={i}",
    ]
    log = open(os.path.join(os.path.dirname(workdir), f"process{i}.log"), "w")  # noqa: SIM115
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    log.close()
  return procs


def _wait(procs: list[subprocess.Popen], workdir: str) -> list[int]:
  """Exit codes of `procs`; kills them all if one is not done within TIMEOUT_S."""
  try:
    return [p.wait(timeout=TIMEOUT_S) for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"multi-process run did not finish in {TIMEOUT_S}s:\n{_logs(workdir)}")


def _logs(workdir: str) -> str:
  out = []
  for i in range(2):
    path = os.path.join(os.path.dirname(workdir), f"process{i}.log")
    if os.path.exists(path):
      with open(path) as f:
        lines = [x for x in f.read().splitlines() if "[Gloo]" not in x]
      out.append(f"--- process {i}\n" + "\n".join(lines[-40:]))
  return "\n".join(out)


def _train_rows(rows):
  return [
    {k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")}
    for r in rows
    if "loss" in r
  ]


def test_two_processes_match_one_process(tmp_path):
  workdir = str(tmp_path / "mp" / "run")
  os.makedirs(os.path.dirname(workdir))
  codes = _wait(_launch(workdir), workdir)
  assert codes == [0, 0], _logs(workdir)

  # Only process 0 writes metrics: one row per train step and the two evaluations.
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  train = _train_rows(rows)
  assert [r["step"] for r in train] == list(range(1, 13))
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 12]
  assert not [p for p in os.listdir(tmp_path / "mp") if p.startswith("metrics")]

  reference = _train_rows(loop.train_and_evaluate(_config(), str(tmp_path / "ref")))
  assert sum(r["reward_mean"] for r in reference) > 0  # the comparison covers a learning signal
  for got, want in zip(train[:COMPARED_STEPS], reference[:COMPARED_STEPS], strict=True):
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_allclose(
        got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=f"{k}, {got['step']}"
      )
