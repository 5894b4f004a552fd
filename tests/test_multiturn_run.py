"""Multi-turn episodes through the run: training rows, exact resume with replay, flaky envs."""

import dataclasses
import os
import sys
import time

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import types  # noqa: E402
from offpolicy_jax.models import tokenizers  # noqa: E402
from offpolicy_jax.rewards import environments, tasks  # noqa: E402
from offpolicy_jax.rewards.tasks import agentic  # noqa: E402
from offpolicy_jax.rollout import episodes
from offpolicy_jax.run import components, loop, start  # noqa: E402
from offpolicy_jax.store import metrics_files  # noqa: E402
from tests.test_loop import small_config, strip_timing  # noqa: E402

# guess 1..8 in at most 4 turns: "8\n" + "|h\n" per turn.
_GUESS = {
  "task": "guess_number",
  "task_kwargs.hi": 8,
  "task_kwargs.max_turns": 4,
  "multiturn.max_turns": 4,
  "multiturn.turn_tokens": 3,
  "multiturn.observation_tokens": 3,
  "max_new_tokens": 24,
  "sft.steps": 40,
  "optimizer.learning_rate": 3e-3,
}


def _config(**overrides):
  cfg = small_config(**{**_GUESS, **overrides})
  return cfg


def _no_timing(rows):
  timing = ("reward_time_s", "episode/env_s")
  return [{k: v for k, v in r.items() if k not in timing} for r in strip_timing(rows)]


def _check_training_rows(rows):
  train, evals = metrics_files.split_rows(rows)
  assert [r["step"] for r in train] == list(range(1, len(train) + 1))
  for r in train:
    assert 1.0 <= r["episode/turns"] <= 4.0
    assert 0.0 <= r["reward_mean"] <= 1.0 and np.isfinite(r["loss"])
    # `tokens` (the loss's count) and `response_tokens` are the policy's tokens only:
    # at most turn_tokens (3) per turn, observations never counted.
    assert r["tokens"] <= 3 * 4 * 8
    assert r["response_tokens"] == pytest.approx(r["tokens"])
    assert r["reward_failures"] == 0
    assert r["episode/env_s"] > 0  # the environments' answers, counted in the run's costs
  assert any(r["grad_norm"] > 0 for r in train)
  env_s = sum(r["episode/env_s"] for r in train)
  assert train[-1]["time/run_environment_s"] == pytest.approx(env_s)
  assert "eval/turns" in evals[-1] and "eval/tool_calls_per_solved" in evals[-1]


def test_episode_run_trains_and_resumes_exactly_with_trajectories_in_replay(tmp_path):
  """A killed multi-turn run resumes exactly: trajectories in replay, lagged versions."""
  common = {
    "lag.sync_interval": 2,
    "replay.capacity_batches": 2,
    "replay.policy": "uniform",
  }
  full = loop.train_and_evaluate(_config(total_steps=6, **common), str(tmp_path / "full"))
  _check_training_rows(full)
  part = str(tmp_path / "part")
  loop.train_and_evaluate(_config(total_steps=3, **common), part)
  loop.train_and_evaluate(_config(total_steps=6, **common), part)
  got_train, got_eval = metrics_files.split_rows(metrics_files.read_metrics(part))
  want_train, want_eval = metrics_files.split_rows(full)
  assert _no_timing(got_train) == _no_timing(want_train)
  assert got_eval[-1] == want_eval[-1]
  # The lag schedule's behaviour versions reached the trajectories (sync_interval 2).
  assert {r["behavior_version"] for r in want_train} != {r["step"] - 1 for r in want_train}


