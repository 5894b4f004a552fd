"""Tests for offpolicy_jax.rewards and offpolicy_jax.verifiers: the sandboxed scoring path."""

import gc
import multiprocessing.connection
import os
import sys
import threading
import time

import numpy as np
import pytest

from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards import verifiers


def _verifier(example, text):
  """A host reward (module level, so it reaches the workers) that misbehaves on demand."""
  if text == "raise":
    raise RuntimeError("verifier bug")
  if text == "nan":
    return float("nan")
  if text == "big":
    return 1e300  # finite in float64, inf in float32
  if text == "exit":
    os._exit(3)
  if text == "hang":
    time.sleep(60.0)
  if text == "spin":
    while True:
      pass
  if text == "forge":
    # Takes over the worker's reply pipe and sends a pickle that would run a
    # command if the trainer unpickled it.
    class Exploit:
      def __reduce__(self):
        return (os.system, (f"touch {example['path']}",))

    for obj in gc.get_objects():
      if isinstance(obj, multiprocessing.connection.Connection) and obj.writable:
        obj.send(Exploit())
    return 1.0
  return example["v"]


@pytest.fixture(scope="module")
def pool():
  p = verifiers.VerifierPool(2)
  yield p
  p.close()


def _cpu_ticks(pids):
  total = 0
  for pid in pids:
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      total += int(fields[11]) + int(fields[12])  # utime + stime
    except FileNotFoundError:
      pass
  return total


def test_scores_failures_and_counts(pool, tmp_path):
  texts = ["ok", "raise", "nan", "big", "exit", "hang", "ok", "forge"]
  exs = [{"v": float(i), "path": str(tmp_path / "pwned")} for i in range(len(texts))]
  # A replaced worker imports this test module (pytest with it) within its first call, about
  # 0.5 s alone and more under load: the limits leave room for that, and the batch limit is
  # generous so that only the per-call limit is tested here.
  res = rewards.score_batch(_verifier, exs, texts, timeout_s=3.0, batch_timeout_s=30.0, pool=pool)
  np.testing.assert_array_equal(res.scores, [0, 0, 0, 0, 0, 0, 6, 0])
  np.testing.assert_array_equal(res.failed, [0, 1, 1, 1, 1, 1, 0, 1])
  np.testing.assert_array_equal(res.timed_out, [0, 0, 0, 0, 0, 1, 0, 0])
  assert res.restarts == 3  # exit, hang, forge
  assert any("RuntimeError: verifier bug" in e for e in res.errors)
  assert not (tmp_path / "pwned").exists()  # the forged pickle was never unpickled
  assert len(pool.pids()) == 2
  again = rewards.score_batch(
    _verifier, exs[:1], ["ok"], timeout_s=3.0, batch_timeout_s=30.0, pool=pool
  )
  assert again.scores[0] == 0.0 and not again.failed[0]


def test_hung_and_spinning_batches_end_near_the_timeout_and_leave_nothing_running(pool):
  threads = threading.active_count()
  old = set(pool.pids())
  for text in ("hang", "spin", "hang"):
    start = time.monotonic()
    res = rewards.score_batch(_verifier, [{}] * 32, [text] * 32, timeout_s=0.5, pool=pool)
    elapsed = time.monotonic() - start
    assert elapsed < 2 * 0.5 + 2.0, elapsed  # the batch deadline is 2 * timeout_s
    assert res.failed.all() and res.timed_out.all()
  pids = pool.pids()
  assert len(pids) == 2 and not old & set(pids)
  for pid in old:  # killed workers are gone, not zombies left running
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
  assert threading.active_count() == threads
  before = _cpu_ticks(pids)
  time.sleep(0.5)
  assert _cpu_ticks(pids) - before <= 2  # idle workers: nothing keeps spinning


def test_sandboxed_reward_direct_call_and_errors(pool):
  r = rewards.SandboxedReward(_verifier, name="mine")
  assert r({"v": 0.25}, "ok") == 0.25
  with pytest.raises(rewards.RewardError, match="mine.*RuntimeError: verifier bug"):
    r({"v": 0.25}, "raise")
  with pytest.raises(ValueError, match="cannot run in a sandboxed verifier worker"):
    rewards.score_batch(lambda ex, t: 1.0, [{}], ["x"], pool=pool)
  with pytest.raises(ValueError, match="differ"):
    rewards.score_batch(_verifier, [{}], [], pool=pool)
  with pytest.raises(ValueError, match="timeout_s"):
    rewards.score_batch(_verifier, [{}], ["ok"], timeout_s=float("inf"), pool=pool)
  assert rewards.score_with_timeout(_verifier, {"v": 0.5}, "ok", 1.0) == (0.5, False)
  with pytest.raises(ValueError, match="sandbox_mode"):
    verifiers.VerifierPool(1, sandbox_mode="off")


def test_rebuild_reward_resolves_a_closure_in_the_worker(pool):
  from offpolicy_jax.rewards import tasks

  ref = rewards.RebuildReward(tasks.get_task, {"name": "copy"}, "copy")
  fn = rewards.SandboxedReward(lambda ex, t: 0.0, ref, "copy")
  res = rewards.score_batch(fn, [{"answer": "12"}] * 2, ["12", "13"], pool=pool)
  np.testing.assert_array_equal(res.scores, [1.0, 0.0])


def test_answer_and_format_parsing():
  assert rewards.extract_answer("<think>a</think><answer> 42 </answer>") == "42"
  assert rewards.extract_answer("<answer>1</answer><answer>2</answer>") == "2"
  assert rewards.extract_answer("  plain ") == "plain"
  assert rewards.follows_format("<think>a\nb</think>\n<answer>4</answer>")
  assert not rewards.follows_format("<answer>4</answer>")
  assert not rewards.follows_format("<think>a</think><answer>4</answer> trailing")


def _leaves_a_spinning_thread(example, text):
  def spin():
    while True:
      pass

  threading.Thread(target=spin, daemon=True).start()
  return 1.0


def test_dead_idle_workers_and_leftover_threads_are_replaced(pool):
  victim = pool.pids()[0]
  os.kill(victim, 9)  # dies while idle: the next batch must not see a broken pipe
  time.sleep(0.2)
  res = rewards.score_batch(_verifier, [{"v": 1.0}] * 4, ["ok"] * 4, pool=pool)
  assert res.scores.tolist() == [1.0] * 4 and victim not in pool.pids()
  before = set(pool.pids())
  res = rewards.score_batch(_leaves_a_spinning_thread, [{}] * 2, ["x"] * 2, pool=pool)
  assert res.scores.tolist() == [1.0, 1.0] and res.restarts >= 1
  time.sleep(0.5)
  pids = pool.pids()
  assert len(pids) == 2 and before - set(pids)  # the thread died with its worker
  start = _cpu_ticks(pids)
  time.sleep(0.5)
  assert _cpu_ticks(pids) - start <= 2


def test_a_reward_the_workers_cannot_import_raises(pool, tmp_path, monkeypatch):
  (tmp_path / "opj_vanishing_module.py").write_text("def reward(example, text):\n  return 1.0\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  import opj_vanishing_module

  (tmp_path / "opj_vanishing_module.py").unlink()
  monkeypatch.delitem(sys.modules, "opj_vanishing_module")
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
  with pytest.raises(ValueError, match="cannot run in a sandboxed verifier worker"):
    rewards.score_batch(opj_vanishing_module.reward, [{}] * 3, ["x"] * 3, pool=pool)
  assert rewards.score_batch(_verifier, [{"v": 2.0}], ["ok"], pool=pool).scores.tolist() == [2.0]
