"""Exactness of the train step's work savers: shared-prefix groups, skipped zero-advantage rows."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import losses, models  # noqa: E402
from offpolicy_jax.learn import batch_splits, scorer, step_options, train_state, train_step  # noqa: E402
from offpolicy_jax.scale import sharding  # noqa: E402
from offpolicy_jax.types import TrainBatch  # noqa: E402

G, K, P, N = 4, 4, 5, 6
B = G * K


def _model(**overrides):
  config = models.get_config("tiny", dtype=jnp.float32, param_dtype=jnp.float32)
  return models.Decoder(dataclasses.replace(config, **overrides), rngs=nnx.Rngs(0))


def _prompts(rng, vocab):
  lengths = np.array([P, 3, 1, 4])
  mask = (np.arange(P)[None] >= P - lengths[:, None]).astype(np.float32)
  return (rng.integers(1, vocab, (G, P)) * mask).astype(np.int32), mask


@pytest.fixture(scope="module")
def setup():
  model = _model()
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  prompts, prompt_mask = _prompts(rng, model.config.vocab_size)
  mask = (rng.uniform(size=(B, N)) > 0.15).astype(np.float32)
  mask[:, 0] = 1
  rewards = rng.integers(0, 2, B).astype(np.float32)
  rewards[K : 2 * K] = 1.0  # group 1 all right, group 3 all wrong: zero advantage
  rewards[3 * K :] = 0.0
  by_group = rewards.reshape(G, K)
  advantages = (by_group - by_group.mean(1, keepdims=True)).reshape(B)
  batch = TrainBatch(
    prompt_tokens=np.repeat(prompts, K, axis=0),
    prompt_mask=np.repeat(prompt_mask, K, axis=0),
    tokens=rng.integers(1, model.config.vocab_size, (B, N)).astype(np.int32),
    mask=mask,
    behavior_logp=np.zeros((B, N), np.float32),
    advantages=advantages.astype(np.float32),
    rewards=rewards,
    versions=np.zeros((B, N), np.int32),
    weights=np.ones(B, np.float32),
    behavior_kept=np.full((B, N), model.config.vocab_size, np.int32),
    old_logp=np.zeros((B, N), np.float32),
  )
  logp = scorer.token_logprobs(graphdef, params, batch, 1.0)[0]
  behavior = np.asarray(logp) + 0.2 * rng.normal(size=(B, N)) * mask
  behavior = behavior.astype(np.float32)
  batch = batch._replace(behavior_logp=behavior, old_logp=behavior)
  return dict(graphdef=graphdef, params=params, batch=batch, model=model)


def _update(setup, loss="grpo", batch=None, mesh=None, **options):
  """Params after one SGD(lr=1) step (so the change is minus the gradient) and the metrics."""
  sgd = optax.sgd(1.0)
  step = train_step.make_train_step(
    setup["graphdef"], sgd, loss, donate=False, group_size=K, mesh=mesh, **options
  )
  state = train_state.init_train_state(setup["params"], sgd, mesh=mesh)
  new, metrics = step(state, setup["batch"] if batch is None else batch, jax.random.key(3))
  return new.params, metrics


def _assert_same_update(a, b, atol=1e-5):
  leaves = zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0]), strict=True)
  for x, y in leaves:
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5)
  np.testing.assert_allclose(a[1]["loss"], b[1]["loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(a[1]["grad_norm"], b[1]["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize(
  "overrides",
  [
    {},
    {"scan_layers": True, "remat": True, "qk_norm": False},
    pytest.param({"remat": True}, marks=pytest.mark.slow),
  ],
)
def test_shared_prefix_logprobs_and_gradients_equal_the_plain_forward(setup, overrides):
  graphdef, params = nnx.split(_model(**overrides))
  b = setup["batch"]

  def total(p, shared):
    logp, ent = scorer.token_logprobs(graphdef, p, b, 0.9, K if shared else 0)
    return jnp.sum(logp) + 0.1 * jnp.sum(ent), (logp, ent)

  value_and_grad = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)
  (_, (lp, ent)), grads = value_and_grad(params, False)
  (_, (lp_s, ent_s)), grads_s = value_and_grad(params, True)
  np.testing.assert_allclose(lp_s, lp, atol=1e-5)
  np.testing.assert_allclose(ent_s, ent, atol=1e-5)
  assert float(jnp.abs(lp).sum()) > 0
  for x, y in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads), strict=True):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_shared_prefix_hidden_states_cover_the_prompt(setup):
  model, b = setup["model"], setup["batch"]
  h_p, _ = model.shared_prefix_hidden_states(b.prompt_tokens[::K], b.prompt_mask[::K], b.tokens, K)
  h_full, _ = model.hidden_states(b.prompt_tokens[::K], attention_mask=b.prompt_mask[::K])
  real = b.prompt_mask[::K] > 0
  np.testing.assert_allclose(np.asarray(h_p)[real], np.asarray(h_full)[real], atol=1e-5)


@pytest.mark.parametrize("options", [{"num_micro_batches": 2}, {"num_minibatches": 2}])
def test_shared_prefix_train_step_equals_plain(setup, options):
  plain = _update(setup, **options)
  shared = _update(setup, shared_prefix=True, **options)
  if options.get("num_minibatches", 1) == 1:
    _assert_same_update(shared, plain)
  else:  # shuffles move whole groups: a different, valid order; the step still runs.
    assert np.isfinite(float(shared[1]["loss"]))


@pytest.mark.parametrize("loss", ["grpo", "gspo", "dapo"])
def test_skipping_zero_advantage_rows_gives_the_same_update(setup, loss):
  full = _update(setup, loss)
  skipped = _update(setup, loss, skip_zero_advantage=True)
  _assert_same_update(skipped, full)
  moving = np.asarray(batch_splits.moving_rows(setup["batch"]))
  assert float(skipped[1]["rows_skipped"]) == B - moving.sum() >= 2 * K
  assert float(skipped[1]["tokens"]) == float(full[1]["tokens"])


def test_skipping_with_shared_prefix_and_micro_batches(setup):
  full = _update(setup, num_micro_batches=2)
  both = _update(setup, num_micro_batches=2, shared_prefix=True, skip_zero_advantage=True)
  _assert_same_update(both, full)


def test_skipping_on_a_mesh_and_with_nothing_to_train(setup):
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  full = _update(setup)
  skipped = _update(setup, mesh=mesh, skip_zero_advantage=True, shared_prefix=True)
  _assert_same_update(skipped, full)
  flat = setup["batch"]._replace(advantages=np.zeros(B, np.float32))
  params, metrics = _update(setup, batch=flat, skip_zero_advantage=True)
  assert float(metrics["rows_skipped"]) == B
  assert float(metrics["grad_norm"]) == 0.0
  assert all(np.isfinite(float(v)) for v in metrics.values())
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(setup["params"]), strict=True):
    np.testing.assert_array_equal(x, y)


def test_losses_that_are_not_inert_never_skip(setup):
  for name in ("opmd", "m2po", "oapl", "clip_cov"):
    options = step_options.StepOptions(losses.get_spec(name), skip_zero_advantage=True)
    assert not options.skips_rows, name
  kl = step_options.StepOptions(losses.get_spec("grpo", kl_coef=0.1), skip_zero_advantage=True)
  assert not kl.skips_rows


@pytest.mark.parametrize(
  "name", [n for n in losses.names() if losses.get_spec(n).zero_advantage_inert]
)
def test_inert_losses_give_zero_advantage_rows_no_gradient_and_no_coupling(name):
  """The property the skipping relies on, checked on each preset that claims it."""
  rng = np.random.default_rng(1)
  b, t = 6, 5
  mask = (rng.uniform(size=(b, t)) > 0.2).astype(np.float32)
  mask[:, 0] = 1
  behavior = rng.normal(size=(b, t)).astype(np.float32) - 2
  logp = behavior + 0.3 * rng.normal(size=(b, t)).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  adv[[1, 4]] = 0.0
  kw = dict(behavior_logp=behavior, proximal_logp=logp - 0.05)
  spec = losses.get_spec(name)

  def loss(lp, rows):
    out = losses.policy_loss(
      spec, logp=lp, advantages=adv[rows], mask=mask[rows], **{k: v[rows] for k, v in kw.items()}
    )
    return out.loss_sum, out.loss_count

  everything = np.arange(b)
  kept = np.array([0, 2, 3, 5])
  grad_all = jax.grad(lambda lp: loss(lp, everything)[0])(jnp.asarray(logp))
  grad_kept = jax.grad(lambda lp: loss(lp, kept)[0])(jnp.asarray(logp[kept]))
  np.testing.assert_array_equal(np.asarray(grad_all)[[1, 4]], 0.0)
  np.testing.assert_allclose(np.asarray(grad_all)[kept], grad_kept, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(loss(logp, everything)[0], loss(logp[kept], kept)[0], rtol=1e-6)
  _, count = losses.aggregate(jnp.zeros((b, t)), mask, spec.agg, max_len=spec.max_len)
  np.testing.assert_allclose(loss(logp, everything)[1], count)


def test_bad_shared_prefix_sizes_name_the_field(setup):
  with pytest.raises(ValueError, match="shared_prefix"):
    _update(setup, shared_prefix=True, num_micro_batches=8)
