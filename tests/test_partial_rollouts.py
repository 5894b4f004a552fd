"""Tests for offpolicy_jax.partial_rollouts: per-token versions and log-probs, used by the loss."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from offpolicy_jax import losses, models
from offpolicy_jax.learn import replay, scorer, step_options, train_state, train_step
from offpolicy_jax.rollout import protocol
from offpolicy_jax.run import components, loop
from offpolicy_jax.sampling import partial as partial_rollouts
from offpolicy_jax.sampling import sampler as sampling
from offpolicy_jax.step import packing, run_state
from offpolicy_jax.store import metrics_files

G, K, N, B_TOK = 2, 3, 8, 3  # prompts, group size, max_new_tokens, budget (L = 3 steps)
TEMP = 0.7


@pytest.fixture(scope="module")
def tiny(numpy_init):
  """graphdef and three parameter versions (0, 1, 2) with peaked logits."""
  config = models.get_config("tiny")
  graphdef, p0 = numpy_init(config, seed=0)
  versions = [p0] + [numpy_init(config, seed=s)[1] for s in (1, 2)]
  return graphdef, versions


def _prompts(offset=0):
  tokens = np.array([[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16]], np.int32) + offset
  tokens[0, :3] = 0
  return {
    "prompt_tokens": jnp.asarray(tokens),
    "prompt_lengths": jnp.array([3, 6], jnp.int32),
    "answer_tokens": jnp.zeros((G, 2), jnp.int32),
  }


def _advance(graphdef, budget, eos_id=None):
  return jax.jit(
    partial_rollouts.make_advance(
      graphdef, max_new_tokens=N, budget=budget, group_size=K, temperature=TEMP, eos_id=eos_id
    )
  )


@pytest.fixture(scope="module")
def teacher(tiny):
  graphdef = tiny[0]

  @jax.jit
  def fn(params, prompt_tokens, prompt_mask, tokens, mask):
    model = nnx.merge(graphdef, params)
    return models.sequence_logprobs(model, prompt_tokens, prompt_mask, tokens, mask, TEMP)[0]

  return fn


def _rows(prompts):
  t = np.repeat(np.asarray(prompts["prompt_tokens"]), K, 0)
  lengths = np.repeat(np.asarray(prompts["prompt_lengths"]), K, 0)
  mask = (np.arange(t.shape[1])[None] >= t.shape[1] - lengths[:, None]).astype(np.float32)
  return t, mask


@pytest.mark.parametrize("eos,budget", [(False, N), (True, N + 5)])
def test_budget_of_n_reproduces_the_ordinary_sampler(tiny, eos, budget):
  graphdef, (params, *_) = tiny
  key = jax.random.key(3)
  prompts = _prompts()
  args = (params, prompts["prompt_tokens"], prompts["prompt_lengths"], key)
  ref = sampling.make_sampler(graphdef, max_new_tokens=N, group_size=K, temperature=TEMP)(*args)
  eos_id = None
  if eos:  # a token the first row samples third: some rows end early
    eos_id = int(np.asarray(ref.tokens)[0, 2])
    ref = sampling.make_sampler(
      graphdef, max_new_tokens=N, group_size=K, temperature=TEMP, eos_id=eos_id
    )(*args)
    assert int(ref.mask.sum()) < G * K * N
  pool = partial_rollouts.init(prompts, slots=G, group_size=K, max_new_tokens=N)
  pool, dropped = partial_rollouts.admit(pool, prompts, 1)
  pool = _advance(graphdef, budget, eos_id)(params, pool, 0, key)
  out = partial_rollouts.as_output(pool)
  assert int(dropped) == 0
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.mask, ref.mask)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
  assert bool(partial_rollouts.finished(pool).all())


@pytest.fixture(scope="module")
def three_steps(tiny):
  """A pool after three steps of budget 3 with versions 0, 1, 2 (one new cohort each step)."""
  graphdef, params = tiny
  advance = _advance(graphdef, B_TOK)
  slots = partial_rollouts.steps_to_finish(N, B_TOK) * G
  pool = partial_rollouts.init(_prompts(), slots=slots, group_size=K, max_new_tokens=N)
  finished = []
  for t, v in zip((1, 2, 3), (0, 1, 2), strict=True):
    pool, dropped = partial_rollouts.admit(pool, _prompts(offset=t), t)
    assert int(dropped) == 0
    pool = advance(params[v], pool, v, jax.random.key(10 + t))
    finished.append(np.asarray(partial_rollouts.finished(pool)))
  return pool, finished


def test_a_generation_spans_steps_with_per_token_versions(three_steps):
  pool, finished = three_steps
  versions, mask = np.asarray(pool.versions), np.asarray(pool.mask)
  cohort = lambda c: slice(
    c * G * K, (c + 1) * G * K
  )  # slots fill in order: cohort c at rows c*G*K
  # Cohort 1 (admitted at step 1): tokens 0..2 at version 0, 3..5 at 1, 6..7 at 2; finished.
  np.testing.assert_array_equal(versions[cohort(0)], np.tile([0, 0, 0, 1, 1, 1, 2, 2], (G * K, 1)))
  assert mask[cohort(0)].all()
  # Cohort 2: six tokens (versions 1, 2), not finished; cohort 3: three tokens at version 2.
  np.testing.assert_array_equal(mask[cohort(1)].sum(1), 6)
  np.testing.assert_array_equal(versions[cohort(1)][:, :6], np.tile([1, 1, 1, 2, 2, 2], (G * K, 1)))
  np.testing.assert_array_equal(mask[cohort(2)].sum(1), 3)
  np.testing.assert_array_equal(versions[cohort(2)][:, :3], 2)
  # Only cohort 1's groups have finished, and only after the third step.
  assert not finished[0].any() and not finished[1].any()
  np.testing.assert_array_equal(finished[2], [True] * G + [False] * 2 * G)


def test_each_token_logprob_is_its_versions_teacher_forced_logprob(tiny, three_steps, teacher):
  _, params = tiny
  pool, _ = three_steps
  prompt, prompt_mask = _rows({k: v for k, v in pool.prompts.items()})
  tokens, mask = np.asarray(pool.tokens), np.asarray(pool.mask).astype(np.float32)
  versions, logps = np.asarray(pool.versions), np.asarray(pool.logprobs)
  checked = 0
  for v in range(3):
    ref = np.asarray(teacher(params[v], prompt, prompt_mask, tokens, mask))
    at = (versions == v) & (mask > 0)
    np.testing.assert_allclose(logps[at], ref[at], atol=2e-5, rtol=0)
    # Under another version's parameters the log-probs differ: the versions are distinguishable.
    other = np.asarray(teacher(params[(v + 1) % 3], prompt, prompt_mask, tokens, mask))
    assert np.abs(other[at] - logps[at]).max() > 1e-2
    checked += at.sum()
  assert checked == mask.sum()


def test_record_old_keeps_each_tokens_own_versions_learner_logprob(tiny):
  """pi_old per token (`protocol.pi_old` after each advance) is the sampling version's score."""
  graphdef, params = tiny
  advance = _advance(graphdef, B_TOK)
  options = step_options.StepOptions(losses.get_spec("grpo"), temperature=TEMP, group_size=K)
  score = scorer.make_scorer(graphdef, options)
  slots = partial_rollouts.steps_to_finish(N, B_TOK) * G
  pool = partial_rollouts.init(_prompts(), slots=slots, group_size=K, max_new_tokens=N)
  for t, v in zip((1, 2, 3), (0, 1, 2), strict=True):
    pool, _ = partial_rollouts.admit(pool, _prompts(offset=t), t)
    pool = advance(params[v], pool, v, jax.random.key(10 + t))
    prompts, out = pool.prompts, partial_rollouts.as_output(pool)
    old = protocol.pi_old(score, [(params[v], v)], prompts, out, pool.versions, pool.old_logprobs)
    pool = pool._replace(old_logprobs=old)
  mask = np.asarray(pool.mask)
  # fp32 sampler and learner: each token's pi_old is its mu; a mix-up of versions would differ.
  np.testing.assert_allclose(
    np.asarray(pool.old_logprobs)[mask], np.asarray(pool.logprobs)[mask], atol=2e-5, rtol=0
  )
  assert len(np.unique(np.asarray(pool.versions)[mask])) == 3


