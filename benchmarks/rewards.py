"""Host reward scoring in sandboxed verifier workers: throughput, overhead, hostile batches.

For each reward kind, scores batches of B responses through `rewards.score_batch`
(the loop's path) and prints rewards/s and the per-batch overhead against
calling the same verifier in-process (a baseline only: the loop never does):

- trivial: exact match (synthetic `host_reward`);
- math-verify: the GSM8K reward (`math_data.math_reward`) on correct answers;
- code: the code task's reward on reference programs (if the task is present).

Then the hostile check: 15 batches in a row of 32 hanging and of 32 spinning
verifiers, printing each batch's wall time against its timeout, and the
trainer's threads, worker processes and worker CPU use before and after.

  python benchmarks/rewards.py [--batch 256] [--workers 0] [--timeout 2] [--rounds 15]
"""

import argparse
import functools
import os
import threading
import time

import numpy as np

from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards import verifiers
from offpolicy_jax.rewards.tasks import math_data, synthetic


def _spin(example, text):
  if text == "hang":
    time.sleep(3600)
  while True:
    pass


def _cases(batch: int):
  """name -> (fn, examples, texts)."""
  cases = {}
  ex = {"prompt": "rev:1234=", "answer": "4321"}
  cases["trivial"] = (synthetic.host_reward, [ex] * batch, ["4321"] * batch)
  gold = [{"question": "", "gold": str(i * 7)} for i in range(batch)]
  texts = [f"<think>x</think><answer>{i * 7}</answer>" for i in range(batch)]
  cases["math-verify"] = (math_data.math_reward, gold, texts)
  try:
    from offpolicy_jax.rewards.tasks import code
  except ImportError:
    return cases
  task = code.make_task("code", seed=0)
  exs = [task.train_source[i] for i in range(batch)]
  cases["code"] = (task.reward, exs, [e["answer"] for e in exs])
  return cases


def _worker_cpu(pids) -> float:
  ticks = 0
  for pid in pids:
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      ticks += int(fields[11]) + int(fields[12])
    except FileNotFoundError:
      pass
  return ticks / os.sysconf("SC_CLK_TCK")


def throughput(pool, batch: int, repeats: int) -> None:
  print("| reward | B | in-process s | sandboxed s | rewards/s | overhead s/batch |")
  print("|---|---|---|---|---|---|")
  for name, (fn, exs, texts) in _cases(batch).items():
    raw = getattr(fn, "fn", fn)
    raw(exs[0], texts[0])  # warm (imports, caches), as the workers are below
    start = time.perf_counter()
    local = [raw(e, t) for e, t in zip(exs, texts, strict=True)]
    t_local = time.perf_counter() - start
    rewards.score_batch(fn, exs, texts, timeout_s=30.0, pool=pool)  # warm the workers
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      res = rewards.score_batch(fn, exs, texts, timeout_s=30.0, pool=pool)
      times.append(time.perf_counter() - start)
    assert not res.failed.any() and np.allclose(res.scores, local), (name, res.errors)
    t = float(np.median(times))
    ideal = t_local / pool.num_workers
    print(f"| {name} | {batch} | {t_local:.3f} | {t:.3f} | {batch / t:,.0f} | {t - ideal:.3f} |")


def hostile(pool, timeout: float, rounds: int) -> None:
  fn = functools.partial(_spin)
  threads0, cpu0 = threading.active_count(), _worker_cpu(pool.pids())
  print(f"\nhostile batches: 32 verifiers each, timeout {timeout} s, batch limit {2 * timeout} s")
  print("| round | kind | wall s | failed | timed out | restarts |")
  print("|---|---|---|---|---|---|")
  for r in range(rounds):
    for kind in ("hang", "spin"):
      start = time.perf_counter()
      res = rewards.score_batch(fn, [{}] * 32, [kind] * 32, timeout_s=timeout, pool=pool)
      wall = time.perf_counter() - start
      print(
        f"| {r + 1} | {kind} | {wall:.2f} | {int(res.failed.sum())} | "
        f"{int(res.timed_out.sum())} | {res.restarts} |"
      )
  pids = pool.pids()
  cpu1 = _worker_cpu(pids)
  time.sleep(2.0)
  cpu2 = _worker_cpu(pids)
  print(
    f"\ntrainer threads before/after: {threads0}/{threading.active_count()}; "
    f"live workers: {len(pids)} (pool size {pool.num_workers}); "
    f"worker CPU in the 2 s after the last batch: {cpu2 - cpu1:.2f} s (new workers, "
    f"so the total before was {cpu0:.2f} s)"
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--workers", type=int, default=0, help="0: one per CPU")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--timeout", type=float, default=2.0)
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  start = time.perf_counter()
  pool = verifiers.VerifierPool(args.workers or None)
  took = time.perf_counter() - start
  print(f"pool of {pool.num_workers} sandboxed workers started in {took:.2f} s\n")
  throughput(pool, args.batch, args.repeats)
  if args.rounds:
    hostile(pool, args.timeout, args.rounds)
  pool.close()


if __name__ == "__main__":
  main()
