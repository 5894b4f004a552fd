"""Tests for the supervised warm start: targets, guarded steps, result checks."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from offpolicy_jax.models import tokenizers  # noqa: E402
from offpolicy_jax.run import sft  # noqa: E402


def test_sft_targets_are_answer_then_eos_right_padded():
  tok = tokenizers.CharTokenizer()
  tokens, mask = sft.encode_targets(tok, ["12", "4321"], max_len=4)
  want = [[*tok.encode("12"), tok.eos_id, tok.pad_id], tok.encode("4321")]  # truncated: no EOS
  assert tokens.tolist() == want
  assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


@pytest.fixture(scope="module")
def sft_env():
  from offpolicy_jax.run import components

  c = default.base_config()
  c.task, c.prompts_per_step, c.group_size = "reverse", 2, 2
  c.max_new_tokens, c.max_prompt_len = 6, 12
  c.sft.steps, c.sft.batch_size = 2, 4
  return components.build_components(c).fns


def test_warm_start_with_nan_learning_rate_raises(sft_env, monkeypatch):
  """Every supervised step is skipped: the run stops before RL, naming config.sft."""
  monkeypatch.setattr(sft, "_WARM_START_CACHE", {})
  match = r"config\.sft: every supervised step \(1 to 2\) was skipped.*learning_rate=nan"
  with pytest.raises(FloatingPointError, match=match):
    sft.warm_start(
      sft_env,
      sft_env.model.init_params(0),
      steps=2,
      batch_size=4,
      learning_rate=float("nan"),
      seed=0,
      log_fn=lambda _: None,
    )
  assert not sft._WARM_START_CACHE


@pytest.mark.parametrize("nonfinite_params", [True, False])
def test_warm_start_checks_its_result(sft_env, monkeypatch, nonfinite_params):
  """Non-finite final params raise; a few skipped steps are logged and the run goes on."""
  monkeypatch.setattr(sft, "_WARM_START_CACHE", {})
  params = {"w": jnp.array([1.0, np.nan if nonfinite_params else 2.0])}
  result = sft.SFTResult(params, [3.0, np.nan, 2.0], skipped_steps=[2])
  monkeypatch.setattr(sft, "run", lambda *args, **kwargs: result)
  logs = []
  warm = lambda: sft.warm_start(
    sft_env, params, steps=2, batch_size=4, learning_rate=0.1, seed=0, log_fn=logs.append
  )
  if nonfinite_params:
    match = r"config\.sft: the parameters are non-finite after supervised step 3 \(1 of 3"
    with pytest.raises(FloatingPointError, match=match):
      warm()
  else:
    np.testing.assert_array_equal(warm()["w"], params["w"])
    assert "sft: skipped 1 of 3 steps with non-finite values (step 2)" in logs


def test_distractor_demonstrations_are_a_fixed_fraction_of_examples():
  from offpolicy_jax.rewards import tasks

  task = tasks.get_task("reverse")
  tok = tokenizers.CharTokenizer()
  ex = task.train_source[3]
  digits = ex["prompt"][len("rev:") : -1]
  assert task.distractor(ex) == digits and task.answer(ex) == digits[::-1]
  n = 2000
  index = np.arange(n)
  prompts = iter(
    [{"prompt_tokens": np.ones((n, 4), np.int32), "prompt_lengths": np.full(n, 4), "index": index}]
  )
  batch = next(sft.reference_batches(task, tok, prompts, 8, distractor=0.6))
  examples = [task.train_source[int(i)] for i in index]
  shown = [tok.decode([t for t in row if t != tok.eos_id and t != 0]) for row in batch.tokens]
  wrong = np.array(
    [s == task.distractor(e) and s != task.answer(e) for s, e in zip(shown, examples, strict=True)]
  )
  right = np.array([s == task.answer(e) for s, e in zip(shown, examples, strict=True)])
  assert (wrong | right).all()
  assert 0.55 < wrong.mean() < 0.65  # palindromes count as right
  # The draw is per example: the same examples show the same targets in another batch.
  again = next(
    sft.reference_batches(
      task,
      tok,
      iter(
        [
          {
            **{"prompt_tokens": np.ones((n, 4), np.int32), "prompt_lengths": np.full(n, 4)},
            "index": index,
          }
        ]
      ),
      8,
      distractor=0.6,
    )
  )
  np.testing.assert_array_equal(batch.tokens, again.tokens)
  with pytest.raises(ValueError, match=r"sft\.distractor: task 'add'"):
    next(sft.reference_batches(tasks.get_task("add"), tok, iter([{"index": index[:2]}]), 8, 0.5))
