"""Two real processes x 4 CPU devices train on one 8-device mesh like one process does.

The processes run `experiments.train` on localhost (`jax.distributed` with
CPU collectives); the reference runs in this test process, which has 8 fake
CPU devices (conftest.py). The global batch, the PRNG keys and the mesh are the
same, so the metrics agree up to the order of floating-point reductions.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import default  # noqa: E402
from offpolicy_jax.rewards import tasks  # noqa: E402
from offpolicy_jax.rollout import data  # noqa: E402
from offpolicy_jax.run import loop  # noqa: E402
from offpolicy_jax.store.integrity import MANIFEST  # noqa: E402
from tests.conftest import FAST_COMPILE  # noqa: E402

OVERRIDES = {
  # Partial credit: rewards vary within groups from the first step, so losses
  # and gradients are not zero.
  "task_kwargs.partial_credit": True,
  # Few steps (each costs about 1 s over gloo): the signal test stops a run before the
  # step-4 checkpoint and kills one just after it, so its resume starts mid-run.
  "total_steps": 8,
  "mesh.data": 8,
  "prompts_per_step": 8,
  "group_size": 4,
  "sft.steps": 8,
  "sft.batch_size": 16,
  "eval_every": 0,
  "eval_prompts": 8,
  "eval_samples": 2,
  "checkpoint_every": 4,
  "progress": False,
  "tensorboard": False,
}
# Wall-clock metrics differ between runs.
TIMING = ("tokens_per_s", "step_time_s", "reward_time_s", "compiles")
STEPS, EVERY = OVERRIDES["total_steps"], OVERRIDES["checkpoint_every"]
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
    "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
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


def _rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  """The workdir of an uninterrupted 2-process run."""
  workdir = str(tmp_path_factory.mktemp("mp") / "run")
  os.makedirs(os.path.dirname(workdir), exist_ok=True)
  codes = _wait(_launch(workdir), workdir)
  assert codes == [0, 0], _logs(workdir)
  return workdir


def test_two_processes_match_one_process(two_process_run, tmp_path):
  workdir = two_process_run
  # Only process 0 writes metrics: one row per train step and the two evaluations.
  rows = _rows(workdir)
  train = _train_rows(rows)
  assert [r["step"] for r in train] == list(range(1, STEPS + 1))
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, STEPS]
  assert not [p for p in os.listdir(os.path.dirname(workdir)) if p.startswith("metrics")]
  # Both processes took part in the orbax checkpoints; process 0 wrote the manifests.
  for step in (EVERY, STEPS):
    assert os.path.exists(os.path.join(workdir, "checkpoints", str(step), MANIFEST))

  reference = _train_rows(loop.train_and_evaluate(_config(), str(tmp_path / "ref")))
  assert sum(r["reward_mean"] for r in reference) > 0  # the comparison covers a learning signal
  for got, want in zip(train, reference, strict=True):  # every step
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_allclose(
        got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=f"{k}, {got['step']}"
      )


def _wait_for(path: str, procs: list[subprocess.Popen], workdir: str, failure: str) -> None:
  """Waits until `path` exists; kills the processes and fails if they end or time runs out."""
  deadline = time.monotonic() + TIMEOUT_S
  while not os.path.exists(path):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:
        p.kill()
      pytest.fail(f"{failure}:\n{_logs(workdir)}")
    time.sleep(0.02)


def _signal_one_process_once_it_runs(workdir: str, index: int, sig: int) -> int:
  """Starts (or resumes) a run, signals process `index` alone once the run holds its workdir.

  Returns the step both processes stopped at (checked: the same exit status,
  the same message, a checkpoint at that step).
  """
  procs = _launch(workdir)
  holder = os.path.join(workdir, ".lock.json")  # written just before the signal handlers
  _wait_for(holder, procs, workdir, "the run never took its workdir")
  time.sleep(1.0)
  procs[index].send_signal(sig)
  codes = _wait(procs, workdir)
  # The other process got no signal: it stops with this one (the flag is agreed between them).
  assert codes == [128 + sig] * 2, _logs(workdir)
  stopped = _train_rows(_rows(workdir))[-1]["step"]
  for i in range(2):
    with open(os.path.join(os.path.dirname(workdir), f"process{i}.log")) as f:
      assert f"stopped at step {stopped}; the same command resumes" in f.read()
  assert os.path.exists(os.path.join(workdir, "checkpoints", str(stopped), MANIFEST))
  return stopped


def test_signals_then_sigkill_then_resuming_both_continues_exactly(two_process_run, tmp_path):
  """SIGTERM process 1 alone: both processes stop after the same step, saved. Resumed,
  SIGKILL right after the mid-run checkpoint (step EVERY); both restarted finish like the
  uninterrupted run.

  Process 1 is signalled, not process 0: the stop is agreed by a gather over the
  processes, so the coordinator follows a signal it never received; a stop that
  only process 0 decides and broadcasts, or that each process decides alone,
  fails here. SIGINT and SIGTERM take the same path (`stopping.Stop`); each is
  checked with its exit status and lines in test_experiments.py.
  """
  workdir = str(tmp_path / "mp" / "run")
  os.makedirs(os.path.dirname(workdir))
  assert _signal_one_process_once_it_runs(workdir, 1, signal.SIGTERM) < EVERY
  procs = _launch(workdir)
  manifest = os.path.join(workdir, "checkpoints", str(EVERY), MANIFEST)
  _wait_for(manifest, procs, workdir, f"no step-{EVERY} checkpoint before the processes ended")
  for p in procs:  # freeze both, so neither gets far past the checkpoint
    p.send_signal(signal.SIGSTOP)
  procs[1].kill()
  procs[0].kill()  # its peer is gone: it could only wait in a collective
  for p in procs:
    p.wait()
  saved = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert EVERY <= max(saved) < STEPS

  codes = _wait(_launch(workdir), workdir)
  assert codes == [0, 0], _logs(workdir)
  with open(os.path.join(os.path.dirname(workdir), "process0.log")) as f:
    assert f"resumed from step {max(saved)}" in f.read()
  got, want = _train_rows(_rows(workdir)), _train_rows(_rows(two_process_run))
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  for a, b in zip(got, want, strict=True):
    assert a.keys() == b.keys()
    for k in b:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=f"{k}, {a['step']}")


# Each process scores its own rows of a global batch of 4 prompts x 2 responses.
SCORE_SCRIPT = """
import json, sys


