"""The loss of one micro-batch: forward passes, the policy loss, its typed metrics.

The current policy's log-probs are recomputed (with adapter dropout when it
has a key), the reference and proximal log-probs only when the loss needs
them; the train step differentiates ``loss_sum`` (`learn.train_step`). A
model with experts adds its load-balancing loss (`models.moe`), weighted by
the micro-batch's ``loss_count`` so that it accumulates exactly like the policy loss.
Metrics are typed reductions (`reductions.Mean`/`Sum`/`Max`/`Min`).
"""

from typing import Any

import jax
import jax.numpy as jnp

from offpolicy_jax import losses, metric_names, models, types
from offpolicy_jax import reductions as red
from offpolicy_jax.learn import critic, diagnostics
from offpolicy_jax.learn.scorer import step_logprobs
from offpolicy_jax.learn.step_options import StepOptions
from offpolicy_jax.types import TrainBatch

# A loss metric's declared reduction (`metric_names`) -> its typed value; a mean is
# weighted by the loss's valid tokens, so that it combines exactly.
_TYPED = {
  metric_names.MEAN: lambda v, n: red.mean(v, n),
  metric_names.SUM: lambda v, n: red.Sum(v),
  metric_names.MAX: lambda v, n: red.Max(v),
  metric_names.MIN: lambda v, n: red.Min(v),
}


def _typed(loss_metrics: dict[str, jax.Array]) -> dict[str, Any]:
  """The loss's per-micro-batch metrics as typed reductions, each by its declared reduction
  (`metric_names.reduction`: a token-weighted mean unless declared otherwise)."""
  n = loss_metrics["valid_tokens"]
  return {
    k: _TYPED[metric_names.reduction(k)](v, n)
    for k, v in loss_metrics.items()
    if k not in ("valid_tokens", "loss_sum")
  }


def _behavior_ratio(logp, mb: TrainBatch) -> dict[str, Any]:
  """Mean, max and min of w = pi / mu over valid tokens (when the loss's ratio is not to mu)."""
  valid = mb.mask > 0
  log_ratio = jnp.where(valid, logp - mb.behavior_logp, 0.0)
  m = valid.astype(jnp.float32)
  return {
    "behavior_ratio_mean": red.Mean((jnp.exp(log_ratio) * m).sum(), m.sum()),
    "behavior_ratio_max": red.Max(jnp.exp(jnp.max(jnp.where(valid, log_ratio, -jnp.inf)))),
    "behavior_ratio_min": red.Min(jnp.exp(jnp.min(jnp.where(valid, log_ratio, jnp.inf)))),
  }


def micro_batch_loss(
  params, mb: TrainBatch, graphdef, options: StepOptions, ref_params, anchor, base=None, key=None
):
  """``(loss_sum, typed metrics)`` of one micro-batch; differentiate the first output.

  Args:
    params: the parameters being trained (with `base`, the adapters).
    mb: a micro-batch.
    graphdef: the model's graph.
    options: static settings.
    ref_params: reference parameters (KL to reference), or None.
    anchor: proximal parameters, or None for ``stop_gradient(logp)`` (the
      current parameters are the anchor).
    base: frozen base weights the parameters adapt (`models.lora`), or None.
      Not differentiated: gradients and optimizer state cover `params` only.
    key: the micro-batch's adapter-dropout key (None: no dropout); only the
      current policy's forward uses it.
  """
  spec, o = options.spec, options
  sg = jax.lax.stop_gradient
  score = lambda p, key=None, full=False: step_logprobs(
    graphdef, o, models.lora.join(base, p), mb, dropout_key=key, full=full
  )
  logp, ent, router, values = score(params, key, full=True)
  extra = {}
  # V-trace pays the critic's KL penalty per micro-batch (GAE's prepass pays it, `train_step`).
  vtrace_kl = o.critic is not None and o.critic.kl_coef > 0 and o.critic.estimator == "vtrace"
  ref_logp = sg(score(ref_params)[0]) if spec.needs_ref or vtrace_kl else None
  if spec.needs_ref:
    extra["ref_logp"] = ref_logp
  if spec.needs_proximal:
    extra["proximal_logp"] = sg(logp) if anchor is None else sg(score(anchor)[0])
  if spec.needs_old:
    extra["old_logp"] = mb.old_logp
  if spec.entropy_coef > 0:
    extra["entropy"] = ent
  if spec.level == "turn_geo":  # a multi-turn row's turns are its runs of policy tokens
    extra["turn_ids"] = types.turn_ids(mb.mask)
  adv, targets = mb.advantages, None
  if o.critic is not None:  # token advantages and value targets from the critic
    if values is None:
      raise ValueError("critic: the model has no value head (ModelConfig.value_head)")
    adv, targets = critic.advantages(o.critic, logp, values, mb, ref_logp)
  out = losses.policy_loss(
    spec,
    logp=logp,
    behavior_logp=mb.behavior_logp,
    advantages=adv,
    mask=mb.mask * mb.weights[:, None],
    **extra,
  )
  m = (mb.mask > 0).astype(jnp.float32)
  metrics = _typed(out.metrics)
  metrics["loss"] = red.Mean(sg(out.loss_sum), out.loss_count)
  metrics["entropy"] = red.Mean((sg(ent) * m).sum(), m.sum())
  metrics["tokens"] = red.Sum(m.sum())
  if spec.ratio != "behavior":
    metrics.update(_behavior_ratio(sg(logp), mb))
  metrics.update(diagnostics.policy_terms(logp, mb))
  loss_sum = out.loss_sum
  if o.critic is not None:
    value_term, value_metrics = critic.value_loss(o.critic, values, targets, mb, out.loss_count)
    loss_sum = loss_sum + value_term
    metrics.update(value_metrics)
    if vtrace_kl:
      metrics["critic/ref_kl"] = critic.ref_kl(mb, ref_logp)
  if router is not None:  # a model with experts (`models.moe.RouterStats`)
    aux = router.loss()
    if o.router_aux_coef > 0:
      loss_sum = loss_sum + o.router_aux_coef * aux * out.loss_count
    tokens = jnp.sum(router.tokens)
    metrics["moe/aux_loss"] = red.Mean(sg(aux) * tokens, tokens)
    metrics["moe/max_load"] = red.Max(sg(router.max_load()))
    if mb.experts is not None:  # the sampler's routing was recorded
      metrics["moe/router_agreement"] = red.Mean(jnp.sum(router.agree), tokens)
      metrics["moe/router_agreement_min"] = red.Min(jnp.min(router.agreement()))
  return loss_sum, metrics
