"""Tests for sampling.multiturn: exact behaviour log-probs over whole trajectories, cache extension.

A scripted environment answers each row with observations of 0 to 4 tokens
that depend on the row, the turn and the row's action (so a wrong action or
a wrong row would change what follows), and ends some episodes early.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from offpolicy_jax import losses, models, types
from offpolicy_jax.models import lora
from offpolicy_jax.sampling import multiturn, turn_pieces

K = 2
N = 28
V = 64
EOS = (7, 33)
TURN_END = ((9,), (4, 4))
PROMPTS = np.array(
  [[0, 0, 0, 5, 6, 8], [11, 12, 13, 14, 15, 16], [0, 21, 22, 23, 24, 25]], np.int32
)
LENGTHS = np.array([3, 6, 5], np.int32)
OPTIONS = dict(
  max_new_tokens=N,
  turn_tokens=5,
  max_turns=4,
  observation_tokens=3,
  group_size=K,
  eos_id=EOS,
  turn_end=TURN_END,
  decode_block=8,
)
SAMPLED = dict(temperature=0.8, top_k=20)


class Script:
  """A scripted environment: row r's observation after turn t depends on (r + offset, t, action).

  Observations have 1 + (r + t) % 4 tokens (1 to 4; 4 exceeds `observation_tokens`; an
  empty one would end the episode);
  rows with r % 3 == 0 end (done) after turn 1. Every call is recorded.
  """

  def __init__(self, offset=0):
    self.offset = offset
    self.calls = []

  def __call__(self, turn, rows, actions, final):
    self.calls.append((turn, [int(r) + self.offset for r in rows], actions, final))
    out = []
    for r, action in zip(rows, actions, strict=True):
      r = int(r) + self.offset
      n = 1 + (r + turn) % 4
      base = 7 * r + 3 * turn + int(np.sum(action))
      obs = np.array([1 + (base + j) % 60 for j in range(n)], np.int32)
      out.append((obs, r % 3 == 0 and turn == 1))
    return out

  def observations(self):
    """{(row, turn): the observation tokens answered to a non-final call}."""
    return {
      (r, t): obs
      for t, rows, actions, final in self.calls
      if not final
      for r, (obs, _) in zip(rows, Script(0)(t, rows, actions, final), strict=True)
    }


@pytest.fixture(scope="module")
def tiny(numpy_init):
  return numpy_init(models.get_config("tiny"))


@pytest.fixture(scope="module")
def sampled(tiny):
  return multiturn.MultiTurnSampler(tiny[0], **OPTIONS, **SAMPLED)


@pytest.fixture(scope="module")
def sampled_run(tiny, sampled):
  script = Script()
  out, info = sampled(tiny[1], PROMPTS, LENGTHS, jax.random.key(3), script)
  return out, info, script


@pytest.fixture(scope="module")
def scorer(tiny):
  """Jitted teacher-forced log-probs of whole trajectories, as the train step scores them."""

  def fn(params, tokens, mask, kept, temperature, top_k):
    model = nnx.merge(tiny[0], params)
    prompt_mask = types.prompt_mask(LENGTHS, PROMPTS.shape[1])
    shared, _ = models.shared_prefix_logprobs(
      model, PROMPTS, prompt_mask, tokens, mask, K, temperature, kept=kept, top_k=top_k
    )
    rep = lambda x: jnp.repeat(x, K, axis=0)
    seq, _ = models.sequence_logprobs(
      model, rep(PROMPTS), rep(prompt_mask), tokens, mask, temperature, kept=kept, top_k=top_k
    )
    return shared, seq

  return jax.jit(fn, static_argnums=(4, 5))


def _check_layout(out, info):
  """Policy / observation / padding slots partition each row; turn ids follow the turns."""
  mask, obs = np.asarray(out.mask), np.asarray(info.observation_mask)
  lengths, tokens = np.asarray(out.lengths), np.asarray(out.tokens)
  assert not np.any((mask > 0) & (obs > 0))
  np.testing.assert_array_equal(mask + obs, np.arange(N)[None] < lengths[:, None])
  np.testing.assert_array_equal(np.where(mask > 0, 0, out.logprobs), 0)
  np.testing.assert_array_equal(np.where(mask > 0, 0, out.kept), 0)
  np.testing.assert_array_equal(np.where(mask + obs > 0, tokens, 0), tokens)
  ids = np.asarray(info.turn_ids)
  assert np.all(np.diff(np.where(mask + obs > 0, ids, ids.max()), axis=1) >= 0)
  np.testing.assert_array_equal(ids.max(axis=1) + 1, info.turns)
  assert np.all(np.asarray(out.logprobs)[mask > 0] < 0)


def test_behaviour_logprobs_equal_teacher_forced_whole_trajectory(tiny, sampled_run, scorer):
  out, info, _ = sampled_run
  _check_layout(out, info)
  shared, seq = scorer(tiny[1], out.tokens, out.mask, out.kept, 0.8, 20)
  np.testing.assert_allclose(out.logprobs, shared, atol=1e-5, rtol=0)
  np.testing.assert_allclose(out.logprobs, seq, atol=1e-5, rtol=0)
  # The data reaches every case: observations, several turns, every way an episode ends.
  assert np.asarray(info.observation_mask).sum() > 10
  assert set(np.asarray(info.turns).tolist()) >= {2, 4}
  assert set(np.asarray(info.end_reason).tolist()) >= {multiturn.END_ENV, multiturn.END_TURNS}


def test_greedy_reprefill_logprobs_exact_and_argmax(tiny):
  """Greedy; the history re-encoded at each observation, whole cache: argmax, exact log-probs."""
  options = {**OPTIONS, "decode_block": 0}
  fn = multiturn.MultiTurnSampler(tiny[0], **options, temperature=0.0, history="reprefill")
  out, info = fn(tiny[1], PROMPTS, LENGTHS, jax.random.key(0), Script())
  _check_layout(out, info)
  model = nnx.merge(*tiny)
  rep = np.repeat(PROMPTS, K, 0)
  prompt_mask = types.prompt_mask(np.repeat(LENGTHS, K), PROMPTS.shape[1])
  full = jnp.concatenate([rep, out.tokens], axis=1)
  logits = model(full, attention_mask=jnp.concatenate([prompt_mask, jnp.ones((K * 3, N))], 1))
  p = PROMPTS.shape[1]
  argmax = np.asarray(jnp.argmax(logits[:, p - 1 : -1], -1))
  policy = np.asarray(out.mask) > 0
  np.testing.assert_array_equal(argmax[policy], np.asarray(out.tokens)[policy])
  logp, _ = models.sequence_logprobs(model, rep, prompt_mask, out.tokens, out.mask)
  np.testing.assert_allclose(out.logprobs, logp, atol=1e-5, rtol=0)


def test_observations_are_the_environment_tokens_truncated(sampled_run):
  out, info, script = sampled_run
  tokens, policy = np.asarray(out.tokens), np.asarray(out.mask) > 0
  obs_mask, ids = np.asarray(info.observation_mask) > 0, np.asarray(info.turn_ids)
  answered = script.observations()
  for (b, t), obs in answered.items():
    got = tokens[b][obs_mask[b] & (ids[b] == t)]
    if b % 3 == 0 and t == 1:  # done: not appended
      assert got.size == 0
      continue
    after = np.flatnonzero(policy[b] & (ids[b] == t)).max() + 1
    np.testing.assert_array_equal(got, obs[: min(3, N - after - 1)])
    np.testing.assert_array_equal(
      np.flatnonzero(obs_mask[b] & (ids[b] == t)), after + np.arange(got.size)
    )
  cut = {b for (b, t), o in answered.items() if o.size > 3 and not (b % 3 == 0 and t == 1)}
  assert cut and cut <= set(np.flatnonzero(info.observation_truncated).tolist())


def test_respond_calls_actions_and_final(sampled_run):
  """Every row's actions are its policy turns; each episode ends by done or one final call."""
  out, info, script = sampled_run
  tokens, policy, ids = np.asarray(out.tokens), np.asarray(out.mask) > 0, np.asarray(info.turn_ids)
  finals = {}
  for turn, rows, actions, final in script.calls:
    for r, action in zip(rows, actions, strict=True):
      np.testing.assert_array_equal(action, tokens[r][policy[r] & (ids[r] == turn)])
      if final:
        finals[r] = finals.get(r, 0) + 1
  reason = np.asarray(info.end_reason)
  for b in range(3 * K):
    assert finals.get(b, 0) == (0 if reason[b] == multiturn.END_ENV else 1)
    if reason[b] == multiturn.END_ENV:
      assert b % 3 == 0 and int(info.turns[b]) == 2


