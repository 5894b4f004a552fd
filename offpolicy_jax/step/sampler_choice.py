"""Automatic continuous batching: measure the static batch's decode waste, then choose once.

Continuous batching (`sampling.continuous`) pays when response lengths vary:
the static batch decodes every row until the longest one ends. Whether they
vary is known only once the run samples, so with
`rollout.continuous_auto_steps = W > 0` the run samples its first W steps
with the static batch, each row logging `sampler/decode_waste` (the fraction
of decoded row-steps after a row had ended, `protocol.decode_waste`). After
step W the mean over steps 1..W is compared with
`rollout.continuous_waste_threshold`: above it, steps W+1.. sample with the
continuous sampler (`StepFns.continuous`, `rollout.continuous_slots` slots),
otherwise the static batch stays. Every row carries `sampler/continuous` (0
or 1); row W also `sampler/auto_waste`, the mean the choice was made on.

Deterministic and exact on resume: the waste values are functions of the
sampled lengths, which a sync-mode run reproduces exactly; the values seen so
far and the choice are saved in every checkpoint's meta (`state`), so a run
resumed before step W completes the same mean and one resumed after it keeps
the choice; the loop ends a chunk at step W and does not prefetch step W+1's
rollout, so the switch step does not depend on the log, eval or checkpoint
cadence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from offpolicy_jax.step.run_state import StepFns


def continuous_fns(fns: StepFns) -> StepFns:
  """`fns` sampling with its continuous sampler (the same object for the same `fns`)."""
  if fns.continuous is None:
    raise ValueError("this run has no continuous sampler (rollout.continuous_slots = 0)")
  if fns.sampler is fns.continuous:
    return fns
  # Kept in the run's memo, so runs sharing `fns` share the switched one (and its
  # compiled programs), and it goes with `fns` (a module-level dict kept both forever).
  if "continuous" not in fns.memo:
    continuous = fns.rollout.with_sampler(fns.continuous)
    fns.memo["continuous"] = dataclasses.replace(fns, sampler=fns.continuous, rollout=continuous)
  return fns.memo["continuous"]


def is_continuous(fns: StepFns) -> bool:
  """Whether `fns` samples with continuous batching."""
  return fns.continuous is not None and fns.sampler is fns.continuous


class SamplerChoice:
  """The automatic choice of a run (module docstring); a no-op when W = 0.

  Args:
    fns: the run's step functions as built (`components.build_components`).
    threshold: `rollout.continuous_waste_threshold`.
    saved: `state()` from the checkpoint the run resumes from, or None.
  """

  def __init__(self, fns: StepFns, threshold: float, saved: dict[str, Any] | None = None):
    self.steps = 0 if is_continuous(fns) else fns.continuous_auto_steps
    self.threshold = float(threshold)
    saved = saved or {}
    self.waste: list[float] = [float(w) for w in saved.get("waste", [])]
    self.continuous: bool | None = saved.get("continuous")

  @property
  def auto(self) -> bool:
    return self.steps > 0

  def fns(self, fns: StepFns) -> StepFns:
    """The step functions to sample with now (`fns`, or `fns` switched to continuous)."""
    return continuous_fns(fns) if self.auto and self.continuous else fns

  def pending(self, step: int) -> bool:
    """Whether the choice is still open after loop step `step` (its rollouts stay static)."""
    return self.auto and self.continuous is None and step <= self.steps

  def chunk(self, step: int, length: int) -> int:
    """A chunk after `step` cut so that it ends at step W while the choice is open."""
    return min(length, self.steps - step) if self.pending(step) and step < self.steps else length

  def observe(self, step: int, row: dict[str, Any]) -> bool:
    """Records step `step`'s row (adds the choice's fields); True when the run switches now."""
    if not self.pending(step):
      return False
    if len(self.waste) != step - 1:
      raise RuntimeError(
        f"sampler choice: step {step} after {len(self.waste)} recorded waste values"
      )
    self.waste.append(float(row["sampler/decode_waste"]))
    if step < self.steps:
      return False
    mean = sum(self.waste) / len(self.waste)
    self.continuous = mean > self.threshold
    row["sampler/auto_waste"] = mean
    return self.continuous

  def state(self) -> dict[str, Any] | None:
    """What a checkpoint keeps of the choice (None without the automatic choice)."""
    return {"waste": list(self.waste), "continuous": self.continuous} if self.auto else None
