"""The 3-armed bandit of arXiv:2509.24203 as a seeded study of the library's losses.

Arms have rewards `[0, 0.8, 1]`; the behaviour policy is `[0.3, 0.6, 0.1]`.
REINFORCE on samples of that fixed behaviour pushes the logit of arm a at the
rate `mu(a) * (r(a) - E_mu[r])`, so it converges to arm 1 (reward 0.8), not
the best arm 2 (docs/science.md section 2). Each step draws `group_size` arms (one
group), scores them, computes the method's group-relative advantages and
takes one SGD step on the method's loss (`losses.policy_loss`, one-token
responses). `fixed`: the behaviour stays `mu` forever; `onpolicy`: the
behaviour is the current policy. All seeds of a method run in one `vmap`.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import advantages, losses
from offpolicy_jax.study import stats as study_stats

REWARDS = (0.0, 0.8, 1.0)
BEHAVIOUR = (0.3, 0.6, 0.1)
BEST_ARM, TRAP_ARM = 2, 1


def _train(loss_name: str, adv_name: str, setting: str, *, steps: int, group_size: int, lr: float):
  """`seed -> final policy [3]` for one method and setting (traceable)."""
  spec = losses.get_spec(loss_name)
  rewards, mu_logp = jnp.asarray(REWARDS), jnp.log(jnp.asarray(BEHAVIOUR))
  mask = jnp.ones((group_size, 1))

  def step(logits, key):
    k_arm, k_adv = jax.random.split(key)
    behaviour = mu_logp if setting == "fixed" else jax.nn.log_softmax(logits)
    behaviour = jax.lax.stop_gradient(behaviour)
    arms = jax.random.categorical(k_arm, behaviour, shape=(group_size,))
    adv = advantages.compute(adv_name, rewards[arms][None], key=k_adv)[0]

    def loss_fn(lg):
      logp = jax.nn.log_softmax(lg)[arms][:, None]
      extra = {"proximal_logp": jax.lax.stop_gradient(logp)} if spec.needs_proximal else {}
      return losses.policy_loss(
        spec, logp=logp, behavior_logp=behaviour[arms][:, None], advantages=adv, mask=mask, **extra
      ).loss

    return logits - lr * jax.grad(loss_fn)(logits), None

  def run(seed):
    keys = jax.random.split(jax.random.key(seed), steps)
    logits, _ = jax.lax.scan(step, mu_logp, keys)
    return jax.nn.softmax(logits)

  return run


def run_bandit(
  methods: Mapping[str, Mapping[str, str]],
  seeds: tuple[int, ...],
  *,
  steps: int = 300,
  group_size: int = 8,
  lr: float = 1.0,
) -> list[dict]:
  """Final policies of every method x {fixed, onpolicy}, over `seeds`.

  Args:
    methods: name -> overrides with `loss.name` and optionally `advantage.name`
      (as `study.parse_methods` returns); methods whose loss needs a
      reference policy are left out.
    seeds: one run per seed.
    steps, group_size, lr: SGD steps, arms drawn per step, learning rate.

  Returns:
    One dict per (method, setting): `pi_best` and `pi_trap` (95% t
    intervals of the final probabilities of arms 2 and 1) and the fraction of
    seeds whose most likely arm is the best / the trap.
  """
  out = []
  for name, overrides in methods.items():
    loss_name = overrides["loss.name"]
    if losses.get_spec(loss_name).needs_ref:
      continue
    adv_name = overrides.get("advantage.name") or losses.default_advantage(loss_name)
    for setting in ("fixed", "onpolicy"):
      fn = _train(loss_name, adv_name, setting, steps=steps, group_size=group_size, lr=lr)
      pi = np.asarray(jax.jit(jax.vmap(fn))(jnp.asarray(seeds)))
      top = pi.argmax(axis=1)
      out.append(
        {
          "method": name,
          "setting": setting,
          "pi_best": study_stats.interval(pi[:, BEST_ARM]),
          "pi_trap": study_stats.interval(pi[:, TRAP_ARM]),
          "best_frac": float((top == BEST_ARM).mean()),
          "trap_frac": float((top == TRAP_ARM).mean()),
          "finite": bool(np.isfinite(pi).all()),
        }
      )
  return out


def table(results: list[dict], *, steps: int, group_size: int, seeds: int) -> list[str]:
  """Markdown lines of the bandit results."""
  lines = [
    "## Bandit (arXiv:2509.24203, section 2)",
    "",
    f"Rewards {list(REWARDS)}, behaviour {list(BEHAVIOUR)}; {steps} SGD steps of "
    f"{group_size} sampled arms, {seeds} seeds. `fixed`: samples always from the behaviour; "
    "`onpolicy`: from the current policy. Final probability of the best arm (2) and of the "
    "trap (arm 1), mean [95% t interval over seeds]; the share of seeds whose most likely arm "
    "is each.",
    "",
    "| method | setting | pi(best) | pi(trap) | best is argmax | trap is argmax |",
    "|---|---|---|---|---|---|",
  ]
  for r in results:
    lines.append(
      f"| {r['method']} | {r['setting']} | {r['pi_best']} | {r['pi_trap']} | "
      f"{r['best_frac']:.2f} | {r['trap_frac']:.2f} |"
    )
  return lines
