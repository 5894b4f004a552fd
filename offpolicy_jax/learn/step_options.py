"""`StepOptions`: the train step's static settings, and their checks; `LearnerParts`."""

import dataclasses
from typing import NamedTuple

import optax

from offpolicy_jax import losses
from offpolicy_jax.learn.critic import CriticSpec


class StepOptions(NamedTuple):
  """Static settings of the train step (hashable, so a jit static argument).

  Attributes:
    spec: the policy loss.
    num_micro_batches: gradient-accumulation micro-batches per optimizer step.
    micro_batch_size: rows per micro-batch; overrides ``num_micro_batches``.
    num_minibatches: optimizer steps per epoch over the batch.
    num_epochs: passes over the batch, reshuffled each epoch.
    temperature: sampling temperature the log-probs are computed at.
    group_size: K, rows per prompt; batches are group-major (row ``g * K + k``).
    shared_prefix: run each group's prompt once and let its K responses attend
      to it (`models.shared_prefix_logprobs`); micro-batches and minibatch
      shuffles then move whole groups.
    skip_zero_advantage: leave rows whose advantages are all 0 out of the
      forward and backward passes when the loss makes that exact
      (``spec.zero_advantage_inert``; ignored otherwise).
    skip_chunks: with skipping, each micro-batch is cut into this many chunks
      (fewer where they do not divide) and only chunks holding rows that move
      the loss run.
    truncated: score the top-k / top-p truncated distribution the sampler drew
      from, given each token's kept-set size ``TrainBatch.behavior_kept``
      (`models.logprobs`); False scores the full tempered softmax (no
      truncation, or ``rollout.behavior_logp = "full"``).
    top_k: the sampler's top-k (0 = off), which bounds the kept set when truncated.
    router_aux_coef: the load-balancing loss's coefficient for a model with
      experts (`models.moe`; a dense model ignores it, 0 turns it off).
    routing_replay: "off", "record" (batches carry the sampler's experts; the
      learner routes by its own router and reports how often they agree) or
      "replay" (the learner routes along them, R3; `models.moe`).
    critic: the value head's training and the token advantages it makes
      (`learn.critic`), or None: the batch's group advantages.
  """

  spec: losses.LossSpec
  num_micro_batches: int = 1
  micro_batch_size: int | None = None
  num_minibatches: int = 1
  num_epochs: int = 1
  temperature: float = 1.0
  group_size: int = 1
  shared_prefix: bool = False
  skip_zero_advantage: bool = False
  skip_chunks: int = 4
  truncated: bool = False
  top_k: int = 0
  router_aux_coef: float = 0.0
  routing_replay: str = "off"
  critic: CriticSpec | None = None

  @property
  def needs_ref(self) -> bool:
    """Whether the step reads the reference policy's log-probs: a KL-to-reference loss
    (`LossSpec.needs_ref`) or a critic whose rewards carry a KL penalty (`CriticSpec.kl_coef`)."""
    return self.spec.needs_ref or (self.critic is not None and self.critic.kl_coef > 0)

  @property
  def updates(self) -> int:
    """Optimizer steps per batch, U."""
    return self.num_minibatches * self.num_epochs

  @property
  def unit(self) -> int:
    """Rows that stay together in micro-batches and shuffles: a group with a shared prefix."""
    return self.group_size if self.shared_prefix else 1

  @property
  def skips_rows(self) -> bool:
    """Whether zero-advantage rows are left out (asked for, and exact for the loss).

    Never with a critic: its advantages are not the batch's, and every row trains the values.
    """
    return self.skip_zero_advantage and self.spec.zero_advantage_inert and self.critic is None


@dataclasses.dataclass(frozen=True, eq=False)
class LearnerParts:
  """The learner half of a run's static parts (`run_state.StepFns.learner`).

  Versions count optimizer steps: the train step takes U of them per loop
  step, so the batch of loop step t records version `t * U` (`version`, the
  one place of that unit).
  """

  options: StepOptions
  optimizer: optax.GradientTransformation

  @property
  def reward_stats(self) -> bool:
    """Whether the train state keeps running reward statistics (`critic.reward_norm`)."""
    return self.options.critic is not None and self.options.critic.reward_norm

  def version(self, loop_step):
    """The parameter version (optimizer steps) after loop step `loop_step`: `loop_step * U`."""
    return loop_step * self.options.updates


def check_options(options: StepOptions) -> None:
  """Raises ValueError naming the field for invalid settings."""
  for name in ("num_micro_batches", "num_minibatches", "num_epochs", "group_size", "skip_chunks"):
    if getattr(options, name) < 1:
      raise ValueError(f"{name} must be >= 1, got {getattr(options, name)}")
  if options.top_k < 0:
    raise ValueError(f"top_k must be >= 0, got {options.top_k}")
  if options.micro_batch_size is not None and options.micro_batch_size < 1:
    raise ValueError(f"micro_batch_size must be >= 1, got {options.micro_batch_size}")
