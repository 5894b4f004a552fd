"""Runs with a critic: the presets learn, every rollout kind trains one, a run resumes exactly."""

import jax
import numpy as np
import pytest

from configs import default
from offpolicy_jax import losses
from offpolicy_jax.learn import critic
from offpolicy_jax.run import components, critic_settings, loop, start, validation
from offpolicy_jax.store import metrics_files
from offpolicy_jax.study import report, report_tables, warm_starts
from tests.test_loop import full_and_resumed, small_config
from tests.test_multiturn_run import _GUESS

# The main job's batch from scratch on partial credit: a visible gain within 60 steps (as
# tests/test_disagg.py).
LEARN = {
  "total_steps": 60,
  "task_kwargs.partial_credit": True,
  "sft.enabled": False,
  "optimizer.learning_rate": 1e-3,
  "eval_prompts": 0,
  "checkpoint_every": 0,
  "progress": False,
  "tensorboard": False,
  "lag.sync_interval": 4,
}


def _main_job(**overrides):
  c = default.base_config()
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  c.lock()
  return c


def _fifths(rows, key):
  r = np.array([row[key] for row in rows])
  n = len(r) // 5
  return r[:n].mean(), r[-n:].mean()


@pytest.mark.parametrize("loss", ["ppo_critic", "vtrace"])
def test_the_critic_presets_learn_the_default_task(tmp_path, loss):
  config = _main_job(**LEARN, **{"loss.name": loss})
  rows, _ = metrics_files.split_rows(loop.train_and_evaluate(config, str(tmp_path)))
  first, last = _fifths(rows, "reward_mean")
  fifth = len(rows) // 5
  ev_first = critic.pooled_explained_variance(rows[:fifth])
  ev_last = critic.pooled_explained_variance(rows[-fifth:])
  print(
    f"{loss}: reward {first:.3f} -> {last:.3f}; explained variance {ev_first:.3f} -> {ev_last:.3f}"
  )
  assert last > first  # it learns
  assert ev_last > ev_first  # and the critic with it
  assert all(np.isfinite(r["critic/value_loss"]) for r in rows)


def test_a_critic_run_resumes_exactly(tmp_path):
  # With the rewards' KL penalty: the reference parameters are kept and checkpointed too.
  # And normalised rewards: their running statistics are checkpointed.
  kw = {
    "loss.name": "vtrace",
    "lag.sync_interval": 3,
    "critic.kl_coef": 0.1,
    "critic.reward_norm": True,
    "critic.warmup_steps": 2,  # and a value warm start: the policy still in steps 1-2
  }
  want, got = full_and_resumed(tmp_path, **kw)
  assert got == want
  assert [r["critic/warmup"] for r in want] == [1.0, 1.0] + [0.0] * (len(want) - 2)
  assert "critic/explained_variance" in want[-1] and "critic/reward_norm_std" in want[-1]
  # Steps 1-3 sample with the starting parameters, the reference: no KL; steps 4-7 with v3.
  kl = [r["critic/ref_kl"] for r in want]
  assert max(abs(x) for x in kl[:3]) < 1e-5 < min(abs(x) for x in kl[3:])
  # Its reward statistics are part of the checkpoint: no resume can turn them off.
  with pytest.raises(ValueError, match="^config.critic.reward_norm: the checkpoint"):
    off = small_config(total_steps=9, **{**kw, "critic.reward_norm": False})
    loop.train_and_evaluate(off, str(tmp_path / "part"), allow_config_change=True)
  # The critic is part of the compiled program: a resume that turns it off is refused.
  with pytest.raises(ValueError, match="critic.estimator"):
    off = small_config(total_steps=9, **kw, **{"critic.estimator": "none"})
    loop.train_and_evaluate(off, str(tmp_path / "part"))


@pytest.mark.parametrize(
  "overrides",
  [
    {"rollout.partial_budget": 2, "lag.sync_interval": 2, "rollout.score_old": True},
    # Async episodes with a separate critic model.
    {
      **_GUESS,
      "sft.steps": 3,
      "lag.mode": "async",
      "lag.max_staleness": 2,
      "critic.model": "policy",
    },
    # Disaggregated: the sampler on 2 devices, the trainer over data x tensor, with a
    # separate critic model (`critic.model`) sharded like the policy.
    {
      "mesh.sampler_devices": 2,
      "mesh.data": 2,
      "mesh.tensor": 3,
      "lag.sync_interval": 2,
      "critic.model": "policy",
    },
    # Episodes whose turns are each paid their own reward: the critic's rewards per turn.
    {**_GUESS, "sft.steps": 3, "multiturn.credit": "turn"},
  ],
  ids=["partial", "async_episodes", "sampler_mesh", "turn_rewards"],
)
def test_every_rollout_kind_trains_a_critic(tmp_path, overrides):
  config = small_config(**{"total_steps": 3, "loss.name": "ppo_critic", **overrides})
  rows, _ = metrics_files.split_rows(loop.train_and_evaluate(config, str(tmp_path)))
  assert len(rows) == 3
  if "mesh.tensor" in overrides:  # the separate critic's weights over the tensor axis
    _, params = start.initial_weights(components.build_components(config), warm_start=False)
    w = params["critic"]["layers"][0]["mlp"]["up_proj"][...]
    assert "tensor" in str(w.sharding.spec)
  for r in rows:
    assert np.isfinite(r["critic/value_loss"]) and np.isfinite(r["loss"])
    assert -1e6 < r["critic/explained_variance"] <= 1.0


