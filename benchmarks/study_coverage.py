"""How often the study's intervals and tests are wrong, simulated at the study's seed counts.

For n = 5, 8 and 12 seeds and per-seed differences drawn from a normal, a
skewed (centred exponential) and a heavy-tailed (Student t, 3 degrees of
freedom) distribution, `--sets` simulated studies each give:

- the coverage of the 95% t interval the tables print (`stats.interval`) and
  of the percentile bootstrap it replaced (`stats.bootstrap`): how often the
  interval contains the true mean;
- the false-verdict rate of the sign-flip permutation test at 0.05 when the
  true mean is 0;
- the false-equivalence rate of the equivalence test (two one-sided t tests
  at 0.05) when the true mean sits exactly on the margin (nominal: at most
  0.05), with the margin one standard deviation of the differences.

  python benchmarks/study_coverage.py [--sets 2000]

Prints one markdown table (docs/results/lag_study.md keeps it).
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax.study import stats  # noqa: E402

DISTRIBUTIONS = {
  "normal": lambda rng, size: rng.normal(size=size),
  "skewed": lambda rng, size: rng.exponential(size=size) - 1.0,  # mean 0, sd 1
  "heavy (t3)": lambda rng, size: rng.standard_t(3, size=size) / np.sqrt(3.0),  # sd 1
}


def simulate(n: int, draw, sets: int, seed: int) -> dict[str, float]:
  rng = np.random.default_rng(seed)
  d = draw(rng, (sets, n))
  t_cover = np.mean([stats.t_interval(x).contains(0.0) for x in d])
  boot_cover = np.mean([stats.bootstrap(x, seed=i).contains(0.0) for i, x in enumerate(d)])
  flips = np.mean([stats.sign_flip_pvalue(x) <= 0.05 for x in d])
  margin = 1.0  # the differences' standard deviation; true mean on the margin
  false_eq = np.mean([stats.equivalence_pvalue(x + margin, margin) <= 0.05 for x in d])
  return {"t": t_cover, "bootstrap": boot_cover, "sign_flip": flips, "tost": false_eq}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--sets", type=int, default=2000)
  args = parser.parse_args()
  begin = time.perf_counter()
  print(
    "| differences | seeds | t interval covers | bootstrap covers | sign-flip false verdicts "
    "| false equivalence (mean on the margin) |"
  )
  print("|---|---|---|---|---|---|")
  for i, (name, draw) in enumerate(DISTRIBUTIONS.items()):
    for n in (5, 8, 12):
      r = simulate(n, draw, args.sets, seed=100 * i + n)
      print(
        f"| {name} | {n} | {r['t']:.3f} | {r['bootstrap']:.3f} | {r['sign_flip']:.3f} "
        f"| {r['tost']:.3f} |",
        flush=True,
      )
  se = np.sqrt(0.05 * 0.95 / args.sets)
  print(
    f"\n{args.sets} simulated studies per row; two standard errors near 0.95 or 0.05: "
    f"{2 * se:.3f}; {time.perf_counter() - begin:.0f} s"
  )


if __name__ == "__main__":
  main()
