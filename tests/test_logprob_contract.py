"""The log-prob contract (docs/science.md s7): the learner reproduces mu on every sampled token.

For every sampling setting the sampler accepts (temperature, top-k, top-p,
stop sequences), teacher-forced scoring at the behaviour's parameters, as the
train step does it (`scorer.token_logprobs` with the run's `StepOptions`),
equals the recorded log mu within 1e-5 (float32); `behavior_logp="full"`
records the untruncated tempered log-prob and the learner then scores the full
softmax. A bf16 sampler against an fp32 learner differs (engine mismatch),
and agrees when the learner scores in the sampler's dtype.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from offpolicy_jax import models, types
from offpolicy_jax.learn import scorer
from offpolicy_jax.sampling import sampler as sampling

N = 8  # max_new_tokens
K = 3  # group_size


@pytest.fixture(scope="module")
def tiny(numpy_init):
  """(graphdef, params) of the tiny preset; a gentle scale so top-p keeps many tokens."""
  return numpy_init(models.get_config("tiny"), scale=4.0)


@pytest.fixture(scope="module")
def prompts():
  tokens = np.array([[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16]], np.int32)
  return tokens, np.array([3, 6], np.int32)


def _batch(prompts, out) -> types.TrainBatch:
  tokens, lengths = prompts
  zeros_b = jnp.zeros(out.tokens.shape[0])
  return types.pack_groups(
    tokens,
    lengths,
    out.tokens,
    out.mask,
    out.logprobs,
    jnp.zeros(out.tokens.shape, jnp.int32),
    zeros_b,
    zeros_b,
    out.kept,
  )


@pytest.fixture(scope="module")
def score(tiny):
  """Jitted learner scoring: (params, batch, temperature, truncated, top_k, shared) -> logp."""
  graphdef, _ = tiny

  @jax.jit(static_argnums=(2, 3, 4, 5))
  def fn(params, batch, temperature, truncated, top_k, shared):
    return scorer.token_logprobs(
      graphdef, params, batch, temperature, K if shared else 0, truncated=truncated, top_k=top_k
    )[0]

  return fn


GRID = list(itertools.product((1.0, 0.7), (1.0, 0.8), (0, 5)))


@pytest.mark.parametrize("temperature,top_p,top_k", GRID)
def test_learner_reproduces_mu(tiny, prompts, score, temperature, top_p, top_k):
  graphdef, params = tiny
  sampler = sampling.make_sampler(
    graphdef,
    max_new_tokens=N,
    group_size=K,
    temperature=temperature,
    top_p=top_p,
    top_k=top_k,
    eos_id=3,
    stop_sequences=((7, 8),),
  )
  out = sampler(params, *prompts, jax.random.key(1))
  batch = _batch(prompts, out)
  truncates = top_p < 1.0 or top_k > 0
  mask = np.asarray(out.mask) > 0
  for shared in (False, True):
    logp = np.asarray(score(params, batch, temperature, truncates, top_k, shared))
    np.testing.assert_allclose(logp[mask], np.asarray(out.logprobs)[mask], atol=1e-5)
  if truncates:
    # Scoring the full softmax instead is the bug the contract fixes: ratios below 1.
    full = np.asarray(score(params, batch, temperature, False, 0, False))
    gap = np.asarray(out.logprobs)[mask] - full[mask]
    assert gap.min() > -1e-5 and gap.max() > 1e-2


@pytest.mark.parametrize("top_p,top_k", [(0.8, 0), (1.0, 5)])
def test_full_behavior_logp_is_the_untruncated_softmax(tiny, prompts, score, top_p, top_k):
  graphdef, params = tiny
  sampler = sampling.make_sampler(
    graphdef,
    max_new_tokens=N,
    group_size=K,
    temperature=0.7,
    top_p=top_p,
    top_k=top_k,
    behavior_logp="full",
  )
  out = sampler(params, *prompts, jax.random.key(2))
  mask = np.asarray(out.mask) > 0
  logp = np.asarray(score(params, _batch(prompts, out), 0.7, False, 0, False))
  np.testing.assert_allclose(logp[mask], np.asarray(out.logprobs)[mask], atol=1e-5)
  assert np.asarray(out.kept)[mask].max() < models.get_config("tiny").vocab_size


def _log_kept_mass_ref(logp_v, logp_y, kept):
  """float64: log of the mass of y and the kept - 1 most likely other tokens."""
  p = np.exp(np.asarray(logp_v, np.float64))
  order = np.sort(p)[::-1]
  py = np.exp(np.float64(logp_y))
  c = order[: kept - 1].sum()
  return np.log(c + min(order[kept - 1], py))


def test_log_kept_mass_matches_a_float64_reference_with_ties_and_outsiders():
  rng = np.random.default_rng(0)
  v = 12
  z = rng.normal(size=(5, v)) * 2
  z[1, 3] = z[1, 4] = z[1].max() + 0.5  # a tie at the top
  logp_v = z - np.log(np.exp(z).sum(-1, keepdims=True))
  order = np.argsort(-logp_v, axis=-1)
  # y inside the kept set, at its edge, and (away from the behaviour) outside it.
  ys = np.array([order[0, 0], order[1, 2], order[2, 7], order[3, 0], order[4, 11]])
  kept = np.array([3, 3, 4, v, 1])
  logp_y = logp_v[np.arange(5), ys]
  got = models.log_kept_mass(
    jnp.asarray(logp_v, jnp.float32), jnp.asarray(logp_y, jnp.float32), jnp.asarray(kept)
  )
  ref = [_log_kept_mass_ref(logp_v[i], logp_y[i], kept[i]) for i in range(5)]
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-6)
  # top_k bounds the sort: same values when the kept sets lie within the top 4 (and ties).
  got_k = models.log_kept_mass(
    jnp.asarray(logp_v[:3], jnp.float32),
    jnp.asarray(logp_y[:3], jnp.float32),
    jnp.asarray(kept[:3]),
    top_k=4,
  )
  np.testing.assert_allclose(np.asarray(got_k), ref[:3], atol=1e-6)
  # Differentiable and finite everywhere, including y outside the kept set.
  grad = jax.grad(
    lambda x: models.log_kept_mass(
      jax.nn.log_softmax(x), jax.nn.log_softmax(x)[jnp.arange(5), ys], jnp.asarray(kept)
    ).sum()
  )(jnp.asarray(z, jnp.float32))
  assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("decode_block", [0, 3])
def test_bf16_sampler_is_an_engine_mismatch_that_bf16_scoring_removes(tiny, prompts, decode_block):
  """A bf16 sampler against the fp32 learner at the same parameters: ratios are not 1.

  A learner scoring in the sampler's dtype reproduces mu when it scores as the
  run's train step does, with the prompt shared by its group
  (`train.shared_prefix`, the default): its attention reads the prompt's keys
  and values the way the sampler's shared-prompt decode does. The plain
  forward over repeated prompts rounds differently in bf16. Also when decoding reads the
  filled part of the cache in spans (`decode_block` 3 of N = 8).
  """
  graphdef, params = tiny
  bf16 = dataclasses.replace(models.get_config("tiny"), dtype="bfloat16")
  bf16_graphdef = nnx.split(nnx.eval_shape(lambda: models.Decoder(bf16, rngs=nnx.Rngs(0))))[0]
  sampler = sampling.make_sampler(
    bf16_graphdef,
    max_new_tokens=N,
    group_size=K,
    temperature=1.0,
    top_p=0.8,
    decode_block=decode_block,
  )
  out = sampler(params, *prompts, jax.random.key(3))
  batch = _batch(prompts, out)
  mask = np.asarray(out.mask) > 0

  def gap(g, shared):
    logp = jax.jit(lambda p, b: scorer.token_logprobs(g, p, b, 1.0, shared, truncated=True)[0])
    return np.abs(np.asarray(logp(params, batch)) - np.asarray(out.logprobs))[mask]

  fp32_gap = gap(graphdef, K)
  assert 1e-3 < fp32_gap.max() < 0.1 and 1e-4 < fp32_gap.mean() < 0.02
  assert gap(bf16_graphdef, K).max() < 1e-5  # the ratio is 1
  assert gap(bf16_graphdef, 0).max() > 1e-3  # the plain forward is not the sampler's numerics
