"""Tests for offpolicy_jax.sampling: exact behaviour log-probs, greedy, padding, EOS, compiles."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.sampling import continuous
from offpolicy_jax.sampling import sampler as sampling

N = 8  # max_new_tokens
K = 3  # group_size


@pytest.fixture(scope="module")
def tiny(numpy_init):
  """(graphdef, params) of the tiny preset with peaked logits."""
  return numpy_init(models.get_config("tiny"))


@pytest.fixture(scope="module")
def prompts():
  """Left-padded prompts [2, 6] with lengths (3, 6)."""
  tokens = np.array([[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16]], np.int32)
  return tokens, np.array([3, 6], np.int32)


@pytest.fixture(scope="module")
def teacher(tiny):
  """Jitted teacher-forced sequence_logprobs and full-forward logits."""
  graphdef, _ = tiny

  @jax.jit
  def fn(params, prompt_tokens, prompt_mask, tokens, mask, temperature):
    model = nnx.merge(graphdef, params)
    logp, _ = models.sequence_logprobs(
      model, prompt_tokens, prompt_mask, tokens, mask, temperature=temperature
    )
    full = jnp.concatenate([prompt_tokens, tokens], axis=1)
    full_mask = jnp.concatenate([prompt_mask, jnp.ones_like(mask)], axis=1)
    return logp, model(full, attention_mask=full_mask)

  return fn


@pytest.fixture(scope="module")
def group_sampler(tiny):
  return sampling.make_sampler(
    tiny[0], max_new_tokens=N, group_size=K, temperature=0.7, top_p=1.0, top_k=0, eos_id=None
  )


@pytest.fixture(scope="module")
def greedy_sampler(tiny):
  return sampling.make_sampler(
    tiny[0], max_new_tokens=N, group_size=K, temperature=0.0, top_p=1.0, top_k=0, eos_id=None
  )


def _traces_during(call):
  """The programs JAX traced while `call()` ran, counted by JAX's own trace events (a
  jitted function's private cache size depends on what earlier tests in the process did:
  a config a test changed can leave it at 0)."""
  traces: list[str] = []

  def listen(event, seconds, **kw):
    if event == "/jax/core/compile/jaxpr_trace_duration":
      traces.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    call()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return traces


def _prompt_mask(prompt_tokens, lengths):
  p = prompt_tokens.shape[1]
  return (np.arange(p)[None] >= p - lengths[:, None]).astype(np.float32)


def test_behaviour_logprobs_equal_teacher_forced(tiny, prompts, teacher, group_sampler):
  params = tiny[1]
  tokens, lengths = prompts
  out = group_sampler(params, tokens, lengths, jax.random.key(0))
  assert out.tokens.shape == out.logprobs.shape == out.mask.shape == (2 * K, N)
  rep_tokens, rep_lengths = np.repeat(tokens, K, 0), np.repeat(lengths, K, 0)  # Group-major.
  logp, _ = teacher(
    params, rep_tokens, _prompt_mask(rep_tokens, rep_lengths), out.tokens, out.mask, 0.7
  )
  np.testing.assert_allclose(out.logprobs, logp, atol=1e-5, rtol=0)
  assert np.all(np.asarray(out.logprobs) < 0)
  # The K samples of a prompt differ (not one sample repeated).
  assert len({tuple(r) for r in np.asarray(out.tokens[:K])}) > 1


def test_group_sampler_compiles_once(tiny, prompts, group_sampler):
  params = tiny[1]
  tokens, lengths = prompts
  group_sampler(params, tokens, lengths, jax.random.key(1))
  other = jax.tree.map(lambda x: 1.01 * x, params)
  # Other parameters and prompts of the same shapes trace (and so compile) nothing new.
  again = lambda: group_sampler(other, tokens[::-1], lengths[::-1], jax.random.key(2))  # noqa: E731
  assert not _traces_during(again)


def test_left_padding_does_not_change_samples(tiny, prompts, group_sampler):
  params = tiny[1]
  tokens, lengths = prompts
  wider = np.concatenate([np.full((2, 3), 9, np.int32), tokens], axis=1)  # Pad id irrelevant.
  a = group_sampler(params, tokens, lengths, jax.random.key(5))
  b = group_sampler(params, wider, lengths, jax.random.key(5))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_greedy_equals_stepwise_argmax(tiny, prompts, teacher, greedy_sampler):
  params = tiny[1]
  tokens, lengths = prompts
  out = greedy_sampler(params, tokens, lengths, jax.random.key(0))
  rep_tokens, rep_lengths = np.repeat(tokens, K, 0), np.repeat(lengths, K, 0)
  logp, logits = teacher(
    params, rep_tokens, _prompt_mask(rep_tokens, rep_lengths), out.tokens, out.mask, 1.0
  )
  p = tokens.shape[1]
  # Logits at position p-1+t predict response token t from the prompt and tokens < t.
  np.testing.assert_array_equal(np.argmax(logits[:, p - 1 : -1], -1), out.tokens)
  # Greedy records the untempered model log-probs.
  np.testing.assert_allclose(out.logprobs, logp, atol=1e-5, rtol=0)


def _expected_end(free, eos, stop):
  """Index of the token that ends a greedy response (EOS or the end of `stop`)."""
  for i, tok in enumerate(free):
    if tok == eos:
      return i, "eos"
    if i >= len(stop) - 1 and list(free[i - len(stop) + 1 : i + 1]) == stop:
      return i, "stop"
  return len(free) - 1, "length"


def test_eos_and_stop_sequences_end_and_mask(tiny, prompts, greedy_sampler):
  graphdef, params = tiny
  tokens, lengths = prompts
  free = np.asarray(greedy_sampler(params, tokens, lengths, jax.random.key(0)).tokens)[::K]
  eos, stop = int(free[0, 2]), [int(t) for t in free[1, 3:5]]
  model = nnx.merge(graphdef, params)
  gen = functools.partial(
    sampling.generate,
    model,
    tokens,
    lengths,
    max_new_tokens=N,
    temperature=0.0,
    eos_id=[eos],
    stop_sequences=[stop],
  )
  outs = [gen(key=jax.random.key(0))]
  # generate() traces (and compiles) its sampler once: the second call traces nothing.
  assert not _traces_during(lambda: outs.append(gen(key=jax.random.key(1))))
  reasons = set()
  for out in outs:
    for row in range(2):
      end, reason = _expected_end(list(free[row]), eos, stop)
      reasons.add(reason)
      valid = np.arange(N) <= end
      np.testing.assert_array_equal(out.tokens[row], np.where(valid, free[row], 0))
      np.testing.assert_array_equal(out.mask[row], valid)
      np.testing.assert_array_equal(out.logprobs[row] != 0, valid)
      assert int(out.lengths[row]) == end + 1
  assert reasons == {"eos", "stop"}


def _truncated_logp_ref(logits, temperature, top_k, top_p):
  """Numpy reference of log mu: temperature, top-k, top-p, renormalise."""
  z = np.asarray(logits, np.float64) / temperature
  keep = z >= np.sort(z)[-top_k]
  z = np.where(keep, z, -np.inf)
  order = np.argsort(-z)
  probs = np.exp(z[order] - z[order][0])
  probs /= probs.sum()
  kept = np.zeros_like(keep)
  kept[order[(np.cumsum(probs) - probs) < top_p]] = True
  z = np.where(kept, z, -np.inf)
  return z - np.log(np.sum(np.exp(z[kept] - z[kept].max()))) - z[kept].max()


def test_top_k_top_p_logprobs_are_renormalised(tiny, prompts, teacher):
  graphdef, params = tiny
  tokens, lengths = prompts
  fn = sampling.make_sampler(
    graphdef, max_new_tokens=N, group_size=K, temperature=1.3, top_p=0.8, top_k=10, eos_id=None
  )
  out = fn(params, tokens, lengths, jax.random.key(7))
  rep_tokens, rep_lengths = np.repeat(tokens, K, 0), np.repeat(lengths, K, 0)
  _, logits = teacher(
    params, rep_tokens, _prompt_mask(rep_tokens, rep_lengths), out.tokens, out.mask, 1.0
  )
  p = tokens.shape[1]
  for b in range(2 * K):
    for t in range(N):
      ref = _truncated_logp_ref(logits[b, p - 1 + t], 1.3, 10, 0.8)
      tok = int(out.tokens[b, t])
      assert np.isfinite(ref[tok]), "sampled a truncated token"
      np.testing.assert_allclose(out.logprobs[b, t], ref[tok], atol=1e-5)


def test_inverse_cdf_draws_follow_the_distribution_and_skip_cut_tokens():
  probs = np.array(
    [[0.5, 0.3, 0.2, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [0.01, 0.0, 0.0, 0.0, 0.99]], np.float32
  )
  with np.errstate(divide="ignore"):
    logp = jnp.asarray(np.log(probs))  # -inf where top-k / top-p cut the token
  n = 20000
  keys = jax.random.split(jax.random.key(0), n)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sampling._inverse_cdf(k, logp)))(keys))
  for row in range(3):
    freq = np.bincount(draws[:, row], minlength=5) / n
    assert np.all(freq[probs[row] == 0] == 0), (row, freq)
    sigma = np.sqrt(probs[row] * (1 - probs[row]) / n)
    np.testing.assert_array_less(np.abs(freq - probs[row]), 5 * sigma + 1e-9)


@pytest.fixture(scope="module")
def fused_graphdef(numpy_init):
  """The tiny preset's graph with `jax.nn.dot_product_attention` (same parameter layout)."""
  return numpy_init(dataclasses.replace(models.get_config("tiny"), attention="dot_product"))[0]


