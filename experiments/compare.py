r"""Compares a sweep's seeded runs with a baseline group: what each setting buys.

python -m experiments.compare --workdir=DIR --baseline=sync [--margin=0.05] [--alpha=0.05]

`DIR` holds runs named `<group>-s<seed>` (a sweep of `configs/what_lag_buys.py`,
say). Writes `DIR/compare.md` (per group: final accuracy, steps, training
seconds and sampled tokens to the threshold, totals; paired differences and
ratios to the baseline with Holm verdicts), `DIR/compare.csv` (every run's
values) and `DIR/pareto.png`; see `offpolicy_jax.study.paired_runs`.
"""

import sys

from absl import app, flags

from offpolicy_jax import cli, errors
from offpolicy_jax.study import paired_runs

_WORKDIR = flags.DEFINE_string("workdir", None, "The sweep's directory (runs <group>-s<seed>).")
_BASELINE = flags.DEFINE_string("baseline", None, "The group every other is compared with.")
_MARGIN = flags.DEFINE_float(
  "margin", None, "Equivalence margin of final accuracy (declare it before looking)."
)
_ALPHA = flags.DEFINE_float("alpha", 0.05, "Family-wise error rate of each table (Holm).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value or not _BASELINE.value:
    raise app.UsageError("give --workdir and --baseline")
  if _MARGIN.value is not None and not _MARGIN.value > 0:
    print(f"error: --margin must be > 0, got {_MARGIN.value}", file=sys.stderr)
    return 1
  try:
    paths = paired_runs.write(
      _WORKDIR.value, _BASELINE.value, margin=_MARGIN.value, alpha=_ALPHA.value
    )
  except errors.UserError:
    raise  # printed as one line by `cli.run`
  except ValueError as e:  # a baseline that is no group, or an alpha out of (0, 1)
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(*paths.values(), sep="\n")
  return 0


if __name__ == "__main__":
  cli.run(main)
