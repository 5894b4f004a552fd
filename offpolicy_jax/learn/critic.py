"""The critic in the train step: per-token values, returns and advantages, and the value loss.

With `StepOptions.critic` (a `CriticSpec`) the model carries a value head on
its trunk (`models.value`) and the one forward pass of each micro-batch gives
the policy's log-probs and the critic's values V(s_t) at every response token
(`models.logprobs.Scored`). Each row's reward is paid at its last policy token
(`returns.token_rewards`; a multi-turn row's environment tokens have mask 0
and take no part), or, under `multiturn.credit = "turn"`, each turn's reward at
that turn's last policy token (`TrainBatch.token_rewards`); with `kl_coef` > 0
every policy token also pays
-kl_coef (log mu - log pi_ref), the behaviour's k1 estimate of its KL to the
reference policy (the run's starting parameters), as in PPO for language
models (`returns.kl_penalized_rewards`: Ziegler et al., arXiv:1909.08593;
"Secrets of RLHF"'s token-level KL). With `reward_norm` the rows' rewards are
first normalised and clipped by their running statistics over the run
(`normalized_rewards`, kept in `TrainState.reward_stats`). The policy loss
reads token advantages [B, N] from the critic instead of the group's:

- ``gae`` (PPO with a learned critic: "Secrets of RLHF in Large Language Models
  Part I: PPO", Zheng et al., arXiv:2307.04964): before the call's first
  update, the values V_old of the whole batch at the parameters the call
  starts from (the freshest critic there is, whatever version sampled the
  batch) give GAE advantages and lambda-returns R (`returns.gae`), whitened
  over the batch's valid tokens when `whiten`; every optimizer step of the
  call trains on them, the value loss clipped around V_old (PPO2):

    L_V = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

- ``vtrace`` (IMPALA, Espeholt et al., arXiv:1802.01561): in each micro-batch,
  from the current values (stop-gradient) and rho_t = pi / mu between the
  current policy and the behaviour's recorded log-probs, the targets v_s and
  the policy-gradient advantages min(rho_bar, rho_t)(r_t + gamma v_{s+1} - V_t)
  (`returns.vtrace`); L_V = 1/2 (V - v_s)^2. The truncated importance weight
  is inside the advantage, so the loss should not weight by rho again (the
  `vtrace` loss preset is plain REINFORCE on them).

The value loss enters the loss sum as ``value_coef`` times its mean over the
micro-batch's valid, weighted tokens times the policy loss's count, so it
accumulates like the policy loss (exactly, under token-mean aggregation).
The explained variance 1 - Var(R - V) / Var(R) over valid tokens is computed
from token means after the step's reductions (`explained_variance`), with
both variances, so that many steps pool into one ratio (`pooled_explained_variance`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from offpolicy_jax import reductions as red
from offpolicy_jax import returns
from offpolicy_jax.types import TrainBatch

ESTIMATORS = ("gae", "vtrace")
# Token means `explained_variance` combines (with `critic/return_mean`); not rows of their own.
_EV_PARTS = ("critic/_r2", "critic/_d", "critic/_d2")


@dataclasses.dataclass(frozen=True)
class CriticSpec:
  """How the critic trains and makes advantages (hashable: part of `StepOptions`).

  Attributes:
    estimator: ``gae`` or ``vtrace`` (module docstring).
    gamma: discount per policy token, in [0, 1].
    lam: GAE's lambda, or V-trace's trace lambda, in [0, 1].
    value_coef: the value loss's weight against the policy loss, > 0.
    value_clip: c of the clipped value loss (``gae``; 0 = no clipping).
    rho_bar, c_bar: V-trace's truncations (rho_bar >= c_bar > 0).
    whiten: whiten the GAE advantages over the batch's valid tokens.
    kl_coef: the per-token KL penalty's coefficient in the rewards (module docstring;
      0 = none).
    reward_norm: normalise and clip the rows' rewards by their running mean and
      standard deviation over the run before the returns (`normalized_rewards`).
    reward_clip: delta of that clipping, > 0.
    warmup_steps: the first loop steps train the critic alone (its value head, or a
      separate critic): the policy's gradients and updates are zero (`optimizer_step`).
  """

  estimator: str
  gamma: float = 1.0
  lam: float = 0.95
  value_coef: float = 0.5
  value_clip: float = 0.2
  rho_bar: float = 1.0
  c_bar: float = 1.0
  whiten: bool = True
  kl_coef: float = 0.0
  reward_norm: bool = False
  reward_clip: float = 5.0
  warmup_steps: int = 0

  def __post_init__(self):
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"critic.estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
    for name in ("gamma", "lam"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"critic.{name} must be in [0, 1], got {getattr(self, name)}")
    if not self.value_coef > 0:
      raise ValueError(f"critic.value_coef must be > 0, got {self.value_coef}")
    if not self.kl_coef >= 0:
      raise ValueError(f"critic.kl_coef must be >= 0 (0 = off), got {self.kl_coef}")
    if self.warmup_steps < 0:
      raise ValueError(f"critic.warmup_steps must be >= 0 (0 = none), got {self.warmup_steps}")
    if not self.reward_clip > 0:
      raise ValueError(f"critic.reward_clip must be > 0, got {self.reward_clip}")
    if self.value_clip < 0:
      raise ValueError(f"critic.value_clip must be >= 0 (0 = off), got {self.value_clip}")
    if self.estimator == "vtrace" and (not self.c_bar > 0 or self.rho_bar < self.c_bar):
      raise ValueError(
        f"critic.rho_bar / critic.c_bar: V-trace needs rho_bar >= c_bar > 0, got "
        f"rho_bar={self.rho_bar}, c_bar={self.c_bar}"
      )


REWARD_STATS = 3  # (count, mean, sum of squared deviations) of the rewards seen


def normalized_rewards(
  spec: CriticSpec, stats: jax.Array, batch: TrainBatch
) -> tuple[jax.Array, TrainBatch, dict[str, Any]]:
  """`(stats, batch, metrics)`: the running reward statistics with the batch's rows added,
  and the batch with its rewards normalised and clipped by them ("Secrets of RLHF", Zheng
  et al., arXiv:2307.04964, eq. 18):

    r~ = clip((r - mean) / std, -reward_clip, reward_clip)

  over every row trained on so far, this batch's included (rows of weight 0 count for
  nothing). The running moments merge batch by batch (Chan et al.'s parallel update).
  While the rewards seen have not varied (standard deviation <= 1e-6) every normalised
  reward is 0. Only the critic's returns read them (the rows' logged rewards stay raw).
  """
  keep = (batch.weights > 0).astype(jnp.float32)
  r = batch.rewards.astype(jnp.float32)
  n_b = keep.sum()
  mean_b = (r * keep).sum() / jnp.maximum(n_b, 1.0)
  m2_b = (jnp.square(r - mean_b) * keep).sum()
  n_a, mean_a, m2_a = stats[0], stats[1], stats[2]
  n = n_a + n_b
  delta = mean_b - mean_a
  mean = mean_a + delta * n_b / jnp.maximum(n, 1.0)
  m2 = m2_a + m2_b + jnp.square(delta) * n_a * n_b / jnp.maximum(n, 1.0)
  std = jnp.sqrt(m2 / jnp.maximum(n, 1.0))
  z = jnp.where(std > 1e-6, (r - mean) / jnp.maximum(std, 1e-6), 0.0)
  norm = jnp.clip(z, -spec.reward_clip, spec.reward_clip)
  metrics = {"critic/reward_norm_mean": mean, "critic/reward_norm_std": std}
  return jnp.stack([n, mean, m2]), batch._replace(rewards=norm), metrics


def _weighted_mask(mb: TrainBatch) -> jax.Array:
  return (mb.mask > 0) * mb.weights[:, None].astype(jnp.float32)


def rewards(spec: CriticSpec, mb: TrainBatch, ref_logp=None) -> jax.Array:
  """Per-token rewards [b, N] of a (micro-)batch: each turn's reward at its last policy token
  (`TrainBatch.token_rewards`), else the row's at its last, less the KL penalty at every token
  when `spec.kl_coef` > 0 (module docstring)."""
  r = mb.token_rewards
  if r is None:
    r = returns.token_rewards(mb.rewards, mb.mask)
  if spec.kl_coef == 0:
    return r
  assert ref_logp is not None, "critic.kl_coef > 0 reads the reference log-probs"
  return returns.kl_penalized_rewards(r, mb.behavior_logp, ref_logp, mb.mask, spec.kl_coef)


def ref_kl(mb: TrainBatch, ref_logp) -> Any:
  """`critic/ref_kl`: the mean over valid tokens of log mu - log pi_ref (the penalty's KL)."""
  m = (mb.mask > 0).astype(jnp.float32)
  return red.Mean(((mb.behavior_logp - ref_logp) * m).sum(), m.sum())


def with_gae(
  spec: CriticSpec,
  batch: TrainBatch,
  values_of: Callable[[TrainBatch], Any],
  ref_logp_of: Callable[[TrainBatch], Any] | None = None,
):
  """`batch` with GAE advantages [B, N], the old values and the returns (``gae``; traceable).

  Args:
    spec: the critic.
    batch: the call's whole batch.
    values_of: ``batch -> values [B, N]`` at the call's starting parameters
      (the caller runs it micro-batch by micro-batch).
    ref_logp_of: ``batch -> log pi_ref [B, N]``, when `spec.kl_coef` > 0.
  """
  values = jax.lax.stop_gradient(values_of(batch))
  ref = None
  if spec.kl_coef > 0:
    assert ref_logp_of is not None, "critic.kl_coef > 0 reads the reference log-probs"
    ref = jax.lax.stop_gradient(ref_logp_of(batch))
  r = rewards(spec, batch, ref)
  out = returns.gae(r, values, batch.mask, gamma=spec.gamma, lam=spec.lam)
  adv = out.advantages
  if spec.whiten:
    w = _weighted_mask(batch)
    n = jnp.maximum(w.sum(), 1.0)
    mean = (adv * w).sum() / n
    std = jnp.sqrt(((adv - mean) ** 2 * w).sum() / n)
    adv = jnp.where(batch.mask > 0, (adv - mean) / (std + 1e-6), 0.0)
  return batch._replace(advantages=adv, values=values, returns=out.returns)


def advantages(
  spec: CriticSpec, logp, values, mb: TrainBatch, ref_logp=None
) -> tuple[jax.Array, jax.Array]:
  """`(advantages [b, N], value targets [b, N])` of a micro-batch for the policy and value losses.

  ``gae``: the batch's (`with_gae`). ``vtrace``: from the current `logp` and
  `values`, both stop-gradient, against the behaviour's log-probs (and, with
  `spec.kl_coef` > 0, the rewards' penalty against `ref_logp`).
  """
  if spec.estimator == "gae":
    assert mb.returns is not None, "with_gae runs before the micro-batches"
    return mb.advantages, mb.returns
  sg = jax.lax.stop_gradient
  out = returns.vtrace(
    rewards(spec, mb, ref_logp),
    sg(values),
    mb.mask,
    jnp.where(mb.mask > 0, sg(logp) - mb.behavior_logp, 0.0),
    gamma=spec.gamma,
    lam=spec.lam,
    rho_bar=spec.rho_bar,
    c_bar=spec.c_bar,
  )
  return out.pg_advantages, out.vs


def value_loss(spec: CriticSpec, values, targets, mb: TrainBatch, loss_count):
  """`(term of the loss sum, typed metrics)` of the value loss on a micro-batch."""
  w = _weighted_mask(mb)
  n = w.sum()
  err = jnp.square(values - targets)
  if spec.estimator == "gae" and spec.value_clip > 0:
    old = mb.values
    assert old is not None, "with_gae runs before the micro-batches"
    clipped = old + jnp.clip(values - old, -spec.value_clip, spec.value_clip)
    clipped_err = jnp.square(clipped - targets)
    clipfrac = red.Mean((w * (clipped_err > err)).sum(), n)
    err = jnp.maximum(err, clipped_err)
  else:
    clipfrac = red.Mean(jnp.float32(0.0), n)
  loss = 0.5 * (err * w).sum()
  term = spec.value_coef * loss / jnp.maximum(n, 1.0) * loss_count
  sg = jax.lax.stop_gradient
  v, d = sg(values), sg(targets - values)
  metrics = {
    "critic/value_loss": red.Mean(sg(loss), n),
    "critic/value_mean": red.Mean((v * w).sum(), n),
    "critic/return_mean": red.Mean((targets * w).sum(), n),
    "critic/value_clipfrac": clipfrac,
    "critic/_r2": red.Mean((targets**2 * w).sum(), n),
    "critic/_d": red.Mean((d * w).sum(), n),
    "critic/_d2": red.Mean((d**2 * w).sum(), n),
  }
  return term, metrics


def explained_variance(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`metrics` (reduced) with the value targets' variance, the error's and the explained
  variance in place of the token means they are made of.

  ``critic/explained_variance`` = 1 - Var(R - V) / Var(R) over the step's valid
  tokens: 1 is a perfect critic, 0 one no better than the mean return, below 0
  worse; 0 when the returns do not vary. A step whose returns hardly vary (a
  batch almost all right) gives a noisy ratio; over many steps, 1 - mean of
  ``critic/error_var`` / mean of ``critic/return_var`` pools them.
  """
  if "critic/_r2" not in metrics:
    return metrics
  out = {k: v for k, v in metrics.items() if k not in _EV_PARTS}
  var_r = metrics["critic/_r2"] - metrics["critic/return_mean"] ** 2
  var_d = metrics["critic/_d2"] - metrics["critic/_d"] ** 2
  out["critic/return_var"] = var_r
  out["critic/error_var"] = var_d
  out["critic/explained_variance"] = jnp.where(
    var_r > 1e-12, 1.0 - var_d / jnp.maximum(var_r, 1e-12), 0.0
  )
  return out


def pooled_explained_variance(rows) -> float:
  """1 - sum Var(R - V) / sum Var(R) over metric rows that hold both (NaN when none do).

  Steps whose returns hardly vary weigh little, as they should; a mean of the
  per-step ratios would let them dominate.
  """
  pairs = [(r["critic/error_var"], r["critic/return_var"]) for r in rows if "critic/error_var" in r]
  total = sum(v for _, v in pairs)
  return float("nan") if not pairs or total <= 0 else 1.0 - sum(e for e, _ in pairs) / total
