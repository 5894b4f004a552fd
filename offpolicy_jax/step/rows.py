"""A step's metrics row, put together in one place (`step_row`).

A step's row holds the jitted step's device metrics, the host's per-seed
metrics (the sandboxed rewards' counts, a host rollout's own metrics), the
step's shared fields (what reading its prompts logged, the async sampler's
counts) and the host's seconds (`time/*`). Each driver (`step.drivers`:
fused, split, async) gathers its parts and calls `step_row` once per step;
the loop adds the run's own fields (`run.loop`: step time, costs, compiles).
Every key is declared in `metric_names`. With a study's stacked seeds each
per-seed metric is an array [S] (`seeds.Seeds`); shared fields and times stay
scalars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from offpolicy_jax.step.seeds import Seeds
from offpolicy_jax.store import metrics


def step_row(
  seeds: Seeds,
  device: Mapping[str, Any],
  host: Sequence[Mapping[str, Any]] | None = None,
  *,
  fields: Mapping[str, Any] | None = None,
  times: Mapping[str, float] | None = None,
) -> dict[str, Any]:
  """One step's row.

  Args:
    seeds: the runs the step advanced.
    device: the step's device metrics, fetched: one run's, or each [S].
    host: each seed's host metrics (S mappings), or None.
    fields: the step's fields shared by its seeds, written as they are.
    times: the host's seconds (and counts) of the step's phases, written as
      `time/<name>`.

  Returns:
    The row: Python values for one run; for stacked seeds each per-seed
    metric an array [S].
  """
  row: dict[str, Any]
  if seeds.stacked:
    row = {k: np.asarray(v) for k, v in device.items()}
  else:
    row = {k: metrics.to_python(v) for k, v in device.items()}
  if host is not None:
    row.update(seeds.row([{k: metrics.to_python(x) for k, x in h.items()} for h in host]))
  row.update(fields or {})
  row.update({f"time/{k}": v for k, v in (times or {}).items()})
  return row
