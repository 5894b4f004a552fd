"""Checks of the benchmark scripts' shared flags, run before any work.

Each failure is `parser.error`: one line naming the flag, exit status 2, so a
long benchmark never runs its first half on a flag its second half rejects.
"""

import argparse
import math
import os

from offpolicy_jax import models


def check(
  parser: argparse.ArgumentParser,
  args: argparse.Namespace,
  *,
  presets: tuple[str, ...] = (),
  positive: tuple[str, ...] = (),
  rows: tuple[str, ...] = (),
) -> None:
  """Refuses unknown presets, flags under 1, a `--micro_batch` that does not divide the rows,
  and a `--json` (where the script has it) in a directory that does not exist.

  Args:
    presets: the preset names the run will build (`models.preset_names()`).
    positive: flags that must be >= 1.
    rows: the flags whose product is a batch's rows, which `--micro_batch` must divide.
  """
  known = models.preset_names()
  for preset in presets:
    if preset not in known:
      parser.error(f"unknown preset {preset!r}; choose from {known}")
  for name in positive:
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if rows:
    n = math.prod(getattr(args, name) for name in rows)
    if n % args.micro_batch:
      by = " x ".join(f"--{name}" for name in rows)
      parser.error(f"--micro_batch {args.micro_batch} does not divide the {n} rows ({by})")
  out = getattr(args, "json", "")
  if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
    parser.error(f"--json: no directory {os.path.dirname(os.path.abspath(out))!r}")