def test_dot_product_attention_equals_ours(tiny, fused_graphdef, prompts):
  graphdef, params = tiny
  tokens, lengths = prompts
  mask = _prompt_mask(tokens, lengths)
  rows = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], np.int32)

  @jax.jit
  def forward(params):
    out = []
    for gd in (graphdef, fused_graphdef):
      model = nnx.merge(gd, params)
      out.append(
        (
          model(tokens, attention_mask=mask),
          model.shared_prefix_hidden_states(tokens, mask, rows, 2),
        )
      )
    return out

  (logits, (hp, hs)), (logits_f, (hp_f, hs_f)) = forward(params)
  real = mask[:, :, None] > 0  # Outputs at left-padding positions are unused.
  np.testing.assert_allclose(np.where(real, logits_f, 0), np.where(real, logits, 0), atol=1e-5)
  np.testing.assert_allclose(hs_f, hs, atol=1e-5)
  np.testing.assert_allclose(np.where(real, hp_f, 0), np.where(real, hp, 0), atol=1e-5)


@pytest.mark.parametrize("attention", ["xla", "dot_product"])
def test_filled_cache_attention_equals_whole_cache(
  tiny, fused_graphdef, prompts, group_sampler, attention
):
  """Spans of 3 slots (3, 6, 8 of N = 8) give the whole cache's numbers, in both implementations."""
  params = tiny[1]
  tokens, lengths = prompts
  graphdef = tiny[0] if attention == "xla" else fused_graphdef
  fn = sampling.make_sampler(
    graphdef, max_new_tokens=N, group_size=K, temperature=0.7, decode_block=3
  )
  ref = group_sampler(params, tokens, lengths, jax.random.key(3))
  out = fn(params, tokens, lengths, jax.random.key(3))
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["xla", "dot_product"])
def test_filled_cache_attention_in_bfloat16(tiny, prompts, attention):
  """bfloat16 compute over the float32 parameters, spans of 3 own slots: the spans' softmax is
  the whole cache's, so the draws are the same (a blockwise softmax merged by log-sum-exps
  drew other tokens at 40% of these positions)."""
  config = models.get_config("tiny", dtype="bfloat16", attention=attention)
  graphdef = nnx.split(nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0))))[0]
  tokens, lengths = prompts
  outs = [
    sampling.make_sampler(
      graphdef, max_new_tokens=N, group_size=K, temperature=0.7, decode_block=block
    )(tiny[1], tokens, lengths, jax.random.key(3))
    for block in (0, 3)
  ]
  np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
  np.testing.assert_allclose(outs[1].logprobs, outs[0].logprobs, atol=1e-5, rtol=0)


