"""The critic: the value head on the trunk, its import / export, and the train step's value loss."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from offpolicy_jax import models, returns
from offpolicy_jax.learn import critic, train_state, train_step
from offpolicy_jax.models import value
from offpolicy_jax.types import TrainBatch

B, P, N = 8, 4, 6


@pytest.fixture(scope="module")
def setup():
  config = dataclasses.replace(models.get_config("tiny"), value_head=True)
  graphdef, params = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  prompt_mask = np.ones((B, P), np.float32)
  prompt_mask[::2, :2] = 0
  mask = np.ones((B, N), np.float32)
  mask[1, 4:] = 0
  mask[5, 2:] = 0
  mask[6, 1:3] = 0  # an environment's tokens inside a row (multi-turn)
  batch = TrainBatch(
    prompt_tokens=(rng.integers(1, config.vocab_size, (B, P)) * prompt_mask).astype(np.int32),
    prompt_mask=prompt_mask,
    tokens=rng.integers(1, config.vocab_size, (B, N)).astype(np.int32),
    mask=mask,
    behavior_logp=np.zeros((B, N), np.float32),
    advantages=np.zeros(B, np.float32),
    rewards=(rng.uniform(size=B) > 0.5).astype(np.float32),
    versions=np.zeros((B, N), np.int32),
    weights=np.ones(B, np.float32),
    behavior_kept=np.full((B, N), config.vocab_size, np.int32),
    old_logp=np.zeros((B, N), np.float32),
  )
  model = nnx.merge(graphdef, params)
  logp = models.sequence_logprobs(
    model, batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask
  )[0]
  batch = batch._replace(behavior_logp=np.asarray(logp), old_logp=np.asarray(logp))
  return dict(config=config, graphdef=graphdef, params=params, batch=batch)


def _fresh_model(setup):
  """The fixture's model on a copy of its parameters (`nnx.merge` shares the variables, so
  setting the merged model's head would change the fixture's)."""
  return nnx.merge(setup["graphdef"], jax.tree.map(jnp.copy, setup["params"]))


def _step(setup, spec, optimizer=None, **kw):
  opt = optimizer or optax.sgd(0.5)
  step = train_step.make_train_step(
    setup["graphdef"], opt, "reinforce", critic=spec, donate=False, **kw
  )
  stats = spec is not None and spec.reward_norm
  return step, train_state.init_train_state(setup["params"], opt, reward_stats=stats)


def test_the_value_head_starts_at_zero_and_is_exported_and_imported(setup, tmp_path):
  config = setup["config"]
  assert config.num_params() == models.get_config("tiny").num_params() + config.hidden_size + 1
  model = _fresh_model(setup)
  b = setup["batch"]
  scored = models.sequence_logprobs(
    model, b.prompt_tokens, b.prompt_mask, b.tokens, b.mask, full=True
  )
  np.testing.assert_array_equal(scored.values, 0.0)
  model.value_head.w[...] = jnp.linspace(-1, 1, config.hidden_size)
  model.value_head.b[...] = jnp.float32(0.25)
  models.save_pretrained(model, str(tmp_path))
  back = models.from_pretrained(str(tmp_path), value_head=True)
  np.testing.assert_array_equal(back.value_head.w[...], model.value_head.w[...])
  np.testing.assert_array_equal(back.value_head.b[...], 0.25)
  assert not hasattr(models.from_pretrained(str(tmp_path)), "value_head")  # a policy alone
  os.remove(tmp_path / value.FILE)  # an HF checkpoint has none: a zero head
  fresh = models.from_pretrained(str(tmp_path), value_head=True)
  np.testing.assert_array_equal(fresh.value_head.w[...], 0)


def test_a_corrupt_value_head_is_refused_by_name(setup, tmp_path):
  model = _fresh_model(setup)
  models.save_pretrained(model, str(tmp_path))
  file = tmp_path / value.FILE
  file.write_bytes(file.read_bytes()[:20])
  with pytest.raises(ValueError, match="value_head.safetensors"):
    models.from_pretrained(str(tmp_path), value_head=True)


def test_gae_in_the_step_is_the_reference_and_the_critic_fits_the_returns(setup):
  spec = critic.CriticSpec("gae", gamma=1.0, lam=0.95, whiten=False)
  b = setup["batch"]
  # The prepass (values micro-batch by micro-batch) against a direct computation.
  model = _fresh_model(setup)
  model.value_head.w[...] = jnp.linspace(-0.5, 0.5, setup["config"].hidden_size)
  graphdef, params = nnx.split(model)
  scored = models.sequence_logprobs(
    model, b.prompt_tokens, b.prompt_mask, b.tokens, b.mask, full=True
  )
  v = scored.values
  want = returns.gae(returns.token_rewards(b.rewards, b.mask), v, b.mask, gamma=1.0, lam=0.95)
  got = critic.with_gae(spec, jax.tree.map(jnp.asarray, b), lambda _: v)
  np.testing.assert_allclose(got.advantages, want.advantages, atol=1e-6)
  np.testing.assert_allclose(got.returns, want.returns, atol=1e-6)
  assert np.all(np.asarray(got.advantages)[b.mask == 0] == 0)
  # Training on a fixed batch: the critic learns its returns.
  adam = optax.adam(3e-3)
  step, state = _step({**setup, "params": params}, spec, adam)
  first = None
  for _ in range(80):
    state, m = step(state, b, jax.random.key(0))
    first = first or m
  assert float(m["critic/value_loss"]) < 0.2 * float(first["critic/value_loss"])
  assert float(m["critic/explained_variance"]) > 0.8 > float(first["critic/explained_variance"])
  assert not any(k.startswith("critic/_") for k in m)


def test_rewards_are_normalised_by_their_running_statistics_over_the_run(setup):
  spec = critic.CriticSpec("gae", reward_norm=True, reward_clip=1.5)
  rng = np.random.default_rng(1)
  batch = jax.tree.map(jnp.asarray, setup["batch"])
  stats, seen = jnp.zeros(critic.REWARD_STATS), []
  for i in range(3):  # three batches, each with one dropped row (weight 0)
    r = rng.normal(2.0, 3.0, B).astype(np.float32)
    w = np.ones(B, np.float32)
    w[i] = 0
    mb = batch._replace(rewards=jnp.asarray(r), weights=jnp.asarray(w))
    stats, out, m = critic.normalized_rewards(spec, stats, mb)
    seen.extend(r[w > 0])
    mean, std = np.mean(seen), np.std(seen)
    np.testing.assert_allclose(out.rewards, np.clip((r - mean) / std, -1.5, 1.5), atol=1e-5)
    np.testing.assert_allclose(m["critic/reward_norm_std"], std, rtol=1e-5)
    np.testing.assert_allclose(m["critic/reward_norm_mean"], mean, rtol=1e-5)
  assert np.abs(np.asarray(out.rewards)).max() == 1.5  # the clip binds on these draws
  # In the step the statistics advance call by call, and the critic's returns read the
  # normalised rewards: equal rewards in a first batch train as zero rewards would.
  step, state = _step(setup, spec)
  state, m = step(state, batch._replace(rewards=jnp.full((B,), 0.7)), jax.random.key(0))
  np.testing.assert_allclose(state.reward_stats, [B, 0.7, 0.0], atol=1e-6)
  plain, plain_state = _step(setup, dataclasses.replace(spec, reward_norm=False))
  _, want = plain(plain_state, batch._replace(rewards=jnp.zeros(B)), jax.random.key(0))
  assert float(m["critic/return_mean"]) == float(want["critic/return_mean"])
  assert float(m["loss"]) == float(want["loss"])
  state, m = step(state, batch, jax.random.key(1))
  assert float(state.reward_stats[0]) == 2 * B and float(m["critic/reward_norm_std"]) > 0


def test_a_value_warm_start_trains_the_head_alone_then_everything(setup):
  spec = critic.CriticSpec("gae", warmup_steps=2)
  opt = optax.adamw(1e-2, weight_decay=0.1)  # weight decay would move the policy too
  step, state = _step(setup, spec, opt)
  batch = setup["batch"]
  head = lambda p: p["value_head"]["w"][...]
  trunk = lambda p: value.without_head(p)
  start = state.params
  for i in range(2):
    state, m = step(state, batch, jax.random.key(i))
    assert float(m["critic/warmup"]) == 1.0
  for a, b in zip(jax.tree.leaves(trunk(state.params)), jax.tree.leaves(trunk(start)), strict=True):
    np.testing.assert_array_equal(a, b)  # the policy (the whole trunk) unchanged
  assert not np.allclose(head(state.params), head(start))  # the head learned
  state, m = step(state, batch, jax.random.key(2))
  assert float(m["critic/warmup"]) == 0.0
  moved = [
    not np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(trunk(state.params)), jax.tree.leaves(trunk(start)), strict=True
    )
  ]
  assert all(moved)  # after the warm-up the policy trains


def test_micro_batches_give_the_same_update(setup):
  spec = critic.CriticSpec("gae", value_clip=0.2)
  step1, state = _step(setup, spec)
  step2, _ = _step(setup, spec, num_micro_batches=2)
  s1, m1 = step1(state, setup["batch"], jax.random.key(0))
  s2, m2 = step2(state, setup["batch"], jax.random.key(0))
  for a, c in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
    np.testing.assert_allclose(a, c, atol=1e-6)
  head = np.asarray(s1.params["value_head"]["w"][...])
  assert np.abs(head).max() > 0  # the value loss moved the head
  np.testing.assert_allclose(m1["critic/value_loss"], m2["critic/value_loss"], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["gae", "vtrace"])
def test_per_turn_rewards_are_the_critics_rewards_in_every_micro_batch(setup, estimator):
  """A batch that keeps each turn's reward on its last token (`TrainBatch.token_rewards`):
  the critic's returns read them, through micro-batches, instead of the row's reward."""
  b = setup["batch"]
  turns = np.zeros((B, N), np.float32)
  turns[6, [0, 5]] = [0.25, 1.0]  # row 6: two turns around an environment's tokens
  turns[0, [2, 5]] = [-0.5, 0.5]
  per_turn = b._replace(token_rewards=turns, rewards=turns.sum(1))
  rows = np.asarray(critic.rewards(critic.CriticSpec(estimator), per_turn))
  np.testing.assert_array_equal(rows, turns)
  np.testing.assert_array_equal(  # without them: the row's reward at its last token
    np.asarray(critic.rewards(critic.CriticSpec(estimator), b)),
    np.asarray(returns.token_rewards(b.rewards, b.mask)),
  )
  spec = critic.CriticSpec(estimator, lam=1.0, value_clip=0.0, whiten=False)
  step1, state = _step(setup, spec)
  step2, _ = _step(setup, spec, num_micro_batches=2)
  s1, m1 = step1(state, per_turn, jax.random.key(0))
  s2, m2 = step2(state, per_turn, jax.random.key(0))
  np.testing.assert_allclose(m1["critic/value_loss"], m2["critic/value_loss"], rtol=1e-5)
  # Row 6's second turn is not paid the first turn's reward: its returns are 1.0, not 1.25.
  s3, m3 = step1(state, per_turn._replace(token_rewards=None), jax.random.key(0))
  assert not np.isclose(float(m1["critic/return_mean"]), float(m3["critic/return_mean"]))


def test_vtrace_on_policy_is_gae_with_lambda_one(setup):
  """On-policy (rho = 1), V-trace's targets are the Monte Carlo returns and its advantages GAE's."""
  model = _fresh_model(setup)
  model.value_head.w[...] = jnp.linspace(-0.5, 0.5, setup["config"].hidden_size)
  params = nnx.split(model)[1]
  s = {**setup, "params": params}
  gae = critic.CriticSpec("gae", lam=1.0, value_clip=0.0, whiten=False)
  vt = critic.CriticSpec("vtrace", lam=1.0)
  step_g, state = _step(s, gae)
  step_v, _ = _step(s, vt)
  sg, mg = step_g(state, setup["batch"], jax.random.key(0))
  sv, mv = step_v(state, setup["batch"], jax.random.key(0))
  for a, c in zip(jax.tree.leaves(sg.params), jax.tree.leaves(sv.params), strict=True):
    np.testing.assert_allclose(a, c, atol=2e-6)
  np.testing.assert_allclose(mg["critic/value_loss"], mv["critic/value_loss"], rtol=1e-5)
  # Off-policy, the truncated ratios change the update.
  # rho = exp(-0.5) < rho_bar: stale tokens the policy now finds less likely.
  b = setup["batch"]
  off = b._replace(behavior_logp=b.behavior_logp + 0.5 * b.mask)
  sv2, _ = step_v(state, off, jax.random.key(0))
  assert not np.allclose(sv2.params["value_head"]["w"][...], sv.params["value_head"]["w"][...])


@pytest.mark.parametrize("estimator", ["gae", "vtrace"])
def test_the_kl_penalty_is_paid_in_the_critics_rewards_against_the_reference(setup, estimator):
  """Every policy token pays -kl_coef (log mu - log pi_ref): nothing when the reference is the
  behaviour policy; against another reference, the update moves and `critic/ref_kl` is the
  behaviour's mean log-ratio to it."""
  b = jax.tree.map(jnp.asarray, setup["batch"])
  ref = b.behavior_logp - 0.3 * jnp.sin(jnp.arange(N, dtype=jnp.float32))[None] * b.mask
  spec = critic.CriticSpec("gae", whiten=False, kl_coef=0.1)
  v = jnp.zeros((B, N))
  penalised = returns.kl_penalized_rewards(
    returns.token_rewards(b.rewards, b.mask), b.behavior_logp, ref, b.mask, 0.1
  )
  want = returns.gae(penalised, v, b.mask, gamma=1.0, lam=0.95)
  got = critic.with_gae(spec, b, lambda _: v, lambda _: ref)
  np.testing.assert_allclose(got.returns, want.returns, atol=1e-6)
  assert not np.allclose(
    got.returns, critic.with_gae(critic.CriticSpec("gae"), b, lambda _: v).returns
  )

  plain, with_kl = critic.CriticSpec(estimator), critic.CriticSpec(estimator, kl_coef=0.5)
  step0, state = _step(setup, plain)
  step1, _ = _step(setup, with_kl)
  with pytest.raises(ValueError, match="ref_params"):
    step1(state, setup["batch"], jax.random.key(0))
  s0, _ = step0(state, setup["batch"], jax.random.key(0))
  same, m_same = step1(state, setup["batch"], jax.random.key(0), ref_params=setup["params"])
  for a, c in zip(jax.tree.leaves(s0.params), jax.tree.leaves(same.params), strict=True):
    np.testing.assert_allclose(a, c, atol=1e-6)  # the reference is mu: no penalty
  np.testing.assert_allclose(m_same["critic/ref_kl"], 0.0, atol=1e-5)
  other = _fresh_model(setup)
  other.norm.weight[...] = other.norm.weight[...] * 1.5  # sharper logits: another policy
  other_params = nnx.split(other)[1]
  moved, m = step1(state, setup["batch"], jax.random.key(0), ref_params=other_params)
  ref_logp = models.sequence_logprobs(other, b.prompt_tokens, b.prompt_mask, b.tokens, b.mask)[0]
  mask = np.asarray(b.mask)
  kl = float(((np.asarray(b.behavior_logp) - np.asarray(ref_logp)) * mask).sum() / mask.sum())
  np.testing.assert_allclose(m["critic/ref_kl"], kl, rtol=1e-4)
  assert abs(kl) > 1e-3
  head = lambda s: np.asarray(s.params["value_head"]["w"][...])
  assert not np.allclose(head(moved), head(s0))


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("estimator", "td", "critic.estimator"),
    ("gamma", 1.5, "critic.gamma"),
    ("lam", -0.1, "critic.lam"),
    ("value_coef", 0.0, "critic.value_coef"),
    ("value_clip", -1.0, "critic.value_clip"),
    ("c_bar", 2.0, "rho_bar"),
    ("kl_coef", -0.1, "critic.kl_coef"),
    ("reward_clip", 0.0, "critic.reward_clip"),
    ("warmup_steps", -1, "critic.warmup_steps"),
  ],
)
def test_bad_critic_settings_name_the_field(field, value, match):
  kw = {"estimator": "vtrace", field: value}
  with pytest.raises(ValueError, match=match):
    critic.CriticSpec(**kw)


