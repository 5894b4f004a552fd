"""The critic of a run's config (`critic.*`): its `learn.critic.CriticSpec` and its checks.

A run has a critic when `critic.estimator` is "gae" or "vtrace", or empty and
the loss preset pairs with one (`losses.default_critic`: `ppo_critic`,
`rec_critic`, `vtrace`). The model then carries a value head
(`ModelConfig.value_head`), or with `critic.model` a separate critic model
(`ModelConfig.critic`); the train step trains it and reads its token
advantages (`learn.critic`), and the optimizer gives the critic its own
learning rate (`critic.lr_scale` times the policy's).
"""

from __future__ import annotations

from typing import Any

from offpolicy_jax import errors, losses
from offpolicy_jax.learn.critic import CriticSpec
from offpolicy_jax.rollout.prompt_filter import PromptFilter

FROM_POLICY = "policy"  # critic.model: a separate critic starting as the policy's copy

# A loss preset's critic recipe: the value a `critic.*` field left None takes. `ppo_critic`
# is PPO-max's ("Secrets of RLHF", Zheng et al., arXiv:2307.04964, s5.3-5.4): a token-level
# KL penalty to the starting policy (their coefficient 0.05) and normalised, clipped rewards
# (eq. 18), beside the value clipping and GAE every critic here has.
RECIPES: dict[str, dict[str, Any]] = {"ppo_critic": {"kl_coef": 0.05, "reward_norm": True}}
_UNSET = {"kl_coef": 0.0, "reward_norm": False}


def setting(config, name: str) -> Any:
  """`critic.<name>`, or where it is None the loss preset's recipe value, else the field's
  plain default (`RECIPES`). The recipe's reward normalisation stays off where it cannot
  apply (`_reward_norm_conflicts`); set explicitly there, it is refused."""
  value = config.critic[name]
  if value is not None:
    return value
  value = RECIPES.get(config.loss.name, {}).get(name, _UNSET[name])
  if name == "reward_norm" and value and any(on for on, _ in _reward_norm_conflicts(config)):
    return False
  return value


def separate_critic(config) -> str:
  """`critic.model` when the run has a critic: "" (a head on the policy's trunk),
  `FROM_POLICY`, or the critic's own preset or checkpoint."""
  return config.critic.model if estimator(config) else ""


def estimator(config) -> str:
  """The run's critic estimator ("gae", "vtrace"), or "" for none."""
  name = config.critic.estimator or losses.default_critic(config.loss.name)
  return "" if name == "none" else name


def critic_spec(config) -> CriticSpec | None:
  """The train step's critic (`StepOptions.critic`), or None."""
  name = estimator(config)
  if not name:
    return None
  c = config.critic
  return CriticSpec(
    name,
    gamma=float(c.gamma),
    lam=float(c.lam),
    value_coef=float(c.value_coef),
    value_clip=float(c.value_clip),
    rho_bar=float(c.rho_bar),
    c_bar=float(c.c_bar),
    whiten=bool(c.whiten),
    kl_coef=float(setting(config, "kl_coef")),
    reward_norm=bool(setting(config, "reward_norm")),
    reward_clip=float(c.reward_clip),
    warmup_steps=int(c.warmup_steps),
  )


def validate(c) -> None:
  """How the critic's fields fit the rest of the config (the values alone are checked already).

  Raises:
    ConfigError: `config.<field>: ...` naming the field.
  """
  name = estimator(c)
  doubly_robust = _doubly_robust(c)
  errors.need(
    bool(name) or not doubly_robust,
    "eval_ope",
    f"the doubly robust estimators {doubly_robust} need a critic's values: set "
    "critic.estimator (or a loss preset with a critic), or drop them",
  )
  errors.need(
    bool(name) or not c.critic.kl_coef,
    "critic.kl_coef",
    f"the KL penalty ({c.critic.kl_coef}) is paid in a critic's rewards: set "
    "critic.estimator (or a loss preset with a critic), or 0 (a KL-to-reference loss: "
    "loss.kl_coef)",
  )
  errors.need(
    bool(name) or not c.critic.warmup_steps,
    "critic.warmup_steps",
    f"a value warm start ({c.critic.warmup_steps} steps) trains a critic: set "
    "critic.estimator (or a loss preset with a critic), or 0",
  )
  errors.need(
    c.critic.warmup_steps < c.total_steps,
    "critic.warmup_steps",
    f"a value warm start of {c.critic.warmup_steps} steps leaves none of the run's "
    f"{c.total_steps} (total_steps) to train the policy: make it shorter",
  )
  errors.need(
    bool(name) or not c.critic.reward_norm,
    "critic.reward_norm",
    "reward normalisation feeds a critic's returns: set critic.estimator (or a loss preset "
    "with a critic), or leave it off",
  )
  _validate_reward_norm(c, name)
  errors.need(
    bool(name) or not c.critic.model,
    "critic.model",
    f"a separate critic ({c.critic.model!r}) needs a critic: set critic.estimator (or a "
    "loss preset with a critic), or leave it empty",
  )
  _validate_prompt_pool(c, name)
  if not name:
    return
  errors.need(
    name != "vtrace" or c.critic.rho_bar >= c.critic.c_bar,
    "critic.rho_bar",
    f"V-trace needs rho_bar >= c_bar (Espeholt et al. 2018, s4.1), got rho_bar="
    f"{c.critic.rho_bar} < c_bar={c.critic.c_bar}",
  )
  errors.need(
    not c.lora.rank,
    "lora.rank",
    f"a critic (critic.estimator={name!r}) trains a value head on the trunk or a separate "
    "critic model (critic.model), which adapters would freeze: use full fine-tuning "
    "(lora.rank = 0) or --config.critic.estimator=none",
  )
  errors.need(
    not (c.multiturn.credit == "turn" and c.multiturn.gamma != 1.0),
    "multiturn.gamma",
    f"a critic (critic.estimator={name!r}) discounts its per-turn rewards per token by "
    f"critic.gamma; the turn discount {c.multiturn.gamma} would not be used: set it to 1",
  )
  errors.need(
    not c.advantage.name,
    "advantage.name",
    f"a critic (critic.estimator={name!r}) replaces the group advantages: leave "
    "advantage.name empty, or --config.critic.estimator=none",
  )