def test_eos_and_turn_end_end_turns_and_episodes(sampled_run):
  out, info, _ = sampled_run
  tokens, policy, ids = np.asarray(out.tokens), np.asarray(out.mask) > 0, np.asarray(info.turn_ids)
  for b in range(3 * K):
    turns = [tokens[b][policy[b] & (ids[b] == t)] for t in range(int(info.turns[b]))]
    for t, action in enumerate(turns):
      assert 1 <= action.size <= 5
      eos_at = [i for i, y in enumerate(action) if int(y) in EOS]
      assert eos_at in ([], [action.size - 1])
      if eos_at:
        assert t + 1 == len(turns) and info.end_reason[b] == multiturn.END_EOS
      ends_at = [
        i
        for i in range(action.size)
        if action[i] == 9 or (i >= 1 and action[i - 1 : i + 1].tolist() == [4, 4])
      ]
      assert ends_at in ([], [action.size - 1])
      if t + 1 < len(turns):
        assert ends_at or action.size == 5


def test_rows_do_not_depend_on_the_batch(tiny, sampled, sampled_run):
  out, info, _ = sampled_run
  key = jax.random.key(3)
  for g in range(3):
    alone, alone_info = sampled(
      tiny[1], PROMPTS[g : g + 1], LENGTHS[g : g + 1], key, Script(offset=g * K), prompt_ids=[g]
    )
    rows = slice(g * K, (g + 1) * K)
    np.testing.assert_array_equal(alone.tokens, out.tokens[rows])
    np.testing.assert_array_equal(alone.mask, out.mask[rows])
    np.testing.assert_array_equal(alone_info.turn_ids, info.turn_ids[rows])
    np.testing.assert_allclose(alone.logprobs, out.logprobs[rows], atol=1e-5, rtol=0)