def test_a_critic_without_a_value_head_is_refused(setup):
  graphdef, params = nnx.split(models.Decoder(models.get_config("tiny"), rngs=nnx.Rngs(0)))
  opt = optax.sgd(0.1)
  step = train_step.make_train_step(graphdef, opt, "reinforce", critic=critic.CriticSpec("gae"))
  with pytest.raises(ValueError, match="value head"):
    step(train_state.init_train_state(params, opt), setup["batch"], jax.random.key(0))


def test_the_heads_own_rate_is_adamw_at_that_rate(setup):
  """Scaling the head's AdamW updates by k is AdamW at k times the rate for the head."""
  params = setup["params"]
  grads = jax.tree.map(lambda x: jnp.ones_like(x) * 0.3, params)
  both = train_state.make_optimizer(1e-3, weight_decay=0.1, head_learning_rate=1e-2)
  policy = train_state.make_optimizer(1e-3, weight_decay=0.1)
  head = train_state.make_optimizer(1e-2, weight_decay=0.1)
  got = both.update(grads, both.init(params), params)[0]
  want_policy = policy.update(grads, policy.init(params), params)[0]
  want_head = head.update(grads, head.init(params), params)[0]
  np.testing.assert_allclose(
    got["value_head"]["w"][...], want_head["value_head"]["w"][...], rtol=1e-6
  )
  np.testing.assert_allclose(
    got["norm"]["weight"][...], want_policy["norm"]["weight"][...], rtol=1e-6
  )