def _emit(pool, rewards):
  """The finished groups packed as a step packs them (`sampling.partial.emit`, `packing.pack`).

  Returns `(batch, keep, pool with the finished slots freed, finished)`.
  """
  out, keep, order, freed = partial_rollouts.emit(pool)
  fin = protocol.Finished(pool.prompts, out, pool.versions, valid=keep, order=order)
  spec = run_state.Packing(group_size=K, advantage="group_mean")
  args = (fin.out, rewards, fin.versions, jax.random.key(0), fin.valid, fin.order)
  batch = packing.pack(spec, fin.prompts, *args)
  return batch, fin.valid[fin.order], freed, fin


def test_emit_packs_finished_groups_and_frees_their_slots(three_steps):
  pool, _ = three_steps
  rewards = jnp.arange(pool.tokens.shape[0], dtype=jnp.float32) % 2
  batch, keep, pool2, fin = _emit(pool, rewards)
  np.testing.assert_array_equal(keep, [True] * G + [False] * 2 * G)
  np.testing.assert_array_equal(
    np.asarray(batch.versions)[: G * K], np.asarray(pool.versions)[: G * K]
  )
  np.testing.assert_array_equal(
    np.asarray(batch.advantages)[G * K :], 0.0
  )  # unfinished: no advantage
  np.testing.assert_array_equal(pool2.active, [False] * G + [True] * 2 * G)
  # The next cohort takes the freed slots; nothing is turned away.
  pool3, dropped = partial_rollouts.admit(pool2, _prompts(offset=4), 4)
  assert int(dropped) == 0 and bool(pool3.active.all())
  np.testing.assert_array_equal(pool3.lengths[: G * K], 0)
  stats = partial_rollouts.emit_stats(pool, fin.valid, dropped)
  assert int(stats["partial_emitted_groups"]) == G and float(stats["partial_mixed_rows"]) == 1.0
  # The buffer takes exactly the kept groups, in order, with their oldest version.
  example = jax.tree.map(lambda x: x[: G * K], batch)
  buf = replay.add(replay.init(4 * G, example, K), batch, keep)
  assert int(buf.num_added) == G and int(buf.ptr) == G
  np.testing.assert_array_equal(buf.valid, [True] * G + [False] * 3 * G)
  np.testing.assert_array_equal(buf.version[:G], 0)
  np.testing.assert_array_equal(buf.data.versions[:G].reshape(G * K, N), batch.versions[: G * K])


