"""A timeline model of a step: wall clock per step from measured per-phase costs.

A loop step has a sampler side and a learner side. Measured in a run (its
metrics rows, `from_rows`), a step costs

  S = D + E    the rollout half: D seconds of device work (decode, prefill)
               and E seconds waiting on environments (`episode/env_s`)
  R            host rewards scored after the rollout (`time/reward_s`)
  T            the learning half (`time/train_s`)
  C            moving the parameters to a sampler on its own devices (per publish)
  H            the loop's own share (`time/other_s`)

and a layout (`Layout`) says which of them overlap. The predicted step time:

  sync, shared devices         S + R + T + H
  sync, own sampler devices    S + R + T + C + H          (the sides take turns)
  async, shared devices        max(D + T, S + R) + H      (the devices run D and T in turn;
                                                           environments and rewards overlap)
  async, own sampler devices   max(S + R, T + C) + H      (a pipeline: the slower side sets it)

With k batches in flight (`lag.sampler_threads`, `Layout.inflight`), each
batch's environment waits and rewards overlap the other batches' decoding and
waits (each batch has verifier workers of its own), while the devices still
run every batch's decoding in turn:

  async, shared devices        max(D + T, (S + R) / k) + H
  async, own sampler devices   max(D, (S + R) / k, T + C) + H

Asynchrony needs a staleness bound of at least one step to overlap anything;
with `max_staleness = 0` an async layout is predicted as the sync one. Moving
to another device split scales the device work with the devices each side
gets, ideally (`scaled`): D by sampler devices, T by learner devices; E, R, C
and H stay as measured. Every assumption is in this docstring; what the model
predicted against measured runs is in docs/what_lag_buys.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class PhaseCosts(NamedTuple):
  """Seconds per loop step (module docstring); `env_s` is the part of `sample_s` spent waiting."""

  sample_s: float
  train_s: float
  env_s: float = 0.0
  reward_s: float = 0.0
  sync_s: float = 0.0
  host_s: float = 0.0


class Layout(NamedTuple):
  """How the sides run: `mode` "sync" or "async"; whether the sampler has devices of its own;
  how many batches it samples at once."""

  mode: str = "sync"
  max_staleness: int = 0
  own_sampler_devices: bool = False
  inflight: int = 1  # batches sampled at once (async only)


def check(costs: PhaseCosts, layout: Layout) -> None:
  """Raises ValueError naming the first field that cannot describe a run."""
  for name, value in costs._asdict().items():
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
      raise ValueError(f"timeline: {name} must be a finite number of seconds >= 0, got {value}")
  if costs.env_s > costs.sample_s:
    raise ValueError(
      f"timeline: env_s ({costs.env_s}) is part of sample_s ({costs.sample_s}), not more"
    )
  if layout.mode not in ("sync", "async"):
    raise ValueError(f"timeline: mode must be 'sync' or 'async', got {layout.mode!r}")
  staleness = layout.max_staleness
  if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
    raise ValueError(f"timeline: max_staleness must be an int >= 0, got {staleness!r}")
  k = layout.inflight
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"timeline: inflight must be an int >= 1, got {k!r}")
  if k > 1 and layout.mode != "async":
    raise ValueError(f"timeline: {k} batches in flight need mode 'async', got {layout.mode!r}")
  if k > 1 and layout.max_staleness < k:  # the queued batches would be dropped as too stale
    raise ValueError(f"timeline: {k} batches in flight need max_staleness >= {k}")
  if not isinstance(layout.own_sampler_devices, bool):
    raise ValueError(
      f"timeline: own_sampler_devices must be True or False, got {layout.own_sampler_devices!r}"
    )


def step_time(costs: PhaseCosts, layout: Layout) -> float:
  """The predicted seconds of one loop step (module docstring)."""
  check(costs, layout)
  s, t, e, r, c, h = costs
  device = s - e
  if layout.mode == "sync" or layout.max_staleness == 0:
    return s + r + t + (c if layout.own_sampler_devices else 0.0) + h
  k = layout.inflight
  if layout.own_sampler_devices:
    return max(device, (s + r) / k, t + c) + h
  return max(device + t, (s + r) / k) + h


def scaled(costs: PhaseCosts, sampler_factor: float, learner_factor: float) -> PhaseCosts:
  """The costs with each side's device work divided by its factor (its devices, relative).

  A factor of 2 means twice the devices of the measured run on that side; ideal
  scaling is assumed (module docstring).
  """
  for name, value in (("sampler_factor", sampler_factor), ("learner_factor", learner_factor)):
    if not math.isfinite(value) or value <= 0:
      raise ValueError(f"timeline: {name} must be a finite number > 0, got {value}")
  device = (costs.sample_s - costs.env_s) / sampler_factor
  return costs._replace(sample_s=device + costs.env_s, train_s=costs.train_s / learner_factor)


# Training rows `from_rows` leaves out by default: the first steps compile.
COMPILE_ROWS = 2


def from_rows(rows: Sequence[Mapping[str, Any]], skip: int = COMPILE_ROWS) -> PhaseCosts:
  """Mean per-step costs of a run's training rows (a split or async run: `time/sample_s`).

  The first `skip` rows are left out (compilation). In an async run a row's
  `time/sample_s` is its batch's sampling on the producer thread.

  Raises:
    ValueError: no rows after `skip`, or rows without the phase times (a run
      whose steps are one fused program: `time/device_s` alone cannot be split).
  """
  train = [r for r in rows if "step_time_s" in r][skip:]
  if not train:
    raise ValueError(f"timeline: no training rows after the first {skip}")
  if "time/sample_s" not in train[0]:
    raise ValueError(
      "timeline: the rows have no time/sample_s (a fused step: only time/device_s); "
      "measure a run whose step is split (a host reward or episodes)"
    )

  def mean(key: str) -> float:
    return sum(float(r.get(key) or 0.0) for r in train) / len(train)

  sample = mean("time/sample_s")
  return PhaseCosts(
    sample_s=sample,
    train_s=mean("time/train_s"),
    env_s=min(mean("episode/env_s"), sample),
    reward_s=mean("time/reward_s"),
    sync_s=mean("reshard_time_s"),
    host_s=mean("time/other_s"),
  )


# The layouts a report compares (the first is the reference of the speed-ups).
LAYOUTS = {
  "sync, shared devices": Layout("sync"),
  "async (staleness >= 1), shared devices": Layout("async", 1),
  "sync, own sampler devices": Layout("sync", 0, True),
  "async (staleness >= 1), own sampler devices": Layout("async", 1, True),
  "async, 4 batches in flight, shared devices": Layout("async", 4, False, 4),
}


def report(costs: PhaseCosts, sampler_factor: float = 1.0, learner_factor: float = 1.0) -> str:
  """The predicted step time of each layout of `LAYOUTS`, as `experiments.plan` prints it."""
  costs = scaled(costs, sampler_factor, learner_factor)
  lines = [
    f"devices x{sampler_factor:g} sampler, x{learner_factor:g} learner: per step sample "
    f"{costs.sample_s:.3g} s (environments {costs.env_s:.3g} s), rewards {costs.reward_s:.3g} s, "
    f"train {costs.train_s:.3g} s, sync {costs.sync_s:.3g} s, host {costs.host_s:.3g} s",
    f"{'layout':46s}{'step s':>10s}{'speed-up':>10s}",
  ]
  lines += [f"{n:46s}{t:>10.3g}{x:>9.2f}x" for n, t, x in table(costs, LAYOUTS)]
  return "\n".join(lines)


def table(costs: PhaseCosts, layouts: Mapping[str, Layout]) -> list[tuple[str, float, float]]:
  """`(name, predicted step seconds, speed-up over the first layout)` of each layout."""
  times = [(name, step_time(costs, layout)) for name, layout in layouts.items()]
  first = times[0][1]
  return [(name, t, first / t if t else float("inf")) for name, t in times]