EOS = tuple(range(0, 64, 5))  # About a fifth of the vocabulary ends a response: lengths vary.
PROMPTS_4 = np.array(
  [[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16], [0, 0, 21, 22, 23, 24], [0, 31, 32, 33, 34, 35]],
  np.int32,
)
LENGTHS_4 = np.array([3, 6, 4, 5], np.int32)


@pytest.fixture(scope="module")
def continuous_fn(tiny):
  """(slots, **kw) -> continuous sampler of K per prompt with EOS, temperature 0.7, top-k 20."""
  return lambda slots, **kw: continuous.make_continuous_sampler(
    tiny[0],
    max_new_tokens=N,
    slots=slots,
    group_size=K,
    temperature=0.7,
    top_k=20,
    eos_id=EOS,
    **kw,
  )


@pytest.mark.parametrize(
  "kw",
  [dict(slots=2), dict(slots=1, prefill_batch=1, prompt_slots=2)],
  ids=["2slots", "1slot_scarce_prompts"],
)
def test_continuous_batching_equals_each_prompt_alone(tiny, continuous_fn, kw):
  """Rows released one by one (groups straddling slots, prompts waiting for a prompt slot)."""
  params = tiny[1]
  key = jax.random.key(11)
  out = continuous_fn(**kw)(params, PROMPTS_4, LENGTHS_4, key)  # 4 groups through 2 or 1 slots
  alone_fn = continuous_fn(1)
  lengths = np.asarray(out.lengths)
  assert 1 <= lengths.min() < N and len(set(lengths.tolist())) > 2, lengths
  for g in range(4):
    alone = alone_fn(params, PROMPTS_4[g : g + 1], LENGTHS_4[g : g + 1], key, prompt_ids=[g])
    rows = slice(g * K, (g + 1) * K)
    np.testing.assert_array_equal(out.tokens[rows], alone.tokens)
    np.testing.assert_array_equal(out.mask[rows], alone.mask)
    np.testing.assert_array_equal(out.kept[rows], alone.kept)
    np.testing.assert_allclose(out.logprobs[rows], alone.logprobs, atol=1e-5, rtol=0)


