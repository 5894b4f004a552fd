r"""Turns one or more workdirs into a PNG of training curves.

python -m experiments.plot --workdirs=/tmp/a,/tmp/b [--labels=a,b] --out=/tmp/curves.png
"""

import os

from absl import app, flags

from offpolicy_jax import metrics

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Run directories holding metrics.jsonl.")
_LABELS = flags.DEFINE_list("labels", None, "Curve labels (default: workdir basenames).")
_OUT = flags.DEFINE_string("out", "curves.png", "Output PNG path.")
_SMOOTH = flags.DEFINE_integer("smooth", 5, "Moving-average window over steps.")
flags.mark_flag_as_required("workdirs")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  labels = _LABELS.value or [os.path.basename(os.path.normpath(w)) for w in _WORKDIRS.value]
  if len(labels) != len(_WORKDIRS.value):
    raise app.UsageError("--labels must have one entry per --workdirs entry")
  path = metrics.plot_runs(
    dict(zip(labels, _WORKDIRS.value, strict=True)), _OUT.value, smooth=_SMOOTH.value
  )
  print(path)


if __name__ == "__main__":
  app.run(main)
