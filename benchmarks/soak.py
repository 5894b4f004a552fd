"""Soak test of the main job: host memory, recompiles, threads, processes and open files.

Runs the default job (configs/default.py, its warm start included, checkpoints
every 100 steps, evaluation every 500) for `--steps` loop steps in one process and
samples, after every step: the process's resident memory (VmRSS), the number
of XLA compilations (`jax.monitoring` backend-compile events), threads, open
file descriptors and child processes. Prints the samples at a few points and
the growth between the end of the warm-up (`--warmup` steps) and the end.

  python benchmarks/soak.py [--steps 2000] [--warmup 200] [--workdir DIR] [--task reverse]

A flat run shows RSS growth well under 5% after warm-up, no compilation after
warm-up, and constant threads, children and open files.
"""

import argparse
import os
import sys
import tempfile
import threading
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from offpolicy_jax.run import loop  # noqa: E402


def _rss_mib() -> float:
  with open("/proc/self/status") as f:
    kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
  return kib / 1024


def _children() -> int:
  me, n = str(os.getpid()), 0
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/stat") as f:
          n += f.read().rsplit(")", 1)[1].split()[1] == me
      except (FileNotFoundError, ProcessLookupError):
        pass
  return n


def _sample(step: int, compiles: list) -> dict:
  return {
    "step": step,
    "rss_mib": _rss_mib(),
    "compiles": len(compiles),
    "threads": threading.active_count(),
    "os_threads": len(os.listdir("/proc/self/task")),
    "open_files": len(os.listdir("/proc/self/fd")),
    "children": _children(),
    "time_s": time.perf_counter(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--warmup", type=int, default=200)
  parser.add_argument("--workdir", default="")
  parser.add_argument("--task", default="reverse")
  args = parser.parse_args()
  cfg = default.get_config()
  cfg.task = args.task
  cfg.total_steps = args.steps
  cfg.checkpoint_every = 100
  cfg.eval_every = 500
  cfg.progress = False
  compiles: list = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  samples: list[dict] = []
  workdir = args.workdir or tempfile.mkdtemp(prefix="opj_soak_")
  start = time.perf_counter()
  loop.train_and_evaluate(cfg, workdir, on_step=lambda t, _: samples.append(_sample(t, compiles)))
  print(
    f"{args.steps} steps of the default job ({args.task}) in {time.perf_counter() - start:.0f} s"
  )
  keys = ("rss_mib", "compiles", "threads", "os_threads", "open_files", "children")
  print("| step | " + " | ".join(keys) + " |")
  print("|---" * (len(keys) + 1) + "|")
  marks = {1, args.warmup, args.steps // 2, args.steps} | set(range(0, args.steps + 1, 500))
  for s in samples:
    if s["step"] in marks:
      print(f"| {s['step']} | " + " | ".join(f"{s[k]:.0f}" for k in keys) + " |")
  a = next(s for s in samples if s["step"] == args.warmup)
  b = samples[-1]
  growth = 100 * (b["rss_mib"] - a["rss_mib"]) / a["rss_mib"]
  print(
    f"\nafter warm-up (step {args.warmup} -> {b['step']}): RSS {a['rss_mib']:.0f} -> "
    f"{b['rss_mib']:.0f} MiB ({growth:+.1f}%), compilations +{b['compiles'] - a['compiles']}, "
    f"threads {a['os_threads']} -> {b['os_threads']}, open files {a['open_files']} -> "
    f"{b['open_files']}, child processes {a['children']} -> {b['children']}"
  )


if __name__ == "__main__":
  main()
