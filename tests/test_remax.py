"""ReMax: a greedy response per group as the baseline, drawn in the same batch and not trained
on (`advantages.remax`, `sampling.make_sampler(greedy_first=True)`, `step.packing`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import advantages, errors, models
from offpolicy_jax.run import loop, validation
from offpolicy_jax.sampling import sampler
from offpolicy_jax.step import packing
from offpolicy_jax.step.run_state import Packing
from offpolicy_jax.store import metrics_files
from tests.test_critic_run import LEARN, _fifths, _main_job
from tests.test_loop import small_config


def test_remax_advantages_are_rewards_against_the_greedy_one():
  r = jnp.array([[0.5, 1.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
  adv = advantages.compute("remax", r)
  np.testing.assert_allclose(adv, [[0, 0.5, -0.5, 0], [0, 0, 0, 0], [0, 1, 1, 0]])
  # An invalid greedy response leaves no baseline; invalid samples get 0.
  valid = jnp.array([[False, True, True, True], [True] * 4, [True, True, False, True]])
  adv = advantages.compute("remax", r, valid=valid)
  np.testing.assert_allclose(adv, [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]])


def test_the_first_row_of_each_group_is_greedy_and_weighs_nothing(numpy_init):
  config = models.get_config("tiny")
  graphdef, params = numpy_init(config)
  g, k, p, n = 2, 3, 5, 6
  prompts = jax.random.randint(jax.random.key(1), (g, p), 1, config.vocab_size)
  lengths, key = jnp.array([p, p - 1]), jax.random.key(2)
  kw = dict(max_new_tokens=n, temperature=1.0)
  remax = sampler.make_sampler(graphdef, group_size=k, greedy_first=True, **kw)(
    params, prompts, lengths, key
  )
  plain = sampler.make_sampler(graphdef, group_size=k, **kw)(params, prompts, lengths, key)
  greedy = sampler.make_sampler(graphdef, group_size=1, max_new_tokens=n, temperature=0.0)(
    params, prompts, lengths, key
  )
  first = np.arange(g * k) % k == 0
  np.testing.assert_array_equal(remax.tokens[first], greedy.tokens)
  np.testing.assert_allclose(remax.logprobs[first], greedy.logprobs, atol=1e-6)
  np.testing.assert_array_equal(remax.tokens[~first], plain.tokens[~first])  # draws unchanged
  assert not np.array_equal(plain.tokens[first], greedy.tokens)  # a sample, not the argmax
  prompt_rows = {"prompt_tokens": prompts, "prompt_lengths": lengths}
  rewards = jnp.array([0.0, 1.0, 0.5, 1.0, 1.0, 0.0])
  for name, want in (("remax", ~first), ("rloo", np.ones(g * k, bool))):
    batch = packing.pack(Packing(k, name), prompt_rows, remax, rewards, 0, key)
    np.testing.assert_array_equal(np.asarray(batch.weights) > 0, want)
    if name == "remax":  # against each group's greedy reward (rows 0 and 3)
      np.testing.assert_allclose(batch.advantages, [0, 1, 0.5, 0, 0, -1])


@pytest.mark.parametrize(
  "field, value",
  [("rollout.continuous_slots", 2), ("rollout.partial_budget", 4), ("multiturn.max_turns", 3)],
)
def test_remax_refuses_samplers_without_a_greedy_row_by_name(field, value):
  overrides = {"loss.name": "remax", field: value}
  with pytest.raises(errors.ConfigError, match=f"config.{field}: advantage 'remax'"):
    validation.validate_settings(small_config(**overrides))


def test_remax_learns_the_default_task(tmp_path):
  config = _main_job(**LEARN, **{"loss.name": "remax"})
  rows, _ = metrics_files.split_rows(loop.train_and_evaluate(config, str(tmp_path)))
  first, last = _fifths(rows, "reward_mean")
  print(f"remax: reward {first:.3f} -> {last:.3f}")
  assert last > first


def test_the_greedy_rows_count_as_sampled_not_as_trained(tmp_path):
  rows = loop.train_and_evaluate(
    small_config(total_steps=2, **{"loss.name": "remax"}), str(tmp_path)
  )
  train, _ = metrics_files.split_rows(rows)
  for row in train:  # one update per batch, replay of one batch: each row trained once
    assert row["sampled_tokens"] > row["tokens"] > 0
