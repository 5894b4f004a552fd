"""Composable off-policy policy losses, named presets, KL estimators, aggregation.

>>> from offpolicy_jax import losses
>>> out = losses.policy_loss("rec_oneside_nois", logp=l, behavior_logp=l_mu,
...                          advantages=a, mask=m, eps_high=0.28)
>>> out.loss, out.metrics["clip_frac"]

Modules: ``spec`` (the axes of a loss), ``presets`` (named specs and their
default advantage estimators), ``levels`` (which ratio a token sees),
``shaping`` (one small function per trust-region shaping, dispatched through
``shaping.SHAPINGS``), ``adaptive`` (per-batch searches), ``kl``,
``aggregation`` and ``core`` (``policy_loss``).
"""

from offpolicy_jax.losses.adaptive import bapo_bounds, cov_select, m2po_capped_tau, m2po_tau
from offpolicy_jax.losses.aggregation import AGG_MODES, aggregate, safe_divide
from offpolicy_jax.losses.core import LossOutput, per_token_terms, policy_loss, token_coefficient
from offpolicy_jax.losses.kl import KL_KINDS, kl
from offpolicy_jax.losses.presets import (
  default_advantage,
  default_critic,
  describe,
  get_spec,
  names,
  register,
)
from offpolicy_jax.losses.spec import LossSpec

__all__ = [
  "AGG_MODES",
  "KL_KINDS",
  "LossOutput",
  "LossSpec",
  "aggregate",
  "bapo_bounds",
  "cov_select",
  "default_advantage",
  "default_critic",
  "describe",
  "get_spec",
  "kl",
  "m2po_capped_tau",
  "m2po_tau",
  "names",
  "per_token_terms",
  "policy_loss",
  "register",
  "safe_divide",
  "token_coefficient",
]