def turn_rewards(config) -> bool:
  """Whether batches keep each turn's reward on its last token for the critic's returns
  (a critic under `multiturn.credit = "turn"`: `TrainBatch.token_rewards`)."""
  turns = bool(config.multiturn.max_turns) and config.multiturn.credit == "turn"
  return turns and bool(estimator(config))


def prompt_filter(config) -> PromptFilter | None:
  """The run's choice of prompts by their values (`rollout.prompt_filter`), or None."""
  c = config.critic
  if c.prompt_pool <= 1:
    return None
  return PromptFilter(
    int(c.prompt_pool), float(c.prompt_wrong), float(c.prompt_right), int(config.group_size)
  )


def _validate_prompt_pool(c, name: str) -> None:
  if c.critic.prompt_pool <= 1:
    return
  errors.need(
    bool(name),
    "critic.prompt_pool",
    f"choosing prompts by their values ({c.critic.prompt_pool} candidates each) needs a "
    "critic's value head: set critic.estimator (or a loss preset with a critic), or 1",
  )
  errors.need(
    c.critic.prompt_right > c.critic.prompt_wrong,
    "critic.prompt_right",
    f"a right response's reward ({c.critic.prompt_right}) must exceed a wrong one's "
    f"(critic.prompt_wrong = {c.critic.prompt_wrong})",
  )
  errors.need(
    c.critic.gamma == 1.0,
    "critic.gamma",
    f"choosing prompts by their values reads V_0 as the expected reward, which a critic "
    f"discounting by {c.critic.gamma} does not predict: critic.gamma = 1, or "
    "critic.prompt_pool = 1",
  )
  errors.need(
    c.lag.mode == "sync",
    "critic.prompt_pool",
    "prompts are chosen by their values in lag.mode='sync' only (the async producer reads "
    "its prompts on its own thread): set lag.mode='sync' or critic.prompt_pool = 1",
  )


def _reward_norm_conflicts(c) -> list[tuple[bool, str]]:
  """What reward normalisation cannot go with: (applies, why) pairs. Normalised rewards
  make the critic's values predict them, not the rewards."""
  why = "the critic's values then predict normalised rewards"
  doubly_robust = _doubly_robust(c)
  return [
    (
      bool(c.multiturn.max_turns) and c.multiturn.credit == "turn",
      "normalises each row's reward, not per-turn rewards (multiturn.credit='turn')",
    ),
    (
      c.critic.prompt_pool > 1,
      f"prompt values (critic.prompt_pool) read V_0 as the expected reward; {why}",
    ),
    (
      bool(doubly_robust),
      f"the doubly robust estimators {doubly_robust} read the values as rewards; {why}",
    ),
  ]


def _validate_reward_norm(c, name: str) -> None:
  if not name or not c.critic.reward_norm:  # the recipe's stays off where it cannot apply
    return
  for applies, why in _reward_norm_conflicts(c):
    errors.need(not applies, "critic.reward_norm", f"{why}: --config.critic.reward_norm=False")


def _doubly_robust(c) -> list[str]:
  """The doubly robust OPE estimators `eval_ope` asks for (they read the critic's values)."""
  return sorted({"dr", "wdr"} & {n.strip() for n in c.eval_ope.split(",")})