def test_the_loss_and_train_step_use_per_token_versions(tiny, three_steps, teacher):
  graphdef, params = tiny
  pool, _ = three_steps
  rewards = jnp.arange(pool.tokens.shape[0], dtype=jnp.float32) % 2
  full, keep, _, _ = _emit(pool, rewards)
  batch = jax.tree.map(lambda x: x[: G * K], full)  # the finished groups
  assert bool(keep[:G].all())
  # The trainer is at version 3, holding parameters theta_3 (version 2's, say).
  theta = params[2]
  logp = np.asarray(
    teacher(theta, batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask)
  )
  mu, mask, versions = (np.asarray(x) for x in (batch.behavior_logp, batch.mask, batch.versions))
  rho = np.exp(logp - mu)[mask > 0]
  # Tokens of version 2 are on-policy (rho = 1); the older ones are not.
  np.testing.assert_allclose(np.exp(logp - mu)[(versions == 2) & (mask > 0)], 1.0, atol=1e-4)
  assert np.abs(rho - 1).max() > 1e-2
  out = losses.policy_loss(
    "ppo",
    logp=jnp.asarray(logp),
    behavior_logp=batch.behavior_logp,
    advantages=batch.advantages,
    mask=batch.mask,
  )
  np.testing.assert_allclose(out.metrics["ratio_mean"], rho.mean(), rtol=1e-5)
  np.testing.assert_allclose(out.metrics["ratio_max"], rho.max(), rtol=1e-5)
  step = train_step.make_train_step(graphdef, optax.sgd(0.0), "ppo", temperature=TEMP, donate=False)
  state = train_state.init_train_state(theta, optax.sgd(0.0))._replace(version=jnp.int32(3))
  _, metrics = step(state, batch, jax.random.key(1))
  stale = (3 - versions)[mask > 0]
  np.testing.assert_allclose(metrics["staleness_mean"], stale.mean(), rtol=1e-6)
  assert int(metrics["staleness_max"]) == 3
  np.testing.assert_allclose(metrics["ratio_mean"], rho.mean(), rtol=1e-4)
  np.testing.assert_allclose(metrics["ratio_max"], rho.max(), rtol=1e-4)


