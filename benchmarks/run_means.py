"""Per-run means of metrics over a set of single runs, one CSV row per run (its per-run data).

  python benchmarks/run_means.py --workdirs 'DIR/*-s*' \\
      --keys mismatch_kl_k3,moe/router_agreement > runs.csv

Each workdir named `<group>-s<seed>` (as `experiments.sweep` names them, or by
hand) gives one row: its group and seed, its training rows, the mean of each
key over the training rows that hold it, and the first and last
`eval/accuracy`. What `docs/results/routing_replay.md`'s bf16-sampler probe
keeps.
"""

import argparse
import csv
import glob
import os
import sys

import numpy as np

from offpolicy_jax.store import metrics_files


def run_row(workdir: str, keys: list[str]) -> dict:
  """One run's row (module docstring)."""
  rows = metrics_files.read_metrics(workdir)
  train, evals = metrics_files.split_rows(rows)
  group, _, seed = os.path.basename(os.path.normpath(workdir)).rpartition("-s")
  out: dict = {"group": group, "seed": int(seed), "steps": len(train)}
  for key in keys:
    values = [r[key] for r in train if key in r]
    out[key] = float(np.mean(values)) if values else float("nan")
  accuracy = [r["eval/accuracy"] for r in evals if "eval/accuracy" in r]
  out["start_accuracy"] = accuracy[0] if accuracy else float("nan")
  out["final_accuracy"] = accuracy[-1] if accuracy else float("nan")
  return out


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdirs", required=True, help="a glob of run workdirs <group>-s<seed>")
  parser.add_argument("--keys", required=True, help="comma-separated metric keys")
  args = parser.parse_args(argv)
  dirs = sorted(d for d in glob.glob(args.workdirs) if os.path.isdir(d))
  if not dirs:
    parser.error(f"--workdirs: no directory matches {args.workdirs!r}")
  bad = [d for d in dirs if not os.path.basename(os.path.normpath(d)).rpartition("-s")[2].isdigit()]
  if bad:
    parser.error(f"--workdirs: {bad[0]!r} is not named <group>-s<seed>")
  rows = [run_row(d, args.keys.split(",")) for d in dirs]
  writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
  writer.writeheader()
  writer.writerows(rows)
  return rows


if __name__ == "__main__":
  main()
