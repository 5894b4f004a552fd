"""Multi-turn episodes under lag.mode='async': parameters published mid-episode take over."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import types  # noqa: E402
from offpolicy_jax.rollout import episodes  # noqa: E402
from offpolicy_jax.run import components, loop  # noqa: E402
from offpolicy_jax.step import host_step, run_state  # noqa: E402
from offpolicy_jax.store import metrics_files  # noqa: E402
from tests.test_multiturn_run import _config  # noqa: E402


def _perturbed(params, seed):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    tree,
    [
      x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
      if jnp.issubdtype(x.dtype, jnp.floating)
      else x
      for x, k in zip(leaves, keys, strict=True)
    ],
  )


def test_an_episode_continues_under_newer_parameters_with_per_token_versions():
  components.clear_cache()
  cfg = _config(**{"rollout.score_old": True, "sft.enabled": False})
  fns = components.build_components(cfg).fns
  prompts = next(fns.prompts(seed=0))
  p0 = fns.model.init_params(0)
  p1 = _perturbed(p0, 1)
  asked = []

  def latest():  # version 7 is published while turn 0 decodes
    asked.append(1)
    return p1, 7

  _, batch, _, stats = host_step.collect(fns, fns.rollout, None, p0, 5, prompts, 3, 0, latest)
  assert asked and stats["episode/parameter_updates"] == 1
  mask = np.asarray(batch.mask) > 0
  turn = np.asarray(types.turn_ids(batch.mask))
  versions = np.asarray(batch.versions)
  assert (versions[mask & (turn == 0)] == 5).all()
  later = mask & (turn > 0)
  assert later.any() and (versions[later] == 7).all()
  # pi_old of each token is the learner's score at its own version's parameters.
  tokens, lengths = prompts["prompt_tokens"], prompts["prompt_lengths"]
  out = episodes.play(
    fns.rollout.ep,
    p0,
    prompts,
    run_state.step_key(0, 3, run_state.SAMPLE),
    task=fns.task,
    split="train",
    group_size=fns.sizes.group_size,
    update_params=lambda t: p1 if t == 1 else None,
  ).out
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(batch.tokens))
  s0 = np.asarray(fns.rollout.score_old(p0, tokens, lengths, out))
  s1 = np.asarray(fns.rollout.score_old(p1, tokens, lengths, out))
  old = np.asarray(batch.old_logp)
  np.testing.assert_allclose(old[mask & (turn == 0)], s0[mask & (turn == 0)], atol=1e-5)
  np.testing.assert_allclose(old[later], s1[later], atol=1e-5)
  # The behaviour log-probs of later turns were drawn under p1: they match its score.
  np.testing.assert_allclose(np.asarray(batch.behavior_logp)[later], s1[later], atol=1e-4)


def test_async_multi_turn_run_trains(tmp_path):
  components.clear_cache()
  cfg = _config(total_steps=4, **{"lag.mode": "async", "lag.max_staleness": 4})
  rows = loop.train_and_evaluate(cfg, str(tmp_path / "run"))
  train, evals = metrics_files.split_rows(rows)
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  for r in train:
    assert np.isfinite(r["loss"]) and 1.0 <= r["episode/turns"] <= 4.0
    assert r["episode/parameter_updates"] >= 0
    assert r["behavior_version"] <= r["step"] - 1
  assert any(r["grad_norm"] > 0 for r in train)
  assert "eval/turns" in evals[-1]


def test_two_sampler_threads_play_episodes_on_lanes_of_their_own(tmp_path):
  """`lag.sampler_threads=2`: two batches of episodes in flight, the second thread's
  environment calls on verifier workers of its own (lane 1)."""
  from offpolicy_jax.rewards import verifiers

  cfg = _config(total_steps=4, **{"lag.mode": "async", "lag.sampler_threads": 2})
  rows = loop.train_and_evaluate(cfg, str(tmp_path / "run"))
  train, _ = metrics_files.split_rows(rows)
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  for r in train:
    assert np.isfinite(r["loss"]) and r["reward_failures"] == 0
    assert r["behavior_version"] <= r["step"] - 1
  settings = (int(cfg.reward_workers or os.cpu_count()), cfg.reward_memory_mb, cfg.reward_sandbox)
  assert (*settings, 1) in verifiers._POOLS  # started by the second thread's calls
  pool_1 = verifiers.get_pool(*settings, lane=1)
  assert pool_1.pids() and set(pool_1.pids()).isdisjoint(verifiers.get_pool(*settings).pids())
  last = train[-1]
  assert 0 < last["time/run_sampler_busy_s"] <= last["time/run_wall_s"]


def test_the_episode_pool_runs_under_async_with_exact_per_token_scores(tmp_path):
  """Episodes in flight across steps (`rollout.episode_pool`) on the sampler thread: the
  thread owns the pool, trajectories span versions, and pi_old is each token's own score."""
  common = {"rollout.partial_budget": 2, "rollout.score_old": True, "lag.mode": "async"}
  rows = loop.train_and_evaluate(_config(total_steps=6, **common), str(tmp_path / "run"))
  train, _ = metrics_files.split_rows(rows)
  assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
  assert sum(r["partial_emitted_groups"] for r in train) > 0
  assert max(r["partial_inflight_groups"] for r in train) >= 4
  assert sum(r["partial_mixed_rows"] for r in train) > 0  # trajectories spanning versions
  for r in train:
    assert r["partial_dropped_prompts"] == 0 and r["reward_failures"] == 0
    assert abs(r["mismatch_kl_k3"]) < 1e-5, r["mismatch_kl_k3"]
    assert r["behavior_version"] <= r["step"] - 1


def test_a_carried_copy_shares_nothing_with_the_pool_it_copies():
  """`producer.carried`: the trainer's copy of the thread's pool is its own."""
  from offpolicy_jax.step import producer

  comps = components.build_components(_config(**{"rollout.partial_budget": 2}))
  rollout = comps.fns.rollout
  pool = rollout.init()
  pool.occupied[1] = True
  pool.rows["tokens"][3, 2] = 7
  pool.turns.states[0] = {"x": [1]}
  copy = rollout.restore(rollout.init(), *producer.carried(rollout, pool))
  assert copy is not pool and copy.occupied[1] and copy.rows["tokens"][3, 2] == 7
  assert copy.turns.states[0] == {"x": [1]}
  pool.occupied[1], pool.rows["tokens"][3, 2] = False, 0
  pool.turns.states[0]["x"].append(2)
  assert copy.occupied[1] and copy.rows["tokens"][3, 2] == 7 and copy.turns.states[0] == {"x": [1]}