def test_the_presets_pair_with_their_critic_and_a_field_overrides_it():
  assert [losses.default_critic(n) for n in ("ppo_critic", "vtrace", "rec_critic")] == [
    "gae",
    "vtrace",
    "gae",
  ]
  assert losses.default_critic("grpo") == ""
  assert critic_settings.critic_spec(small_config()) is None
  spec = critic_settings.critic_spec(small_config(**{"critic.estimator": "vtrace"}))
  assert spec is not None and spec.estimator == "vtrace"
  off = small_config(**{"loss.name": "ppo_critic", "critic.estimator": "none"})
  assert critic_settings.critic_spec(off) is None
  # ppo_critic is PPO-max's recipe: a token-level KL and normalised rewards; fields override.
  recipe = critic_settings.critic_spec(small_config(**{"loss.name": "ppo_critic"}))
  assert recipe is not None and (recipe.kl_coef, recipe.reward_norm) == (0.05, True)
  plain = {"loss.name": "ppo_critic", "critic.kl_coef": 0.0, "critic.reward_norm": False}
  spec = critic_settings.critic_spec(small_config(**plain))
  assert spec is not None and (spec.kl_coef, spec.reward_norm) == (0.0, False)
  spec = critic_settings.critic_spec(small_config(**{"loss.name": "rec_critic"}))
  assert spec is not None and (spec.kl_coef, spec.reward_norm) == (0.0, False)
  # Where it cannot apply (here prompt values read V_0 as a reward) the recipe's is off.
  pool = small_config(**{"loss.name": "ppo_critic", "critic.prompt_pool": 2})
  spec = critic_settings.critic_spec(pool)
  assert spec is not None and (spec.kl_coef, spec.reward_norm) == (0.05, False)
  validation.validate_settings(pool)


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"critic.estimator": "vtrace", "critic.rho_bar": 0.5}, "critic.rho_bar"),
    ({"loss.name": "ppo_critic", "lora.rank": 4}, "lora.rank"),
    ({"loss.name": "ppo_critic", "advantage.name": "grpo"}, "advantage.name"),
    ({"eval_ope": "is,dr"}, "eval_ope"),
    ({"critic.kl_coef": 0.1}, "critic.kl_coef"),  # no critic to pay it
    (
      {"loss.name": "vtrace", "critic.reward_norm": True, "critic.prompt_pool": 2},
      "critic.reward_norm",
    ),
    (
      {"loss.name": "vtrace", "critic.reward_norm": True, "eval_ope": "is,dr"},
      "critic.reward_norm",
    ),
    (
      {**_GUESS, "loss.name": "vtrace", "critic.reward_norm": True, "multiturn.credit": "turn"},
      "critic.reward_norm",
    ),
    (
      {**_GUESS, "loss.name": "vtrace", "multiturn.credit": "turn", "multiturn.gamma": 0.9},
      "multiturn.gamma",
    ),
  ],
)
def test_a_critic_that_does_not_fit_the_config_is_refused_by_name(overrides, field):
  with pytest.raises(ValueError, match=f"^config.{field}: "):
    validation.validate_settings(small_config(**overrides))


def test_a_critic_run_after_a_plain_one_gets_the_same_warm_started_trunk(tmp_path):
  """One process, one seed: the warm start of a run without a critic is not handed to a run
  with one (another parameter structure); the trunks of the two agree up to float rounding
  (the programs differ by the head, which XLA may fuse differently)."""
  plain = small_config(total_steps=1, eval_prompts=0)
  with_critic = small_config(total_steps=1, eval_prompts=0, **{"loss.name": "vtrace"})
  trunks = []
  for config in (plain, with_critic):
    _, warm = start.initial_weights(components.build_components(config), log_fn=lambda _: None)
    trunks.append({k: v for k, v in warm.items() if k != "value_head"})
  assert "value_head" in warm
  for a, b in zip(jax.tree.leaves(trunks[0]), jax.tree.leaves(trunks[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_studys_warm_starts_hold_no_head_and_give_critic_cells_a_zero_one(tmp_path):
  plain = components.build_components(small_config(eval_prompts=0))
  critic_cells = components.build_components(
    small_config(eval_prompts=0, **{"loss.name": "vtrace"})
  )
  first = warm_starts.Starts(str(tmp_path))
  _, with_head = first.get(critic_cells, 0, 0)  # trained by the critic cell, stored without
  _, without = first.get(plain, 0, 0)
  first.close()
  assert "value_head" in with_head and "value_head" not in without
  np.testing.assert_array_equal(with_head["value_head"]["w"][...], 0.0)
  _, read = warm_starts.Starts(str(tmp_path)).get(critic_cells, 0, 0)  # from disk
  for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(with_head), strict=True):
    np.testing.assert_array_equal(a, b)


def test_the_study_tables_pool_each_runs_explained_variance():
  def cell(method, off_policy):
    run = lambda seed: {
      "seed": seed,
      "eval_steps": [0, 10],
      "eval_accuracy": [0.3, 0.4 + 0.01 * seed],
      "train_reward": [0.3] * 10,
      "skipped": 0.0,
      "off_policy": off_policy,
    }
    return {"method": method, "lag": "onpolicy", "runs": [run(s) for s in range(3)]}

  # ppo_critic's runs: explained variance 1 - 0.01 / 0.04 = 0.75 each.
  critic_vars = {"critic/return_var": 0.04, "critic/error_var": 0.01}
  rows = report.cell_rows(cell("grpo", {}), 1) + report.cell_rows(
    cell("ppo_critic", critic_vars), 1
  )
  rows = [{**r, "step": r["step"] if r["step"] != "" else None} for r in rows]
  lines = report_tables.tables(rows, baseline=("grpo", "onpolicy"), title="t")
  at = lines.index("## Critic: explained variance")
  table = "\n".join(lines[at : at + 10])
  assert "| grpo | - |" in table and "| ppo_critic | 0.750" in table