def test_partial_episodes_pause_span_versions_and_resume_exactly(tmp_path):
  """Episodes in flight across steps (`rollout.episode_pool`): 2 policy tokens per step, so turns
  of 3 pause mid-way; every token's log-prob is exact under its own step's parameters."""
  common = {"rollout.partial_budget": 2, "rollout.score_old": True, "lag.sync_interval": 2}
  full = loop.train_and_evaluate(_config(total_steps=8, **common), str(tmp_path / "full"))
  train, _ = metrics_files.split_rows(full)
  assert train[0]["partial_emitted_groups"] == 0  # nothing ends within 2 tokens
  assert sum(r["partial_emitted_groups"] for r in train) >= 6
  assert max(r["partial_inflight_groups"] for r in train) >= 4
  assert sum(r["partial_mixed_rows"] for r in train) > 0  # trajectories spanning versions
  assert any(r["grad_norm"] > 0 for r in train)
  for r in train:
    assert r["partial_dropped_prompts"] == 0 and r["reward_failures"] == 0
    # pi_old is the learner's score at each token's own version: the behaviour log-probs
    # equal it (a token scored under another version, or drawn from a stale cache, would not).
    assert abs(r["mismatch_kl_k3"]) < 1e-5, r["mismatch_kl_k3"]
  part = str(tmp_path / "part")
  loop.train_and_evaluate(_config(total_steps=3, **common), part)  # checkpoint: pool in flight
  changed = _config(total_steps=8, **{**common, "rollout.partial_budget": 3})
  with pytest.raises(ValueError, match=r"^config\.rollout\.partial_budget: the checkpoint"):
    loop.train_and_evaluate(changed, part, allow_config_change=True)
  assert not os.path.exists(os.path.join(part, "config_history.jsonl"))  # no change recorded
  loop.train_and_evaluate(_config(total_steps=8, **common), part)
  got_train, _ = metrics_files.split_rows(metrics_files.read_metrics(part))
  assert _no_timing(got_train) == _no_timing(train)


def test_episode_pool_emits_the_oldest_groups_first():
  """Slots are reused after emission, so slot order is not age: the batch puts the oldest
  admissions first, for the replay buffer's FIFO (the first token's version is the step it
  came in: version = step here)."""
  from offpolicy_jax.rollout import prompt_rows
  from offpolicy_jax.step import learning, run_state

  comps = components.build_components(_config(**{"rollout.partial_budget": 2}))
  fns, k = comps.fns, comps.fns.sizes.group_size
  rollout = fns.rollout
  pool = rollout.init()
  _, params = start.initial_weights(comps, log_fn=lambda *a: None)  # episodes of 1 to 4 turns
  prompts_it = fns.prompts(0)
  came_in, reused = [], False
  for step in range(1, 31):
    prompts = prompt_rows.assemble_global(comps.mesh, next(prompts_it))
    occupied = pool.occupied.copy()
    key = run_state.step_key(0, step, run_state.SAMPLE)
    pool, fin, _ = rollout.advance(pool, params, step, prompts, step, key)
    batch, keep = learning.pack_finished(fns, fin, fin.rewards, step, 0, jitted=True)
    first = np.asarray(batch.versions)[::k, 0][np.asarray(keep)]
    assert list(first) == sorted(first), (step, first)
    came_in.extend(first.tolist())
    reused |= bool(np.any(~occupied[: pool.slots // 2]) and step > 12)
  assert len(came_in) >= 20 and reused


class FlakyGuess(agentic.GuessNumber):
  """guess_number whose environment misbehaves on some secrets (module level: reaches workers)."""

  def step(self, state, action_text):
    secret, turn = state["secret"], state["turn"] + 1
    if turn == 1 and secret == 1:
      time.sleep(60)  # hangs: killed at the timeout
    if turn == 1 and secret == 2:
      raise RuntimeError("environment bug")
    if turn == 1 and secret == 3:
      return environments.EnvResult("o", float("nan"), False, state)  # garbage
    if turn == 1 and secret == 4:  # acts on the host: the sandbox refuses the write
      with open(os.path.join(state["dir"], "pwned"), "w") as f:
        f.write("x")
    return super().step(state, action_text)

  def reset(self, example):
    r = super().reset(example)
    return r._replace(state={**r.state, "dir": example["dir"]})


def make_flaky_guess(*, hi: int = 8, max_turns: int = 4, directory: str = "/nonexistent"):
  task = agentic.make_guess_number(hi=hi, max_turns=max_turns)
  train = [{"secret": s, "dir": directory} for s in range(1, hi + 1)]
  return dataclasses.replace(
    task,
    name="flaky_guess",
    train_source=tasks.ListSource(train),
    eval_source=tasks.ListSource(train),
    environment=FlakyGuess(hi, max_turns, 0.05),
  )


def test_flaky_environment_is_counted_and_the_run_goes_on(tmp_path):
  if "flaky_guess" not in tasks.task_names():
    tasks.register("flaky_guess", make_flaky_guess)
  components.clear_cache()
  cfg = _config(
    total_steps=3,
    task="flaky_guess",
    **{
      "task_kwargs.directory": str(tmp_path),
      "reward_timeout": 1.0,
      # Its own workers: hung calls get them killed and replaced.
      "reward_memory_mb": 1536,
      "sft.enabled": False,
      "eval_prompts": 0,
      "prompts_per_step": 4,
      "group_size": 2,
    },
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path / "run"))
  train, _ = metrics_files.split_rows(rows)
  assert [r["step"] for r in train] == [1, 2, 3]
  assert sum(r["reward_failures"] for r in train) > 0
  assert sum(r["reward_timeouts"] for r in train) > 0
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["reward_mean"]) for r in train)
  assert not os.path.exists(tmp_path / "pwned")


