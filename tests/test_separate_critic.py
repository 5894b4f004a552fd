"""A separate critic model (`critic.model`, `models.value`): its own forward, start, clipping,
checkpoint and export, and a run that learns with it and resumes exactly."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.learn import critic, train_state, train_step
from offpolicy_jax.models import value
from offpolicy_jax.run import components, export, loop, start, validation
from offpolicy_jax.scale import sharding
from offpolicy_jax.step import run_state
from offpolicy_jax.store import metrics_files
from offpolicy_jax.study import warm_starts
from tests.test_critic_run import LEARN, _fifths, _main_job
from tests.test_loop import full_and_resumed, small_config

SEPARATE = {"loss.name": "ppo_critic", "critic.model": "policy"}


def _with_head(c):
  return dataclasses.replace(c, value_head=True)


def _random_head(model, key):
  model.value_head.w[...] = jax.random.normal(key, model.value_head.w.shape)
  model.value_head.b[...] = jnp.float32(0.3)


def test_a_separate_critics_values_are_its_own_forwards_in_both_scoring_paths():
  c = models.get_config("tiny", vocab_size=40)
  own = models.get_config("tiny", vocab_size=40, num_layers=1)  # another architecture
  policy = models.Decoder(c, rngs=nnx.Rngs(params=0))
  alone = models.Decoder(_with_head(own), rngs=nnx.Rngs(params=1))
  _random_head(alone, jax.random.key(2))
  both = value.attach(models.Decoder(c, rngs=nnx.Rngs(params=0)), alone)
  assert both.config.critic == alone.config and value.has_separate_critic(both)
  prompts = jnp.array([[0, 3, 4, 9], [5, 6, 7, 8]])
  tokens = jnp.array([[1, 2, 11], [3, 4, 12], [13, 14, 15], [16, 17, 18]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], jnp.float32)
  rep = jnp.repeat(prompts, 2, axis=0)
  seq = models.sequence_logprobs(both, rep, rep > 0, tokens, mask, full=True)
  shared = models.shared_prefix_logprobs(both, prompts, prompts > 0, tokens, mask, 2, full=True)
  # The critic alone, as a model whose head is on its own trunk.
  want = models.sequence_logprobs(alone, rep, rep > 0, tokens, mask, full=True).values
  np.testing.assert_allclose(seq.values, want, atol=1e-5)
  np.testing.assert_allclose(shared.values, want, atol=1e-5)
  assert np.abs(want).max() > 0.1 and np.all(np.asarray(want)[np.asarray(mask) == 0] == 0)
  # The policy's own log-probs do not change with a critic beside it.
  plain = models.sequence_logprobs(policy, rep, rep > 0, tokens, mask)[0]
  np.testing.assert_allclose(seq.logp, plain, atol=1e-6)
  for bad, match in (({"vocab_size": 41}, "vocabulary 41"), ({"max_position_embeddings": 8}, "8")):
    with pytest.raises(ValueError, match=f"critic.model.*{match}"):
      other = models.Decoder(_with_head(dataclasses.replace(own, **bad)), rngs=nnx.Rngs(3))
      value.attach(models.Decoder(c, rngs=nnx.Rngs(params=0)), other)


def test_gae_values_of_a_separate_critic_cost_no_policy_forward():
  """The GAE prepass reads only the critic's values: XLA drops the policy's unused forward."""
  c = small_config(**SEPARATE, **{"critic.kl_coef": 0.0, "critic.reward_norm": False})
  fns = components.build_components(c).fns
  params = fns.model.init_params(0)
  batch = sharding.shard_batch(run_state.empty_batch(fns.sizes), fns.model.mesh)
  flops = {}
  for field in ("values", "logp"):  # the critic's forward; the policy's (the same architecture)
    f = lambda p, b, field=field: train_step._scored(
      fns.model.graphdef, fns.learner.options, p, None, b, 1, field
    )
    with jax.set_mesh(fns.model.mesh):
      cost = jax.jit(f).lower(params, batch).compile().cost_analysis()
    flops[field] = (cost[0] if isinstance(cost, list) else cost)["flops"]
  assert 0.8 < flops["values"] / flops["logp"] < 1.2, flops  # one forward, not two


def test_each_models_gradient_is_clipped_on_its_own():
  params = {"w": jnp.ones((2, 2)), "critic": {"w": jnp.ones((2, 2))}}
  grads = {"w": jnp.full((2, 2), 0.1), "critic": {"w": jnp.full((2, 2), 1e3)}}

  def first_update(separate_critic):
    # b1 = b2 = 0: Adam's update is -g / (|g| + eps), so eps = 1 shows the clipped g's size.
    opt = train_state.make_optimizer(
      1.0, max_grad_norm=1.0, b1=0.0, b2=0.0, eps=1.0, separate_critic=separate_critic
    )
    return opt.update(grads, opt.init(params), params)[0]

  own, shared = first_update(True), first_update(False)
  # Each clipped on its own: the policy's gradient (norm 0.2) unclipped, the critic's to
  # norm 1 (0.5 per entry); one global norm (2000) would shrink the policy's to 5e-5.
  np.testing.assert_allclose(own["w"], -0.1 / 1.1, rtol=1e-5)
  np.testing.assert_allclose(own["critic"]["w"], -0.5 / 1.5, rtol=1e-5)
  np.testing.assert_allclose(shared["w"], -5e-5, rtol=1e-3)


@pytest.mark.parametrize("source", ["policy", "tiny"])
def test_the_critic_starts_as_the_policys_warm_start_or_from_its_own_weights(source):
  config = small_config(total_steps=1, eval_prompts=0, **{**SEPARATE, "critic.model": source})
  comps = components.build_components(config)
  _, params = start.initial_weights(comps, log_fn=lambda _: None)
  assert "value_head" not in params and "critic" in params
  policy = value.without_head(params)
  trunk = value.without_head(params["critic"])
  if source == "policy":  # the warm-started policy, copied
    for a, b in zip(jax.tree.leaves(policy), jax.tree.leaves(trunk), strict=True):
      np.testing.assert_array_equal(a, b)
  else:  # the preset drawn from the seed's own stream
    assert not np.allclose(policy["embed_tokens"][...], trunk["embed_tokens"][...])
  np.testing.assert_array_equal(params["critic"]["value_head"]["w"][...], 0.0)
  # A study's cells start the same way from the stored warm start, which holds no critic.
  _, cell = warm_starts.Starts().get(comps, config.seed, config.seed)
  for a, b in zip(jax.tree.leaves(cell), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_separate_critic_learns_the_default_task(tmp_path):
  config = _main_job(**LEARN, **SEPARATE)
  rows, _ = metrics_files.split_rows(loop.train_and_evaluate(config, str(tmp_path)))
  first, last = _fifths(rows, "reward_mean")
  fifth = len(rows) // 5
  ev_first = critic.pooled_explained_variance(rows[:fifth])
  ev_last = critic.pooled_explained_variance(rows[-fifth:])
  print(f"reward {first:.3f} -> {last:.3f}; explained variance {ev_first:.3f} -> {ev_last:.3f}")
  assert last > first and ev_last > ev_first


def test_a_separate_critic_run_resumes_exactly_and_exports_a_critic_that_loads(tmp_path):
  # Partial credit: rewards that differ within a group from the first step, for the critic.
  kw = {**SEPARATE, "lag.sync_interval": 3, "task_kwargs.partial_credit": True}
  want, got = full_and_resumed(tmp_path, **kw)
  assert got == want
  assert "critic/explained_variance" in want[-1]
  # The checkpoint holds the critic: no resume can drop it or change its architecture.
  part = str(tmp_path / "part")
  for other in ("", "tiny-moe"):
    changed = small_config(total_steps=9, **{**kw, "critic.model": other})
    with pytest.raises(ValueError, match="^config.critic.model: the checkpoint of step 7"):
      loop.train_and_evaluate(changed, part, allow_config_change=True)
  out = str(tmp_path / "export")
  export.export_checkpoint(str(tmp_path / "part"), out, fmt="merged")
  assert os.path.isfile(os.path.join(out, "critic", value.FILE))
  loaded = models.from_pretrained(os.path.join(out, "critic"), value_head=True)
  head = np.asarray(loaded.value_head.w[...])
  assert np.abs(head).max() > 0  # trained from zero
  # The exported critic is the run's: `critic.model` loads it into the next run.
  again = small_config(total_steps=1, **{**kw, "critic.model": os.path.join(out, "critic")})
  _, params = start.initial_weights(components.build_components(again), log_fn=lambda _: None)
  np.testing.assert_allclose(params["critic"]["value_head"]["w"][...], head, rtol=1e-6)


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({**SEPARATE, "critic.model": "no_such_preset"}, "critic.model"),
    ({**SEPARATE, "critic.model": "/no/such/dir"}, "critic.model"),
    ({**SEPARATE, "lora.rank": 4}, "lora.rank"),
    ({**SEPARATE, "critic.warmup_steps": 6}, "critic.warmup_steps"),  # the whole run
  ],
)
def test_a_critic_model_that_cannot_be_built_is_refused_by_name(overrides, field):
  with pytest.raises(ValueError, match=f"^config.{field}: "):
    validation.validate_config(small_config(**overrides))