def test_limits_budget_and_max_turns(tiny, sampled, sampled_run):
  out, info, script = sampled_run
  turns, reason = np.asarray(info.turns), np.asarray(info.end_reason)
  assert turns.max() == 4 and np.all(turns[reason == multiturn.END_TURNS] == 4)
  last = [c for c in script.calls if c[0] == 3]
  assert [c[3] for c in last] == [True]  # every row's last turn is final
  assert not any(c[0] > 3 for c in script.calls)
  caps = np.array([3, 9, 14, 28, 20, 11], np.int32)
  script = Script()
  out, info = sampled(tiny[1], PROMPTS, LENGTHS, jax.random.key(4), script, max_lengths=caps)
  _check_layout(out, info)
  lengths = np.asarray(out.lengths)
  assert np.all(lengths <= caps) and np.asarray(info.turns).max() <= 4
  assert int(info.turns[0]) == 1 and int(info.end_reason[0]) in (
    multiturn.END_BUDGET,
    multiturn.END_EOS,
  )
  budget = np.asarray(info.end_reason) == multiturn.END_BUDGET
  assert budget.sum() >= 2
  # A row ends by its budget when fewer than two slots are left (no room for an
  # observation and another policy token).
  assert np.all(lengths[budget] >= caps[budget] - 1)
  with pytest.raises(ValueError, match="max_lengths"):
    sampled(tiny[1], PROMPTS, LENGTHS, jax.random.key(4), script, max_lengths=caps[:2])


def test_bad_options_and_answers_are_named(tiny, sampled):
  for field in ("turn_tokens", "max_turns", "observation_tokens"):
    with pytest.raises(ValueError, match=field):
      multiturn.MultiTurnSampler(tiny[0], **{**OPTIONS, field: 0})
  with pytest.raises(ValueError, match="history"):
    multiturn.MultiTurnSampler(tiny[0], **OPTIONS, history="retokenise")
  bad = lambda turn, rows, actions, final: [(np.array([V]), False)] * len(rows)
  with pytest.raises(ValueError, match=r"observation token ids must be in \[0, 64\)"):
    sampled(tiny[1], PROMPTS, LENGTHS, jax.random.key(4), bad)
  short = lambda turn, rows, actions, final: []
  with pytest.raises(ValueError, match="must answer each"):
    sampled(tiny[1], PROMPTS, LENGTHS, jax.random.key(4), short)


