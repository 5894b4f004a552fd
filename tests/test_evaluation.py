"""Tests for held-out evaluation: fixed prompts, greedy accuracy, pass@k."""

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax.run import components, evaluation  # noqa: E402
from tests.test_loop import small_config  # noqa: E402


@pytest.fixture(scope="module")
def fns():
  return components.build_components(small_config()).fns


def test_eval_prompts_are_the_first_n_of_the_split(fns):
  batches = evaluation.eval_prompts(fns, 3)  # prompts_per_step = 2: batches of 2
  index = np.concatenate([b["index"] for b in batches])
  valid = np.concatenate([b["valid"] for b in batches])
  assert index[valid].tolist() == [0, 1, 2] and valid.sum() == 3
  assert evaluation.eval_prompts(fns, 3) is batches  # cached on the step functions


def test_evaluate_reports_accuracy_and_pass_at_k(fns):
  params = fns.model.init_params(0)
  key = jax.random.key(0)
  ev = evaluation.evaluate(fns, params, key, num_prompts=4, k=2)
  assert set(ev) == {
    "eval/accuracy",
    "eval/reward_mean",
    "eval/response_len",
    "eval/reward_failures",
    "eval/pass@2",
    "eval/sample_accuracy",
    "eval/sample_reward",
  }
  assert 0.0 <= ev["eval/accuracy"] <= 1.0 and ev["eval/response_len"] >= 1.0
  assert ev["eval/sample_reward"] == ev["eval/sample_accuracy"]  # a 0/1 reward
  # pass@k >= the mean accuracy of the same samples; the same key gives the same numbers.
  assert ev["eval/pass@2"] >= ev["eval/sample_accuracy"]
  assert evaluation.evaluate(fns, params, key, num_prompts=4, k=2) == ev
  assert evaluation.evaluate(fns, params, key, num_prompts=0, k=2) == {}
  assert "eval/pass@2" not in evaluation.evaluate(fns, params, key, num_prompts=4, k=1)
