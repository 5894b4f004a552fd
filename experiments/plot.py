r"""Draws training curves of workdirs, or redraws a study's plots from its CSV.

python -m experiments.plot --workdirs=/tmp/a,/tmp/b [--labels=a,b] --out=/tmp/curves.png
python -m experiments.plot --study_csv=DIR/study.csv --out=DIR [--baseline=grpo@onpolicy]

The second form writes `curves_<lag>.png`, `final.png` and, when the runs
record their costs, `pareto.png` into the `--out` directory (see
`offpolicy_jax.study.report`).
"""

import os
import sys

from absl import app, flags

from offpolicy_jax import cli
from offpolicy_jax.study import reports

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Run directories holding metrics.jsonl.")
_LABELS = flags.DEFINE_list("labels", None, "Curve labels (default: workdir basenames).")
_OUT = flags.DEFINE_string("out", "curves.png", "Output PNG path (a directory with --study_csv).")
_SMOOTH = flags.DEFINE_integer(
  "smooth", 5, "Moving-average window over steps (staleness: rounded up to whole sync cycles)."
)
_STUDY_CSV = flags.DEFINE_string("study_csv", None, "A study.csv to redraw the study's plots from.")
_BASELINE = flags.DEFINE_string("baseline", "grpo@onpolicy", "The study's baseline <method>@<lag>.")


def _study(path: str, out_dir: str) -> list[str]:
  method, sep, lag = _BASELINE.value.partition("@")
  if not sep:
    raise ValueError(f"--baseline: {_BASELINE.value!r} is not <method>@<lag>")
  from offpolicy_jax.study import report as study_report  # imports JAX: only for a study

  rows = study_report.read_csv(path)
  os.makedirs(out_dir, exist_ok=True)
  return study_report.plot_study(rows, out_dir, baseline=(method, lag))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _STUDY_CSV.value:
    try:
      paths = _study(_STUDY_CSV.value, _OUT.value)
    except (OSError, ValueError) as e:
      print(f"error: --study_csv {_STUDY_CSV.value}: {e}", file=sys.stderr)
      return 1
    print(*paths, sep="\n")
    return 0
  if not _WORKDIRS.value:
    raise app.UsageError("give --workdirs (training curves) or --study_csv (a study's plots)")
  labels = _LABELS.value or [os.path.basename(os.path.normpath(w)) for w in _WORKDIRS.value]
  if len(labels) != len(_WORKDIRS.value):
    raise app.UsageError("--labels must have one entry per --workdirs entry")
  path = reports.plot_runs(
    dict(zip(labels, _WORKDIRS.value, strict=True)), _OUT.value, smooth=_SMOOTH.value
  )
  print(path)


if __name__ == "__main__":
  cli.run(main)