@pytest.mark.parametrize("attention", ["xla", "dot_product"])
def test_extend_equals_decoding_token_by_token(numpy_init, tiny, attention):
  """One extension call == feeding the observation through decode_shared token by token."""
  config = dataclasses.replace(models.get_config("tiny"), attention=attention)
  graphdef, params = numpy_init(config)[0], tiny[1]
  g, p, s, t = 3, PROMPTS.shape[1], 16, 5
  prompt_mask = types.prompt_mask(LENGTHS, p)
  rng = np.random.RandomState(0)
  history, new = rng.randint(1, V, (g * K, 6)), rng.randint(1, V, (g * K, t))
  filled = np.array([0, 2, 6, 3, 5, 11], np.int32)
  counts = np.array([5, 0, 3, 5, 1, 5], np.int32)

  @jax.jit
  def prefill(params):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(g, p)
    return model.hidden_states(PROMPTS, attention_mask=prompt_mask, cache=cache, cache_index=0)[1]

  @jax.jit
  def decode(params, tokens, prefix, cache, index, write):
    """One decode_shared step; rows where `write` is False keep their cache."""
    h, new = nnx.merge(graphdef, params).decode_shared(tokens, prefix, cache, prompt_mask, index, 4)
    return h, jax.tree.map(lambda a, b: jnp.where(write[:, None, None, None], a, b), new, cache)

  @jax.jit
  def extend(params, prefix, cache):
    model = nnx.merge(graphdef, params)
    return model.extend_shared(new, counts, prefix, cache, prompt_mask, filled, block=4)

  prefix = prefill(params)
  cache = nnx.merge(graphdef, params).init_cache(g * K, s)
  for i in range(6):  # each row's own history: slots 0..filled-1
    cache = decode(params, history[:, i], prefix, cache, np.full(g * K, i), i < filled)[1]
  h_ext, c_ext = extend(params, prefix, cache)
  hs, c_dec = [], cache
  for j in range(t):
    h, c_dec = decode(params, new[:, j], prefix, c_dec, filled + j, j < counts)
    hs.append(h)
  h_dec = jnp.stack(hs, 1)[jnp.arange(g * K), np.maximum(counts - 1, 0)]
  real = counts > 0
  np.testing.assert_allclose(np.asarray(h_ext)[real], np.asarray(h_dec)[real], atol=1e-5)
  leaves = (jax.tree.leaves(c) for c in (c_ext, c_dec, cache))
  for a, b, c in zip(*leaves, strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a)[~real], np.asarray(c)[~real])  # counts 0


def test_lora_and_dot_product_give_the_same_trajectories(numpy_init, tiny, sampled, sampled_run):
  out, _, _ = sampled_run
  fused = numpy_init(dataclasses.replace(models.get_config("tiny"), attention="dot_product"))
  fn = multiturn.MultiTurnSampler(fused[0], **{**OPTIONS, "decode_block": 0}, **SAMPLED)
  again, _ = fn(tiny[1], PROMPTS, LENGTHS, jax.random.key(3), Script())
  np.testing.assert_array_equal(again.tokens, out.tokens)
  np.testing.assert_allclose(again.logprobs, out.logprobs, atol=1e-5, rtol=0)
  # Random (non-zero) adapters: the same trajectories as the merged plain model.
  config = models.get_config("tiny", lora=models.LoraConfig(rank=4))
  graphdef, params = numpy_init(config, scale=2.0)
  adapted, _ = multiturn.MultiTurnSampler(graphdef, **{**OPTIONS, "decode_block": 0}, **SAMPLED)(
    params, PROMPTS, LENGTHS, jax.random.key(5), Script()
  )
  merged, _ = sampled(lora.merged(params, config), PROMPTS, LENGTHS, jax.random.key(5), Script())
  np.testing.assert_array_equal(adapted.tokens, merged.tokens)
  np.testing.assert_allclose(adapted.logprobs, merged.logprobs, atol=1e-5, rtol=0)
  assert np.asarray(adapted.mask).sum() > 20


def test_turn_ids_rebuilt_from_the_policy_mask(sampled_run):
  out, info, _ = sampled_run
  rebuilt = types.turn_ids(out.mask)  # what the train step gives st_ppo
  filled = np.arange(N)[None] < np.asarray(out.lengths)[:, None]
  # Equal wherever no empty observation merged two turns.
  turns_seen = np.asarray(rebuilt).max(axis=1) + 1
  for b in range(3 * K):
    if turns_seen[b] == int(info.turns[b]):
      np.testing.assert_array_equal(np.asarray(rebuilt)[b][filled[b]], info.turn_ids[b][filled[b]])
    else:
      assert turns_seen[b] < int(info.turns[b])


def test_turn_end_sequences_match_within_the_turn_only():
  tokens = jnp.array([[1, 4, 4, 0], [1, 4, 4, 0], [4, 9, 0, 0], [4, 4, 4, 4]], jnp.int32)
  steps = jnp.array([2, 2, 1, 3], jnp.int32)
  starts = jnp.array([1, 2, 1, 3], jnp.int32)
  hit = turn_pieces._ends_turn(tokens, jnp.arange(4), steps, starts, TURN_END)
  # (4, 4) inside the turn; (4, 4) across the turn's start; 9; a single 4 in the turn.
  np.testing.assert_array_equal(hit, [True, False, True, False])


