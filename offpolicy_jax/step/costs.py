"""Cost accounting: what a run has spent so far, in tokens and in seconds per side.

Every training row of a run carries its running totals (docs/metrics.md),
summed from the per-step fields the drivers and the producer record. Tokens
are under `cost/`; seconds are under `time/run_` beside `time/run_wall_s`,
the run's wall clock (every command's):

  cost/sampled_tokens         response tokens of the rows the rollouts finished (policy
                              tokens: an episode's observations are not sampled), and of
                              batches an async run dropped as too stale
  cost/sampled_prompt_tokens  prompt tokens of those rows' groups (one prefill per group)
  cost/trained_tokens         tokens the learner trained on, once per optimizer step
  time/run_sampler_busy_s     the sampler at work: split steps' rollout half until its rows
                              are ready (`time/sample_s`), or the async producer's sampling
  time/run_learner_busy_s     the learner at work (`time/train_s`)
  time/run_device_busy_s      steps that are one fused program (`time/device_s`): sampling
                              and learning share it, so it is busy time of both sides
  time/run_reward_wait_s      steps waiting for host rewards after their rollout
                              (`time/reward_s`; an async producer's are in its sampling)
  time/run_environment_s      episode environments answering (`episode/env_s`)
  time/run_sync_s             parameters moving to a disaggregated sampler (`reshard_time_s`)
  time/run_sampler_idle_s     wall - sampler busy - device busy: the sampler's bubble
  time/run_learner_idle_s     wall - learner busy - device busy: the learner's bubble

The totals are saved in each checkpoint's meta and a resume continues from
them, so steps run again after a crash are counted once (their first run's
seconds are in the wall clock only, like the rest of the time a crash loses).
Token totals are a pure function of the run's steps: a resumed run writes
the same ones as an uninterrupted run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple


class Costs(NamedTuple):
  """A run's running totals (module docstring); all 0 for a fresh run."""

  sampled_tokens: float = 0.0
  sampled_prompt_tokens: float = 0.0
  trained_tokens: float = 0.0
  sampler_busy_s: float = 0.0
  learner_busy_s: float = 0.0
  device_busy_s: float = 0.0
  reward_wait_s: float = 0.0
  environment_s: float = 0.0
  sync_s: float = 0.0


def of_row(row: Mapping[str, Any]) -> Costs:
  """One step's costs, from its metrics row (a field the row lacks counts 0).

  An async row's sampler time is the producer's since the previous step
  (`async_sampler_busy_s`, dropped batches included), not its batch's alone.
  """

  def get(k: str) -> float:
    return float(row.get(k) or 0.0)

  sampler = "async_sampler_busy_s" if "async_sampler_busy_s" in row else "time/sample_s"
  return Costs(
    sampled_tokens=get("sampled_tokens") + get("async_dropped_tokens"),
    sampled_prompt_tokens=get("sampled_prompt_tokens"),
    trained_tokens=get("tokens"),
    sampler_busy_s=get(sampler),
    learner_busy_s=get("time/train_s"),
    device_busy_s=get("time/device_s"),
    reward_wait_s=get("time/reward_s"),
    environment_s=get("episode/env_s"),
    sync_s=get("reshard_time_s"),
  )


def add(total: Costs, step: Costs) -> Costs:
  return Costs(*(a + b for a, b in zip(total, step, strict=True)))


def key(name: str) -> str:
  """The row key of total `name`: `cost/<name>` for tokens, `time/run_<name>` for seconds."""
  return f"time/run_{name}" if name.endswith("_s") else f"cost/{name}"


def fields(total: Costs, wall_s: float | None) -> dict[str, float]:
  """A row's totals, and each side's idle seconds when the run's wall clock is known."""
  out = {key(name): value for name, value in total._asdict().items()}
  if wall_s is not None:
    out[key("sampler_idle_s")] = wall_s - total.sampler_busy_s - total.device_busy_s
    out[key("learner_idle_s")] = wall_s - total.learner_busy_s - total.device_busy_s
  return out


def to_meta(total: Costs) -> dict[str, float]:
  """The totals as a checkpoint's meta records them."""
  return total._asdict()


def from_meta(meta: Mapping[str, Any] | None) -> Costs | None:
  """The totals a checkpoint recorded; None when it predates cost accounting.

  Raises:
    ValueError: the record is not a mapping of exactly `Costs`' totals, each a
      finite number >= 0 (a missing total is not taken as 0).
  """
  if meta is None:
    return None
  if not isinstance(meta, Mapping):
    raise ValueError(f"checkpoint meta 'costs': not a record of totals ({type(meta).__name__})")
  unknown = sorted(set(meta) - set(Costs._fields))
  if unknown:
    raise ValueError(f"checkpoint meta 'costs': unknown totals {unknown}")
  missing = [k for k in Costs._fields if k not in meta]
  if missing:
    raise ValueError(f"checkpoint meta 'costs': totals {missing} are missing")
  bad = [
    k
    for k, v in meta.items()
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0
  ]
  if bad:
    raise ValueError(f"checkpoint meta 'costs': {bad} are not finite numbers >= 0")
  return Costs(**{k: float(v) for k, v in meta.items()})