def _first_stop_end(row, stops):
  """Length of `row` cut after the first complete stop sequence (len(row) if none)."""
  for t in range(len(row)):
    if any(t + 1 >= len(s) and tuple(row[t + 1 - len(s) : t + 1]) == s for s in stops):
      return t + 1
  return len(row)


def test_continuous_batching_stop_sequences_cut_the_same_draws(tiny, continuous_fn):
  """A stop sequence ends a row at its first occurrence; tokens before it are the draws without.

  The keys depend on (prompt, sample, position) only, so the run with stop
  sequences must give each row's no-stop tokens up to and including the first
  complete stop sequence (and nothing after), also with rows released early.
  """
  params, key = tiny[1], jax.random.key(5)
  free = continuous_fn(2)(params, PROMPTS_4, LENGTHS_4, key)
  tokens, lengths = np.asarray(free.tokens), np.asarray(free.lengths)
  # Stops that occur: the bigram at positions 1-2 of the longest row, the first token of the
  # next longest (each cuts its row short).
  b, other = (int(i) for i in np.argsort(-lengths, stable=True)[:2])
  assert lengths[b] >= 3 and lengths[other] >= 2, lengths
  stops = (tuple(int(t) for t in tokens[b, 1:3]), (int(tokens[other, 0]),))
  fn = continuous_fn(2, stop_sequences=stops)
  out = fn(params, PROMPTS_4, LENGTHS_4, key)
  cut = [_first_stop_end(tokens[i, : lengths[i]].tolist(), stops) for i in range(4 * K)]
  assert cut[b] <= 3 and sum(c < n for c, n in zip(cut, lengths, strict=True)) >= 2, cut
  np.testing.assert_array_equal(out.lengths, cut)
  for i, c in enumerate(cut):
    np.testing.assert_array_equal(out.tokens[i, :c], tokens[i, :c])
    assert not np.any(np.asarray(out.tokens[i, c:])) and not np.any(np.asarray(out.mask[i, c:]))
    np.testing.assert_allclose(out.logprobs[i, :c], free.logprobs[i, :c], atol=1e-5, rtol=0)
  # One slot, prompts released and admitted in another order: the same rows.
  one = continuous_fn(1, stop_sequences=stops)(params, PROMPTS_4, LENGTHS_4, key)
  np.testing.assert_array_equal(one.tokens, out.tokens)
  np.testing.assert_array_equal(one.lengths, out.lengths)


def test_continuous_batching_under_a_mesh_equals_unsharded(tiny, continuous_fn):
  """8 fake devices (data 2 x fsdp 2 x tensor 2), 8 groups through 4 slots: the same tokens."""
  from offpolicy_jax.scale import sharding

  params = tiny[1]
  prompts, lengths = (
    np.concatenate([PROMPTS_4, PROMPTS_4[::-1]]),
    np.concatenate([LENGTHS_4, LENGTHS_4[::-1]]),
  )
  key = jax.random.key(2)
  fn = continuous_fn(4)
  ref = fn(params, prompts, lengths, key)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  placed = sharding.shard_params(params, mesh)
  assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(placed))
  with jax.set_mesh(mesh):
    out = fn(placed, prompts, lengths, key)
  assert len(out.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.mask, ref.mask)
  np.testing.assert_array_equal(out.kept, ref.kept)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_continuous_batching_logprobs_are_exact(tiny, teacher, continuous_fn):
  """Log mu of every token equals the teacher-forced truncated log-prob; rows end at EOS."""
  params = tiny[1]
  out = continuous_fn(2)(params, PROMPTS_4, LENGTHS_4, jax.random.key(11))
  rep_tokens, rep_lengths = np.repeat(PROMPTS_4, K, 0), np.repeat(LENGTHS_4, K, 0)
  _, logits = teacher(
    params, rep_tokens, _prompt_mask(rep_tokens, rep_lengths), out.tokens, out.mask, 1.0
  )
  p = PROMPTS_4.shape[1]
  for b in range(4 * K):
    n_b = int(out.lengths[b])
    np.testing.assert_array_equal(out.mask[b], np.arange(N) < n_b)
    assert n_b == N or int(out.tokens[b, n_b - 1]) in EOS
    assert not any(int(t) in EOS for t in out.tokens[b, : n_b - 1])
    for t in range(n_b):
      ref = _truncated_logp_ref(logits[b, p - 1 + t], 0.7, 20, 1.0)
      np.testing.assert_allclose(out.logprobs[b, t], ref[int(out.tokens[b, t])], atol=1e-5)