def test_parameters_swapped_between_turns_give_exact_logprobs(tiny, sampled, scorer):
  """Turns 0-1 under theta, turns 2-3 under theta': each token exact under its own parameters."""
  params = tiny[1]
  newer = jax.tree.map(lambda x: 1.05 * x, params)
  out, info = sampled(
    params,
    PROMPTS,
    LENGTHS,
    jax.random.key(3),
    Script(),
    update_params=lambda turn: newer if turn == 2 else None,
  )
  _check_layout(out, info)
  late = np.asarray(info.turn_ids) >= 2
  policy = np.asarray(out.mask) > 0
  assert (late & policy).sum() > 10 and (~late & policy).sum() > 10
  for theta, part in ((params, ~late), (newer, late)):
    shared, seq = scorer(theta, out.tokens, out.mask, out.kept, 0.8, 20)
    for logp in (shared, seq):
      np.testing.assert_allclose(
        np.asarray(out.logprobs)[part], np.asarray(logp)[part], atol=1e-5, rtol=0
      )
  # The swap changed what was sampled: the late turns are not theta's.
  shared, _ = scorer(params, out.tokens, out.mask, out.kept, 0.8, 20)
  assert np.abs(np.asarray(out.logprobs - shared)[late & policy]).max() > 1e-3


def test_observation_tokens_carry_no_loss_gradient_or_weight(sampled_run):
  """st_ppo on a rollout: zero gradient at observation slots, which no metric counts."""
  out, info, _ = sampled_run
  rng = np.random.RandomState(0)
  mu = np.asarray(out.logprobs)
  logp = jnp.asarray(mu + 0.05 * rng.randn(*mu.shape), jnp.float32)
  advantages = jnp.asarray(rng.randn(3 * K), jnp.float32)
  obs = np.asarray(info.observation_mask) > 0

  def loss(logp, turn_ids):
    return losses.policy_loss(
      "st_ppo",
      logp=logp,
      behavior_logp=out.logprobs,
      advantages=advantages,
      mask=out.mask,
      turn_ids=turn_ids,
    )

  def objective(logp):
    result = loss(logp, info.turn_ids)
    return result.loss, result.metrics

  (value, metrics), grad = jax.value_and_grad(objective, has_aux=True)(logp)
  assert np.all(np.asarray(grad)[obs] == 0) and np.abs(np.asarray(grad)).max() > 0
  assert float(metrics["valid_tokens"]) == float(np.asarray(out.mask).sum())
  # Anything written at observation slots (log-probs, turn ids) changes nothing.
  noisy = jnp.where(obs, -3.0 + logp, logp)
  other_ids = jnp.where(obs, 0, info.turn_ids)
  np.testing.assert_allclose(loss(noisy, other_ids).loss, value, rtol=1e-6)


def test_budgeted_advance_pauses_mid_turn_and_continues_the_same_trajectories(
  tiny, sampled, sampled_run
):
  """Calls of at most 3 decoded tokens per row, caches re-encoded between them (as the
  partial-rollout pool does), play exactly the episodes of one unbudgeted call."""
  want, want_info, want_script = sampled_run
  params, b = tiny[1], PROMPTS.shape[0] * K
  st = sampled.start(params, PROMPTS, LENGTHS, np.full(b, N, np.int32))
  rec = multiturn.Rows.fresh(np.full(b, N, np.int32))
  ids_b = jnp.asarray(np.repeat(np.arange(PROMPTS.shape[0]), K), jnp.int32)
  samples_b = jnp.asarray(np.tile(np.arange(K), PROMPTS.shape[0]), jnp.int32)
  script, calls, paused_mid_turn = Script(), 0, 0
  while not rec.done.all():
    st = sampled.reencode(params, st)
    policy_before = np.asarray(st.policy).sum(axis=1)
    st = sampled.advance(params, st, jax.random.key(3), ids_b, samples_b, script, rec, budget=3)
    assert np.all(np.asarray(st.policy).sum(axis=1) - policy_before <= 3)
    pos, start, ended = (np.asarray(x) for x in (st.pos, st.turn_start, st.ended))
    paused_mid_turn += int(np.sum(~rec.done & ~ended & (pos > start)))
    calls += 1
  got, got_info = multiturn._outputs(st, rec.reason, rec.cut)
  assert calls >= 4 and paused_mid_turn > 0
  for name in ("tokens", "mask", "lengths", "kept"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
  for name in ("turns", "turn_ids", "observation_mask", "end_reason", "observation_truncated"):
    np.testing.assert_array_equal(getattr(got_info, name), getattr(want_info, name), err_msg=name)

  def answered(s):  # {(row, turn): (action, final)} of every respond call
    return {
      (r, t): (tuple(np.asarray(a).tolist()), final)
      for t, rows, actions, final in s.calls
      for r, a in zip(rows, actions, strict=True)
    }

  assert answered(script) == answered(want_script)
