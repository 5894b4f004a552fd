"""Turn-level credit of multi-turn trajectories (`multiturn.credit = "turn"`)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import advantages, types  # noqa: E402
from offpolicy_jax.rewards import tasks  # noqa: E402
from offpolicy_jax.rewards.tasks import agentic  # noqa: E402
from offpolicy_jax.rollout import episodes, prompt_rows  # noqa: E402
from offpolicy_jax.run import components, loop  # noqa: E402
from offpolicy_jax.sampling import SampleOutput  # noqa: E402
from offpolicy_jax.step import packing, run_state  # noqa: E402
from offpolicy_jax.store import metrics_files  # noqa: E402
from tests.test_multiturn_run import _config  # noqa: E402


def _grpo(r):
  r = np.asarray(r, np.float64)
  sd = r.std(axis=-1, ddof=1, keepdims=True)
  return np.where(sd > 0, (r - r.mean(axis=-1, keepdims=True)) / (sd + 1e-6), 0.0)


def test_per_turn_makes_returns_to_go_relative_among_the_trajectories_taking_each_turn():
  rng = np.random.default_rng(0)
  r = rng.random((3, 4, 5)).astype(np.float32)
  r[0, 1, 2:] = np.nan  # ended after two turns
  r[2, 3, 1:] = np.nan  # after one
  gamma = 0.5
  got = np.asarray(advantages.per_turn("grpo", r, gamma=gamma))
  paid = np.nan_to_num(r)
  for g in range(3):
    for t in range(5):
      togo = sum(gamma ** (u - t) * paid[g, :, u] for u in range(t, 5))
      live = ~np.isnan(r[g, :, t])
      want = np.zeros(4)
      want[live] = _grpo(togo[live])
      np.testing.assert_allclose(got[g, :, t], want, rtol=1e-5, atol=1e-5)


def test_an_early_solver_keeps_its_advantage_over_slower_ones():
  # Trajectory 0 solves at turn 0 (reward 1), the others at turn 1 (0.9) or never.
  nan = np.nan
  r = np.array([[[1.0, nan], [0.0, 0.9], [0.0, 0.9], [0.0, 0.0]]], np.float32)
  a = np.asarray(advantages.per_turn("grpo", r))
  traj = np.asarray(advantages.compute("grpo", np.nansum(r, -1)))
  np.testing.assert_allclose(a[:, :, 0], traj, atol=1e-6)  # turn 0: whole returns
  assert a[0, 0, 0] > a[0, 1, 0] > a[0, 3, 0]


def test_per_turn_with_one_rewarded_turn_is_trajectory_credit():
  rng = np.random.default_rng(1)
  r = np.zeros((2, 4, 3), np.float32)
  r[:, :, 2] = rng.random((2, 4))
  got = np.asarray(advantages.per_turn("rloo", r))
  want = np.asarray(advantages.compute("rloo", r.sum(-1)))
  for t in range(3):  # every turn carries the trajectory's advantage
    np.testing.assert_allclose(got[:, :, t], want, rtol=1e-6, atol=1e-6)
  # One turn: the same as trajectory credit, for an estimator with a key too.
  key = jax.random.key(0)
  one = np.asarray(advantages.per_turn("red_drop", r[:, :, 2:], key))[..., 0]
  np.testing.assert_allclose(
    one, advantages.compute("red_drop", r[:, :, 2], jax.random.fold_in(key, 0)), atol=1e-6
  )


def test_per_turn_rejects_bad_shapes_and_discounts():
  with pytest.raises(ValueError, match=r"\[G, K, T\]"):
    advantages.per_turn("grpo", np.zeros((2, 3)))
  with pytest.raises(ValueError, match="gamma"):
    advantages.per_turn("grpo", np.zeros((2, 3, 2)), gamma=1.5)


def test_pack_gives_each_turns_tokens_its_reward_to_go():
  # 1 prompt, K = 2 trajectories, 3 turns each; mask 0 on observation tokens.
  mask = np.array([[1, 1, 0, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0, 1, 0]], np.float32)
  r_bt = np.array([[0.0, 1.0, 0.0], [0.5, 0.0, 1.0]], np.float32)
  r_bt[0, 2] = 0.2
  n = mask.shape[1]
  out = SampleOutput(
    tokens=jnp.ones((2, n), jnp.int32),
    mask=jnp.asarray(mask),
    logprobs=jnp.zeros((2, n)),
    lengths=jnp.full((2,), n, jnp.int32),
    kept=jnp.ones((2, n), jnp.int32),
    old_logprobs=None,
  )
  spec = run_state.Packing(group_size=2, advantage="grpo", gamma=0.9)
  prompts = {"prompt_tokens": jnp.ones((1, 3), jnp.int32), "prompt_lengths": jnp.array([3])}
  batch = packing.pack(spec, prompts, out, r_bt, 0, jax.random.key(0))
  a_t = np.asarray(advantages.per_turn("grpo", r_bt[None], gamma=0.9))[0]  # [2, 3]
  turn = np.asarray(types.turn_ids(jnp.asarray(mask)))
  want = np.take_along_axis(a_t, turn, axis=1) * mask
  np.testing.assert_allclose(np.asarray(batch.advantages), want, atol=1e-6)
  np.testing.assert_allclose(np.asarray(batch.rewards), np.nansum(r_bt, 1))
  assert np.asarray(batch.advantages)[0, 2] == 0.0  # an observation token: no advantage
  assert batch.token_rewards is None  # kept for a critic only
  # For a critic each turn's reward sits on its last policy token; a turn not taken pays 0.
  r_bt[1, 2] = np.nan
  critic_spec = spec._replace(token_rewards=True)
  batch = packing.pack(critic_spec, prompts, out, r_bt, 0, jax.random.key(0))
  want = np.zeros_like(mask)
  want[0, [1, 3, 7]] = [0.0, 1.0, 0.2]
  want[1, [0, 4]] = [0.5, 0.0]
  np.testing.assert_array_equal(np.asarray(batch.token_rewards), want)
  np.testing.assert_allclose(np.asarray(batch.rewards), np.nansum(r_bt, 1))


@pytest.mark.parametrize("per_turn", [False, True])
def test_pack_computes_advantages_over_the_valid_groups_only(per_turn):
  """A partial-rollout pool packs all its slots; groups in flight must not move the advantages
  of emitted ones, even under a batch-level estimator (batch_whiten)."""
  g, k, n = 3, 2, 4
  out = SampleOutput(
    tokens=jnp.ones((g * k, n), jnp.int32),
    mask=jnp.ones((g * k, n)),
    logprobs=jnp.zeros((g * k, n)),
    lengths=jnp.full((g * k,), n, jnp.int32),
    kept=jnp.ones((g * k, n), jnp.int32),
    old_logprobs=None,
  )
  spec = run_state.Packing(group_size=k, advantage="batch_whiten", gamma=1.0)
  prompts = {"prompt_tokens": jnp.ones((g, 3), jnp.int32), "prompt_lengths": jnp.full((g,), 3)}
  valid = jnp.array([True, False, True])

  def adv(rewards):
    r = np.asarray(rewards, np.float32)
    r = r[:, None] if per_turn else r
    batch = packing.pack(spec, prompts, out, r, 0, jax.random.key(0), valid)
    return np.asarray(batch.advantages).reshape(g * k, -1)[:, 0]

  a = adv([1.0, 0.0, 5.0, 7.0, 0.0, 1.0])
  b = adv([1.0, 0.0, -3.0, 0.0, 0.0, 1.0])  # only the invalid group changed
  np.testing.assert_allclose(a, b, atol=1e-6)
  np.testing.assert_array_equal(a[2:4], 0.0)
  assert np.abs(a[[0, 1, 4, 5]]).min() > 0.5


class StepPaidGuess(agentic.GuessNumber):
  """guess_number paying 0.1 for every guess that is a number (module level: reaches workers)."""

  def step(self, state, action_text):
    r = super().step(state, action_text)
    paid = 0.1 if action_text.strip().isdigit() else 0.0
    return r._replace(reward=r.reward + paid)


def make_step_paid_guess(*, hi: int = 8, max_turns: int = 4):
  import dataclasses

  task = agentic.make_guess_number(hi=hi, max_turns=max_turns)
  return dataclasses.replace(
    task, name="step_paid_guess", environment=StepPaidGuess(hi, max_turns, 0.05)
  )


def _step_paid_config(**overrides):
  if "step_paid_guess" not in tasks.task_names():
    tasks.register("step_paid_guess", make_step_paid_guess)
  return _config(task="step_paid_guess", **overrides)


def test_played_episodes_pack_to_per_turn_advantages_and_the_run_trains(tmp_path):
  """Episodes played by the sampler and the sandboxed environment: the advantage of each
  policy token is its turn's reward to go; the run trains with it and checkpoints it."""
  components.clear_cache()
  cfg = _step_paid_config(**{"multiturn.credit": "turn", "multiturn.gamma": 0.9})
  fns = components.build_components(cfg).fns
  assert fns.rollout.ep.credit == "turn"
  it = fns.prompts(seed=0)
  prompts = next(it)
  params = fns.model.init_params(0)
  examples = [dict(e) for e in _examples(fns, prompts)]
  played = episodes.play(
    fns.rollout.ep,
    params,
    prompts,
    jax.random.key(3),
    task=fns.task,
    split="train",
    group_size=fns.sizes.group_size,
  )
  assert played.turn_rewards.shape == (len(examples) * fns.sizes.group_size, 4)
  np.testing.assert_allclose(np.nansum(played.turn_rewards, 1), played.rewards, atol=1e-6)
  taken = ~np.isnan(played.turn_rewards)
  np.testing.assert_array_equal(taken.sum(1), played.turns)  # NaN after the last turn
  assert (played.turn_rewards[:, 1:][taken[:, 1:]] != 0).any()  # later turns were paid
  device = {k: jnp.asarray(prompts[k]) for k in prompt_rows.DEVICE_FIELDS}
  batch = packing.pack(fns.packing, device, played.out, played.turn_rewards, 0, jax.random.key(0))
  a_t = np.asarray(
    advantages.per_turn(
      fns.packing.advantage,
      played.turn_rewards.reshape(len(examples), fns.sizes.group_size, 4),
      gamma=0.9,
    )
  ).reshape(-1, 4)
  mask = np.asarray(played.out.mask)
  turn = np.minimum(np.asarray(types.turn_ids(jnp.asarray(mask))), 3)
  np.testing.assert_allclose(
    np.asarray(batch.advantages), np.take_along_axis(a_t, turn, axis=1) * mask, atol=1e-5
  )
  # Turn ids from the mask are exactly the turns the environment answered and paid for.
  np.testing.assert_array_equal(turn.max(axis=1) + 1, np.asarray(played.turns))

  rows = loop.train_and_evaluate(
    _step_paid_config(total_steps=3, **{"multiturn.credit": "turn"}), str(tmp_path / "run")
  )
  train, _ = metrics_files.split_rows(rows)
  assert [r["step"] for r in train] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) for r in train) and any(r["grad_norm"] > 0 for r in train)


def _examples(fns, prompts):
  from offpolicy_jax.rollout import data

  return data.examples(fns.task, "train", np.asarray(prompts["index"]).tolist())


def test_turn_credit_without_episodes_is_refused_by_name():
  from tests.test_loop import small_config

  with pytest.raises(ValueError, match=r"multiturn\.credit"):
    components.build_components(small_config(**{"multiturn.credit": "turn"}))
  with pytest.raises(ValueError, match=r"multiturn\.gamma"):
    components.build_components(_config(**{"multiturn.gamma": 2.0}))
  with pytest.raises(ValueError, match=r"multiturn\.gamma: a turn discount needs"):
    components.build_components(_config(**{"multiturn.gamma": 0.9}))