@pytest.mark.parametrize(
  "overrides, field",
  [
    (
      {"rollout.partial_budget": 2, "lag.mode": "async", "lag.max_staleness": 3},
      "lag.max_staleness",
    ),
    ({"rollout.continuous_slots": 2}, "rollout.continuous_slots"),
    ({"mesh.sampler_devices": 2}, "mesh.sampler_devices"),
    ({"multiturn.turn_tokens": 99}, "multiturn.turn_tokens"),
  ],
)
def test_combinations_it_does_not_take_are_refused_by_name(overrides, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    components.build_components(_config(**overrides))


def test_a_task_without_an_environment_is_refused():
  with pytest.raises(ValueError, match=r"multiturn\.max_turns: task 'reverse' has no environment"):
    components.build_components(small_config(**{"multiturn.max_turns": 2}))


def test_plain_turn_format_round_trips_actions_and_observations():
  tok = tokenizers.CharTokenizer()
  fmt = episodes.turn_format(tok, chat=False)
  assert fmt.turn_end == (tuple(tok.encode("\n")),)
  assert fmt.action_text(tok.encode("12\n")) == "12"
  assert fmt.observation("|h\n") == tok.encode("|h\n")


def test_turn_ids_are_the_runs_of_policy_tokens():
  mask = np.array([[1, 1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]], np.float32)
  got = np.asarray(types.turn_ids(jax.numpy.asarray(mask)))
  np.testing.assert_array_equal(got, [[0, 0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])


def test_miniature_multi_turn_study_runs_its_seeds_and_reports(tmp_path):
  """The study's vmapped seeds, episodes played per seed (the loop's `drivers.Split`)."""
  from configs import lag_study
  from offpolicy_jax.study import runner as study

  c = lag_study.get_config("calculator")
  c.unlock()
  c.task = "guess_number"
  c.task_kwargs = {"hi": 8, "max_turns": 4}
  for key, value in {**_GUESS, "total_steps": 2, "eval_every": 2, "prompts_per_step": 2}.items():
    if not key.startswith("task"):
      node, *path = key.split(".")
      (c[node] if path else c)[path[0] if path else node] = value
  c.group_size = 4
  c.max_prompt_len = 12
  c.eval_prompts = 4
  c.eval_samples = 1  # greedy only
  c.sft.steps = 10
  c.study.methods = "grpo"
  c.study.lags = "onpolicy=1/0"  # the baseline's lag
  c.study.seeds = 2
  c.study.aa_lags = ""
  c.study.eval_last = 1
  c.lock()
  cells = study.run_study(c, str(tmp_path), log=lambda s: None, isolation="inline")
  runs = cells[("grpo", "onpolicy")]["runs"]
  assert [r["seed"] for r in runs] == [0, 1]
  for r in runs:
    assert len(r["train_reward"]) == 2 and all(0.0 <= x <= 1.0 for x in r["train_reward"])
    assert len(r["eval_accuracy"]) == 2


def test_a_study_refuses_episodes_in_flight_across_steps():
  from configs import lag_study
  from offpolicy_jax.study import grid as study_grid

  c = lag_study.get_config("calculator")
  c.unlock()
  c.rollout.partial_budget = 4
  with pytest.raises(ValueError, match=r"^config\.rollout\.partial_budget: a study"):
    study_grid.grid_from_config(c)
