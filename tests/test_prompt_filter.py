"""Prompts chosen by the critic's values (V_0): the choice, the values, a run, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import lag_study
from offpolicy_jax import models
from offpolicy_jax.models.logprobs import sequence_logprobs
from offpolicy_jax.rollout import prompt_filter
from offpolicy_jax.rollout.prompt_filter import PromptFilter
from offpolicy_jax.run import components, loop, validation
from offpolicy_jax.store import metrics_files
from offpolicy_jax.study import grid as grid_lib
from offpolicy_jax.study import reports
from tests.test_loop import full_and_resumed, small_config, strip_timing


def test_of_each_run_the_candidate_least_likely_to_give_equal_rewards_is_kept():
  filt = PromptFilter(pool=3, wrong=0.0, right=1.0, group_size=4)
  values = np.array([0.0, 0.9, 0.5, 1.0, 1.0, 0.2, -3.0, 7.0, 0.0, 0.25, 0.75, 0.1])
  valid = np.ones(12, bool)
  # Runs of 3: [0, .9, .5] -> .5; [1, 1, .2] -> .2; [-3, 7, 0] all certain -> the first;
  # [.25, .75, .1]: .25 and .75 tie (p and 1 - p) -> the first of them.
  np.testing.assert_array_equal(prompt_filter.choose(filt, values, valid), [2, 5, 6, 9])
  np.testing.assert_allclose(filt.all_equal(np.array([0.5, 0.0, 2.0])), [2 * 0.5**4, 1.0, 1.0])
  # An invalid row (a finite split's padding) is kept only from a run without a valid one.
  valid[2] = valid[6] = valid[7] = valid[8] = False
  np.testing.assert_array_equal(prompt_filter.choose(filt, values, valid)[[0, 2]], [1, 6])
  # Rewards on another scale: p = (V - wrong) / (right - wrong).
  scaled = PromptFilter(pool=2, wrong=-1.0, right=3.0, group_size=4)
  np.testing.assert_allclose(scaled.all_equal(np.array([1.0])), [2 * 0.5**4])
  with pytest.raises(ValueError, match="runs of 3"):
    prompt_filter.choose(filt, values[:4], valid[:4])


@pytest.mark.parametrize("scan_layers", [False, True])
def test_prompt_values_are_the_values_the_critic_trains_at_the_first_response_token(scan_layers):
  config = models.get_config("tiny", dtype="float32", value_head=True, scan_layers=scan_layers)
  model = models.Decoder(config, rngs=nnx.Rngs(0))
  rng = np.random.RandomState(0)
  model.value_head.w[...] = jnp.asarray(rng.randn(config.hidden_size), jnp.float32)
  model.value_head.b[...] = jnp.float32(0.3)
  b, p, n = 3, 7, 4
  lengths = jnp.array([7, 3, 1], jnp.int32)
  prompts = jnp.asarray(rng.randint(1, config.vocab_size, (b, p)), jnp.int32)
  prompts = jnp.where(jnp.arange(p)[None] >= p - lengths[:, None], prompts, 0)  # left-padded
  tokens = jnp.asarray(rng.randint(1, config.vocab_size, (b, n)), jnp.int32)
  prompt_mask = (jnp.arange(p)[None] >= p - lengths[:, None]).astype(jnp.float32)
  scored = sequence_logprobs(model, prompts, prompt_mask, tokens, jnp.ones((b, n)), full=True)
  v0 = prompt_filter.prompt_values(model, prompts, lengths)
  np.testing.assert_allclose(v0, scored.values[:, 0], rtol=1e-5, atol=1e-5)
  graphdef, params = nnx.split(model)
  np.testing.assert_allclose(
    prompt_filter.values_program(graphdef)(params, prompts, lengths), v0, rtol=1e-5, atol=1e-5
  )
  # A row's value does not depend on another row's prompt or on the padding's tokens.
  other = prompts.at[0].set(5).at[1, 0].set(9)
  np.testing.assert_allclose(
    prompt_filter.prompt_values(model, other, lengths)[1:], v0[1:], rtol=1e-5, atol=1e-5
  )


def test_a_run_choosing_its_prompts_reports_them_and_resumes_exactly(tmp_path):
  kw = {"loss.name": "vtrace", "lag.sync_interval": 3, "critic.prompt_pool": 3}
  kw |= {"task_kwargs.partial_credit": True}  # rewards that are not all 0: values that move
  want, got = full_and_resumed(tmp_path, **kw)
  assert got == want
  # Each step's prompts are chosen with the parameters it starts from, whatever the chunks of
  # steps the loop would otherwise run at once (its checkpoints set them here).
  once = small_config(total_steps=7, checkpoint_every=0, **kw)
  alone, _ = metrics_files.split_rows(loop.train_and_evaluate(once, str(tmp_path / "once")))
  assert strip_timing(alone) == want
  summary = reports.format_run_summary(str(tmp_path / "full"))
  assert "prompt values" in summary and "groups all equal" in summary
  for row in want:
    assert 0.0 <= row["v0/predicted_all_equal"] <= row["v0/predicted_all_equal_pool"] <= 1.0
  # The value head starts at 0 and learns: the later steps' values are not the first's.
  assert want[0]["v0/value_mean"] == 0.0 and want[-1]["v0/value_mean"] != 0.0
  # Three candidates are read per prompt sampled, from the run's one shuffled stream.
  fns = components.build_components(small_config(**kw)).fns
  candidates = next(fns.prompts(0))
  assert candidates["prompt_tokens"].shape[0] == 3 * 2
  plain = small_config(**{**kw, "critic.prompt_pool": 1})
  assert components.build_components(plain).fns.prompt_filter is None


def test_select_keeps_the_chosen_candidates_with_every_field_and_reports_them():
  fns = components.build_components(
    small_config(**{"loss.name": "vtrace", "critic.prompt_pool": 3})
  ).fns
  params = fns.model.init_params(0)
  head = params["value_head"]
  head["w"][...] = jnp.asarray(np.random.RandomState(1).randn(*head["w"].shape), jnp.float32)
  head["b"][...] = jnp.float32(0.4)
  batch = next(fns.prompts(0))
  program = prompt_filter.values_program(fns.model.graphdef)
  kept, fields = prompt_filter.select(fns.prompt_filter, program, params, fns.model.mesh, batch)
  model = nnx.merge(fns.model.graphdef, params)
  values = np.asarray(
    prompt_filter.prompt_values(model, batch["prompt_tokens"], batch["prompt_lengths"])
  )
  rows = prompt_filter.choose(fns.prompt_filter, values, batch["valid"])
  assert len(set(np.unique(values).round(6))) > 1  # the values do choose
  for k, v in batch.items():
    np.testing.assert_array_equal(kept[k], v[rows])
  predicted = fns.prompt_filter.all_equal(values)
  np.testing.assert_allclose(fields["v0/predicted_all_equal"], predicted[rows].mean(), rtol=1e-5)
  np.testing.assert_allclose(fields["v0/predicted_all_equal_pool"], predicted.mean(), rtol=1e-5)
  np.testing.assert_allclose(fields["v0/value_mean"], values[rows].mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"critic.prompt_pool": 2}, "critic.prompt_pool"),  # no critic to predict with
    (
      {"loss.name": "vtrace", "critic.prompt_pool": 2, "critic.prompt_right": 0.0},
      "critic.prompt_right",
    ),
    (
      {"loss.name": "vtrace", "critic.prompt_pool": 2, "lag.mode": "async"},
      "critic.prompt_pool",
    ),
    ({"critic.prompt_pool": 0}, "critic.prompt_pool"),
    ({"loss.name": "vtrace", "critic.prompt_pool": 2, "critic.gamma": 0.99}, "critic.gamma"),
  ],
)
def test_a_prompt_pool_that_cannot_work_is_refused_by_name(overrides, field):
  with pytest.raises(ValueError, match=f"^config.{field}: "):
    validation.validate_config(small_config(**overrides))


def test_a_study_refuses_a_prompt_pool():
  config = small_config(**{"loss.name": "vtrace", "critic.prompt_pool": 2})
  with pytest.raises(ValueError, match="^config.critic.prompt_pool: "):
    grid_lib._check_cell_config(config)  # a method's overrides
  study = lag_study.get_config("critic")  # the base: its own reason, not "needs a critic"
  study.critic.prompt_pool = 2
  with pytest.raises(ValueError, match="^config.critic.prompt_pool: a study's seeds"):
    grid_lib.grid_from_config(study)
