"""Adapter dropout (`lora.dropout`): only in the train step's current-policy forward."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from offpolicy_jax import losses, models
from offpolicy_jax.learn import scorer, step_options, train_state, train_step
from offpolicy_jax.models import lora, lora_ops
from offpolicy_jax.sampling import sampler as sampling
from offpolicy_jax.types import TrainBatch

G, K, P, N = 2, 2, 4, 5


def _model(dropout: float, scan_layers=False):
  """A tiny adapted decoder with non-zero B (the same weights for every `dropout`)."""
  lc = models.LoraConfig(rank=4, alpha=8.0, dropout=dropout)
  config = models.get_config("tiny", vocab_size=40, lora=lc, scan_layers=False)
  graphdef, adapter, base = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)), nnx.LoRAParam, ...)
  leaves, tree = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
  model = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), base)
  return models.layout.relayout(model, True) if scan_layers else model  # the same weights


def _batch(rows=G * K, seed=0):
  rng = np.random.default_rng(seed)
  mask = np.ones((rows, N), np.float32)
  mask[1, 3:] = 0
  return TrainBatch(
    prompt_tokens=rng.integers(1, 40, (rows, P)).astype(np.int32),
    prompt_mask=np.ones((rows, P), np.float32),
    tokens=rng.integers(1, 40, (rows, N)).astype(np.int32),
    mask=mask,
    behavior_logp=np.full((rows, N), -3.0, np.float32),
    advantages=rng.normal(size=rows).astype(np.float32),
    rewards=np.zeros(rows, np.float32),
    versions=np.zeros((rows, N), np.int32),
    weights=np.ones(rows, np.float32),
    behavior_kept=np.full((rows, N), 40, np.int32),
    old_logp=np.full((rows, N), -3.0, np.float32),
  )


def _step(model, batch, key, **kw):
  """The adapter after one SGD(1) step of GRPO on `batch` (base frozen), as numpy leaves."""
  graphdef, state = nnx.split(model)
  base, adapter = lora.split(state)
  sgd = optax.sgd(1.0)
  step = train_step.make_train_step(graphdef, sgd, "grpo", donate=False, **kw)
  new, metrics = step(train_state.init_train_state(adapter, sgd), batch, key, base=base)
  assert np.isfinite(float(metrics["loss"]))
  return [np.asarray(x) for x in jax.tree.leaves(new.params)]


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _close(a, b, tol=1e-5):
  return all(np.allclose(x, y, atol=tol, rtol=0) for x, y in zip(a, b, strict=True))


def test_dropout_changes_the_step_and_is_a_function_of_the_key():
  batch, k1, k2 = _batch(), jax.random.key(1), jax.random.key(2)
  plain = _step(_model(0.0), batch, k1)
  first = _step(_model(0.3), batch, k1)
  assert _equal(first, _step(_model(0.3), batch, k1))  # reproducible for the same key
  assert not _close(first, plain, 1e-4)
  assert not _close(first, _step(_model(0.3), batch, k2), 1e-4)


def test_micro_batches_draw_distinct_masks():
  """[X; X] in two micro-batches equals X in one iff both micro-batches drew one mask."""
  half = _batch(rows=G * K)
  # Row u goes to micro-batch u % 2: repeating every row puts X in both micro-batches.
  twice = jax.tree.map(lambda x: np.repeat(x, 2, axis=0), half)
  key = jax.random.key(3)
  for p, same in ((0.0, True), (0.3, False)):
    one = _step(_model(p), half, key)
    two = _step(_model(p), twice, key, num_micro_batches=2)
    assert _close(one, two) == same, p


def test_dropout_zero_derives_no_key_and_dropout_does():
  """p = 0 compiles the program without dropout: no random primitive is traced."""
  batch = _batch()

  def primitives(p):
    graphdef, state = nnx.split(_model(p))
    base, adapter = lora.split(state)
    sgd = optax.sgd(1.0)
    options = step_options.StepOptions(losses.get_spec("grpo"))
    fn = lambda st, key: train_step.train_step(graphdef, sgd, options, st, batch, key, base=base)
    jaxpr = jax.make_jaxpr(fn)(train_state.init_train_state(adapter, sgd), jax.random.key(0))
    return str(jaxpr)

  assert "random_bits" not in primitives(0.0) and "fold_in" not in primitives(0.0)
  assert "random_bits" in primitives(0.3)


def test_sampler_scorer_and_plain_forward_ignore_dropout():
  """The sampler, the scorer of old log-probs and the keyless forward never drop out."""
  prompts = jnp.array([[0, 3, 4, 5], [6, 7, 8, 9]], jnp.int32)
  lengths = jnp.array([3, 4], jnp.int32)
  outs, scores = [], []
  for p in (0.0, 0.5):
    graphdef, params = nnx.split(_model(p))
    fn = sampling.make_sampler(graphdef, max_new_tokens=N, group_size=K, temperature=1.0)
    out = fn(params, prompts, lengths, jax.random.key(2))
    outs.append(out)
    options = step_options.StepOptions(losses.get_spec("grpo"), group_size=K)
    scores.append(scorer.make_scorer(graphdef, options)(params, prompts, lengths, out))
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  np.testing.assert_array_equal(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs))
  np.testing.assert_array_equal(np.asarray(scores[0]), np.asarray(scores[1]))
  # On-policy: the scorer's log pi_old at the sampling parameters is the behaviour's (ratio 1).
  m = np.asarray(outs[1].mask) > 0
  gap = np.abs(np.asarray(scores[1]) - np.asarray(outs[1].logprobs))[m]
  assert gap.max() < 1e-5


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared_prefix"])
def test_scan_and_loop_layers_draw_the_same_masks(shared):
  tokens = jax.random.randint(jax.random.key(0), (G * K, N), 0, 40)
  prompt = jax.random.randint(jax.random.key(1), (G, P), 0, 40)
  key = jax.random.key(4)
  outs = []
  for scan in (False, True):
    model = _model(0.3, scan_layers=scan)
    if shared:
      outs.append(model.shared_prefix_hidden_states(prompt, jnp.ones((G, P)), tokens, K, key)[1])
    else:
      outs.append(model.hidden_states(tokens, dropout_key=key)[0])
  np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), atol=1e-5)
  if not shared:
    without = _model(0.3).hidden_states(tokens)[0]
    assert float(jnp.abs(without - outs[0]).max()) > 1e-3


def test_dropout_rescales_kept_features():
  x = jnp.ones((1000,))
  y = lora_ops.dropout(x, 0.25, jax.random.key(0))
  kept = np.asarray(y) > 0
  np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75)
  assert 0.7 < kept.mean() < 0.8
  assert lora_ops.dropout(x, 0.25, None) is x
  assert lora_ops.dropout(x, 0.0, jax.random.key(0)) is x