def _run_config(**overrides):
  """The default job made tiny: 2 prompts x 4 responses of 6 tokens, budget 2 (3 steps each).

  No warm start: partial-credit rewards give a learning signal from the start.
  """
  c = default.base_config()
  fields = {
    "total_steps": 6,
    "prompts_per_step": 2,
    "group_size": 4,
    "max_new_tokens": 6,
    "max_prompt_len": 12,
    "rollout.partial_budget": 2,
    "lag.sync_interval": 1,
    "sft.enabled": False,
    "eval_every": 0,
    "eval_prompts": 0,
    "checkpoint_every": 3,
    "log_every": 3,
    "async_checkpoint": False,
    "progress": False,
    "tensorboard": False,
    **overrides,
  }
  if "task" not in overrides:
    fields["task_kwargs.partial_credit"] = True
  for key, value in fields.items():
    node = c
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    node[leaf] = value
  c.lock()
  return c


def _strip(rows):
  timing = ("tokens_per_s", "step_time_s", "compiles")
  return [{k: v for k, v in r.items() if k not in timing and "time/" not in k} for r in rows]


def test_partial_run_on_eight_devices_mixes_versions_and_resumes_exactly(tmp_path):
  assert jax.device_count() == 8
  mesh = {"mesh.data": 8}
  full = loop.train_and_evaluate(_run_config(**mesh), str(tmp_path / "full"))
  part = str(tmp_path / "part")
  loop.train_and_evaluate(_run_config(total_steps=3, **mesh), part)
  loop.train_and_evaluate(_run_config(**mesh), part)  # resumes from step 3, pool included
  got, _ = metrics_files.split_rows(metrics_files.read_metrics(part))
  want, _ = metrics_files.split_rows(full)
  assert len(want) == 6 and _strip(got) == _strip(want)
  assert all(r["partial_dropped_prompts"] == 0 for r in want)
  # On-policy sync, yet responses span versions, and the trainer sees their older tokens.
  assert max(r["partial_mixed_rows"] for r in want) > 0
  assert max(r["staleness_max"] for r in want) >= 1
  assert sum(r["partial_emitted_groups"] for r in want) >= 2 * (6 - 2)
  assert any(r["grad_norm"] > 0 for r in want)


def test_partial_run_under_async_carries_the_pool_into_its_checkpoint(tmp_path):
  """The sampler thread advances the pool; each batch brings the pool it left, which the
  trainer checkpoints: a resumed run's first batch finishes groups admitted before it."""
  cfg = lambda steps: _run_config(total_steps=steps, **{"lag.mode": "async"})
  run = str(tmp_path / "run")
  loop.train_and_evaluate(cfg(3), run)
  loop.train_and_evaluate(cfg(5), run)  # resumes from step 3
  train, _ = metrics_files.split_rows(metrics_files.read_metrics(run))
  assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
  assert sum(r["partial_emitted_groups"] for r in train) >= 2
  assert all(r["partial_dropped_prompts"] == 0 and r["async_dropped_batches"] == 0 for r in train)
  # A fresh pool could only emit groups drawn after step 3 (version >= 3): the first batch
  # after the resume holds tokens of the pool the checkpoint carried.
  after = train[3]
  assert after["partial_emitted_groups"] > 0 and after["behavior_version"] < 3
  assert any(r["grad_norm"] > 0 for r in train)


def test_partial_rollouts_refuse_a_staleness_bound_they_cannot_meet_and_host_rewards():
  # Budget 2 of 6 tokens: a group is in flight up to 3 steps.
  with pytest.raises(ValueError, match=r"^config\.lag\.max_staleness: .* = 3 loop steps"):
    components.build_components(_run_config(**{"lag.mode": "async", "lag.max_staleness": 2}))
  cfg = _run_config(task="code", max_prompt_len=64)
  with pytest.raises(ValueError, match="^config.rollout.partial_budget: .*device reward"):
    components.build_components(cfg)
