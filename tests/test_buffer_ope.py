"""Off-policy evaluation from the replay buffer, logged in eval rows (`learn.buffer_ope`)."""

import numpy as np
import pytest

from offpolicy_jax import config_schema, ope
from offpolicy_jax.run import loop
from offpolicy_jax.store import metrics_files
from tests.test_loop import small_config

KEYS = ("is", "wis", "pdwis")


def test_the_schema_offers_every_estimator():
  assert set(config_schema.OPE_ESTIMATORS) == set(ope.names())


def test_with_the_policy_unchanged_the_estimates_are_the_buffers_own_reward(tmp_path):
  """Learning rate 0: pi = mu, so every importance weight is 1 (the exact log-prob contract),
  the estimates equal what the sampler earned and the effective sample size is every row."""
  cfg = small_config(
    total_steps=4,
    eval_every=2,
    **{"optimizer.learning_rate": 0.0, "lag.sync_interval": 1, "sft.enabled": False},
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path / "run"))
  train, evals = metrics_files.split_rows(rows)
  assert [r["step"] for r in evals] == [0, 2, 4]
  assert not any(k.startswith("ope/") for k in evals[0])  # nothing in the buffer at step 0
  for ev in evals[1:]:
    assert ev["ope/rows"] == 8  # the buffer's one batch: 2 prompts x 4 responses
    assert ev["ope/staleness_mean"] == 1.0  # sampled one optimizer step ago
    for name in KEYS:
      assert ev[f"ope/{name}"] == pytest.approx(ev["ope/behavior_reward"], abs=1e-4), name
      assert ev[f"ope/{name}_ess"] == pytest.approx(8.0, rel=1e-4)
      assert ev[f"ope/{name}_low"] <= ev[f"ope/{name}"] <= ev[f"ope/{name}_high"]
  # The buffer at step 4 holds step 4's batch: the estimate is that batch's mean reward.
  assert evals[2]["ope/behavior_reward"] == pytest.approx(train[3]["reward_mean"], abs=1e-6)


def test_a_run_asked_for_no_estimator_logs_none(tmp_path):
  cfg = small_config(total_steps=1, eval_ope="", **{"sft.enabled": False})
  _, evals = metrics_files.split_rows(loop.train_and_evaluate(cfg, str(tmp_path / "run")))
  assert evals and not any(k.startswith("ope/") for ev in evals for k in ev)
  assert np.isfinite(evals[-1]["eval/accuracy"])


def test_the_doubly_robust_estimators_read_the_critic(tmp_path):
  """A critic run logs dr and wdr; with the policy and its zero head unchanged (learning rate
  0) the doubly robust estimate is per-decision IS exactly, here the buffer's own reward."""
  cfg = small_config(
    total_steps=2,
    eval_every=2,
    eval_ope="pdis,dr,wdr",
    **{"optimizer.learning_rate": 0.0, "loss.name": "vtrace", "sft.enabled": False},
  )
  _, evals = metrics_files.split_rows(loop.train_and_evaluate(cfg, str(tmp_path / "run")))
  ev = evals[-1]
  for name in ("pdis", "dr", "wdr"):
    assert ev[f"ope/{name}"] == pytest.approx(ev["ope/behavior_reward"], abs=1e-4), name
    assert ev[f"ope/{name}_low"] <= ev[f"ope/{name}"] <= ev[f"ope/{name}_high"]


def test_a_studys_ope_summary_is_the_error_and_the_coverage_against_the_truth():
  from offpolicy_jax.study import report

  ope = {
    "ope/is": [0.5, 0.7],
    "ope/is_low": [0.4, 0.65],
    "ope/is_high": [0.6, 0.75],
    "ope/is_ess": [8.0, 8.0],
    "ope/behavior_reward": [0.3, 0.3],
    "ope/rows": [8.0, 8.0],
    "truth": [0.55, 0.6],
  }
  got = report.ope_summary(ope)
  assert got == pytest.approx(
    {
      "ope_is_abs_error": 0.075,  # |0.5 - 0.55| and |0.7 - 0.6|
      "ope_is_coverage": 0.5,  # 0.55 in [0.4, 0.6]; 0.6 not in [0.65, 0.75]
      "ope_behavior_abs_error": 0.275,
    }
  )
  assert report.ope_summary({}) == {}


def test_a_study_refuses_ope_it_cannot_compare_or_run():
  from configs import lag_study
  from offpolicy_jax.study import grid

  config = lag_study.get_config("critic")
  config.unlock()
  config.study.ope = "is"
  config.eval_samples = 1
  with pytest.raises(ValueError, match="^config.study.ope: .*eval_samples is 1"):
    grid.grid_from_config(config)
  config.eval_samples = 4
  config.study.ope = "is,dr"  # grpo and rec_oneside_nois have no critic
  with pytest.raises(ValueError, match="^config.study.ope: dr and wdr .* 'grpo' has none"):
    grid.grid_from_config(config)