def main():
  import jax
  jax.distributed.initialize(
      coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P
  from types import SimpleNamespace
  from offpolicy_jax.models import tokenizers
  from offpolicy_jax.rewards import scoring as rewards, tasks
  from offpolicy_jax.rollout import data
  from offpolicy_jax.step import run_state, scoring
  from offpolicy_jax.scale import sharding

  task, tok = tasks.get_task("reverse"), tokenizers.CharTokenizer()
  examples = data.examples(task, "eval", range(4))
  texts = [ex["answer"] if row % 3 == 0 else "9" for row, ex in enumerate(
      [ex for ex in examples for _ in range(2)])]
  ids = np.zeros((8, 8), np.int32)
  for row, text in enumerate(texts):
    t = tok.encode(text)
    ids[row, : len(t)] = t
  lengths = np.asarray([len(tok.encode(t)) for t in texts], np.int32)
  mesh = sharding.make_mesh(8, 1, 1)
  rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
  p = jax.process_index()
  out = SimpleNamespace(
      tokens=jax.make_array_from_process_local_data(rows, ids[p * 4 : p * 4 + 4], (8, 8)),
      lengths=jax.make_array_from_process_local_data(rows, lengths[p * 4 : p * 4 + 4], (8,)))
  seen = []
  score_batch = rewards.score_batch
  rewards.score_batch = lambda fn, ex, t, **kw: (seen.extend(t), score_batch(fn, ex, t, **kw))[1]
  fns = SimpleNamespace(task=task, model=SimpleNamespace(tokenizer=tok), reward=run_state.Reward(
      host=task.reward, pool=rewards.get_pool(1, 1024, "warn")))
  scores, stats = scoring.score_on_host(
      fns, {"index": np.arange(4)}, out, split="eval", group_size=2)
  full = np.asarray(multihost_utils.process_allgather(scores, tiled=True))
  print("RESULT " + json.dumps({"scored": seen, "scores": full.tolist(), "stats": stats}))


if __name__ == "__main__":  # the verifier workers re-import this file
  main()
"""


def test_each_process_scores_only_its_own_rows(tmp_path):
  script = tmp_path / "score.py"
  script.write_text(SCORE_SCRIPT)
  env = {
    **os.environ,
    "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
  }
  port = _free_port()
  cmd = lambda i: [sys.executable, str(script), f"localhost:{port}", str(i)]
  procs = [
    subprocess.Popen(cmd(i), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for i in range(2)
  ]
  outs = [p.communicate(timeout=TIMEOUT_S)[0].decode() for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  results = [json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) for o in outs]
  task = tasks.get_task("reverse")
  answers = [ex["answer"] for ex in data.examples(task, "eval", range(4)) for _ in range(2)]
  texts = [a if row % 3 == 0 else "9" for row, a in enumerate(answers)]
  want = [float(row % 3 == 0) for row in range(8)]
  for p, res in enumerate(results):
    assert res["scored"] == texts[p * 4 : p * 4 + 4]  # its own block of rows, nothing else
    assert res["scores"] == want  # the global array holds every process's scores
    assert res["stats"]["reward_failures"] == 0
    assert set(res["stats"]) >= {"reward_time_s/process0", "reward_time_s/process1"}
