"""Host memory over many short runs in one process (what an inline sweep or a study does).

Trains `--runs` short runs of the default task one after another in this
process (each its own workdir and seed, its own warm start) and prints the
resident memory (VmRSS), threads and open files after each. A process that
releases what each run built keeps its memory flat after the first runs; the
growth from run 2 to the last, divided by the runs, is what each run leaves
behind.

  python benchmarks/runs_memory.py [--runs 20] [--steps 4] [--losses grpo,cispo,...]

With `--losses`, run i trains loss `losses[i % len(losses)]`: every run then
builds and compiles its own programs, as the runs of a sweep over methods do.
Memory mappings (`/proc/self/maps` lines) are printed too: XLA's CPU backend
maps each compiled program's code, and a process that never releases old
programs runs out of mappings (`vm.max_map_count`) long before memory.
"""

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from offpolicy_jax.run import loop  # noqa: E402


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def config(seed: int, steps: int, loss: str | None, sft_steps: int = 20):
  c = default.get_config()
  c.seed = seed
  if loss:
    c.loss.name = loss
  c.total_steps = steps
  c.sft.steps = sft_steps
  c.eval_prompts = 8
  c.eval_every = 0
  c.checkpoint_every = steps
  c.progress = False
  c.tensorboard = True
  return c


def measure(runs: int, steps: int, losses: list[str], sft_steps: int = 20, log=print) -> list[dict]:
  """Trains `runs` runs here one after another; after each: rss (MB), maps, threads, files."""
  after = []
  with tempfile.TemporaryDirectory() as root:
    for i in range(runs):
      begin = time.perf_counter()
      loss = losses[i % len(losses)] if losses else None
      c = config(i, steps, loss, sft_steps)
      loop.train_and_evaluate(c, os.path.join(root, f"run{i}"))
      row = dict(
        rss=rss_mb(),
        maps=maps(),
        threads=threading.active_count(),
        files=len(os.listdir("/proc/self/fd")),
        seconds=time.perf_counter() - begin,
      )
      after.append(row)
      log(
        f"run {i + 1:3d}: rss {row['rss']:7.1f} MB, maps {row['maps']:6d}, threads "
        f"{row['threads']:3d}, open files {row['files']:4d}, {row['seconds']:5.1f} s"
      )
  return after


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--runs", type=int, default=20)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--sft_steps", type=int, default=20)
  parser.add_argument("--losses", default="", help="Comma-separated loss presets to cycle.")
  args = parser.parse_args()
  losses = [x for x in args.losses.split(",") if x]
  after = measure(args.runs, args.steps, losses, args.sft_steps, lambda s: print(s, flush=True))
  rss = [row["rss"] for row in after]
  if len(rss) >= 3:
    per_run = (rss[-1] - rss[1]) / (len(rss) - 2)
    print(
      f"growth from run 2 to run {len(rss)}: {rss[-1] - rss[1]:.1f} MB ({per_run:.1f} MB per run)"
    )


if __name__ == "__main__":
  main()
