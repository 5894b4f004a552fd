"""Tests for the sharded, micro-batched train step."""

import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import lag, models  # noqa: E402
from offpolicy_jax.learn import train_state, train_step  # noqa: E402
from offpolicy_jax.run import sft  # noqa: E402
from offpolicy_jax.scale import sharding  # noqa: E402
from offpolicy_jax.types import TrainBatch  # noqa: E402

B, P, N = 8, 4, 6
LOSS = "grpo"


@pytest.fixture(scope="module")
def setup():
  config = models.get_config("tiny", dtype=jnp.float32, param_dtype=jnp.float32)
  model = models.Decoder(config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  prompt_mask = np.ones((B, P), np.float32)
  prompt_mask[::2, :2] = 0  # left padding
  mask = np.ones((B, N), np.float32)
  mask[1, 4:] = 0
  mask[5, 2:] = 0
  tokens = rng.integers(1, config.vocab_size, (B, N)).astype(np.int32)
  prompt_tokens = (rng.integers(1, config.vocab_size, (B, P)) * prompt_mask).astype(np.int32)
  logp_fn = jax.jit(
    lambda p, b: models.sequence_logprobs(
      nnx.merge(graphdef, p), b.prompt_tokens, b.prompt_mask, b.tokens, b.mask
    )[0]
  )
  batch = TrainBatch(
    prompt_tokens=prompt_tokens,
    prompt_mask=prompt_mask,
    tokens=tokens,
    mask=mask,
    behavior_logp=np.zeros((B, N), np.float32),
    advantages=rng.normal(size=B).astype(np.float32),
    rewards=rng.uniform(size=B).astype(np.float32),
    versions=np.zeros((B, N), np.int32),
    weights=np.ones(B, np.float32),
    behavior_kept=np.full((B, N), config.vocab_size, np.int32),
    old_logp=np.zeros((B, N), np.float32),
  )
  # Behaviour log-probs a little off the current policy, so ratios (and clipping) are non-trivial.
  behavior = np.asarray(logp_fn(params, batch)) + 0.3 * rng.normal(size=(B, N)) * mask
  behavior = behavior.astype(np.float32)
  batch = batch._replace(behavior_logp=behavior, old_logp=behavior)
  sgd = optax.sgd(1.0)
  step = train_step.make_train_step(graphdef, sgd, LOSS, donate=False)
  return dict(graphdef=graphdef, params=params, batch=batch, sgd=sgd, step=step, logp_fn=logp_fn)


def _delta(new, old):
  return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new, old)


def _run(setup, step, state=None, batch=None):
  state = state or train_state.init_train_state(setup["params"], setup["sgd"])
  return step(state, setup["batch"] if batch is None else batch, jax.random.key(1))


def test_sharded_step_matches_single_device(setup):
  s1, m1 = _run(setup, setup["step"])
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  step8 = train_step.make_train_step(setup["graphdef"], setup["sgd"], LOSS, mesh=mesh)
  state8 = train_state.init_train_state(setup["params"], setup["sgd"], mesh=mesh)
  s8, m8 = step8(state8, sharding.shard_batch(setup["batch"], mesh), jax.random.key(1))
  assert float(m1["grad_norm"]) > 0
  np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m8["grad_norm"], m1["grad_norm"], rtol=1e-5, atol=1e-6)
  # With SGD(lr=1) the parameter change is the gradient.
  chex_close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  jax.tree.map(chex_close, _delta(s8.params, setup["params"]), _delta(s1.params, setup["params"]))
  specs = [x.sharding.spec for x in jax.tree.leaves(s8.params)]
  assert any("tensor" in jax.tree.leaves(tuple(s)) for s in specs)
  assert any("fsdp" in jax.tree.leaves(tuple(s)) for s in specs)
  assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(s8.params))


def test_micro_batched_equals_full_batch(setup):
  s1, m1 = _run(setup, setup["step"])
  step4 = train_step.make_train_step(
    setup["graphdef"], setup["sgd"], LOSS, micro_batch_size=2, donate=False
  )
  s4, m4 = _run(setup, step4)
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5, atol=1e-6)
  for k in ("entropy", "kl_k1", "kl_k3", "ratio_mean", "ratio_max", "ratio_min", "tokens"):
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-6)
  close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  jax.tree.map(close, _delta(s4.params, setup["params"]), _delta(s1.params, setup["params"]))


def test_metrics_against_numpy(setup):
  _, m = _run(setup, setup["step"])
  b = setup["batch"]
  logp = np.asarray(setup["logp_fn"](setup["params"], b))
  valid = b.mask > 0
  d = (logp - b.behavior_logp)[valid]
  np.testing.assert_allclose(m["kl_k1"], np.mean(-d), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(m["kl_k3"], np.mean(np.exp(d) - 1 - d), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(m["ratio_max"], np.exp(d).max(), rtol=1e-5)
  assert int(m["tokens"]) == valid.sum()
  assert 0 <= float(m["clip_frac"]) <= 1


def test_nan_skips_update_and_run_continues(setup):
  step = setup["step"]
  state = train_state.init_train_state(setup["params"], setup["sgd"])
  bad = setup["batch"]._replace(advantages=setup["batch"].advantages.copy())
  bad.advantages[3] = np.nan
  s, m = step(state, bad, jax.random.key(0))
  assert int(m["skipped"]) == 1 and int(m["nonfinite"]) == 1
  assert int(s.num_skipped) == 1 and int(s.version) == 1 and int(s.step) == 1
  jax.tree.map(np.testing.assert_array_equal, s.params, setup["params"])
  s, m = step(s, setup["batch"], jax.random.key(0))
  assert int(m["skipped"]) == 0 and int(s.num_skipped) == 1 and int(s.version) == 2
  moved = jax.tree.map(
    lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), s.params, setup["params"]
  )
  assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_nonfinite_update_skips_step(setup, jit):
  """Adam with lr=inf: loss and gradient are finite, the update is not: nothing changes."""
  opt = train_state.make_optimizer(float("inf"))
  step = train_step.make_train_step(setup["graphdef"], opt, LOSS, donate=False, jit=jit)
  state = train_state.init_train_state(setup["params"], opt)
  s, m = step(state, setup["batch"], jax.random.key(0))
  assert np.isfinite(float(m["loss"])) and 0 < float(m["grad_norm"]) < np.inf
  assert int(m["skipped"]) == 1 and int(m["nonfinite"]) == 1 and int(m["num_skipped"]) == 1
  assert int(s.num_skipped) == 1 and int(s.version) == 1 and int(s.step) == 1
  jax.tree.map(np.testing.assert_array_equal, s.params, setup["params"])
  jax.tree.map(np.testing.assert_array_equal, s.opt_state, state.opt_state)


def test_nonfinite_optimizer_state_skips_step(setup):
  """Adam's second moment overflows (g^2 = inf): the update is 0 and finite, the state is not.

  Kept, that state would freeze every later update; the guard keeps the old one.
  """
  opt = optax.chain(optax.scale(1e30), optax.adam(1e-3))
  step = train_step.make_train_step(setup["graphdef"], opt, LOSS, donate=False)
  state = train_state.init_train_state(setup["params"], opt)
  updates, new_opt_state = opt.update(
    jax.tree.map(jnp.ones_like, setup["params"]), state.opt_state, state.params
  )
  assert bool(train_state.all_finite(updates)) and not train_state.all_finite(new_opt_state)
  s, m = step(state, setup["batch"], jax.random.key(0))
  assert int(m["skipped"]) == 1 and int(m["nonfinite"]) == 1 and int(s.num_skipped) == 1
  jax.tree.map(np.testing.assert_array_equal, s.params, setup["params"])
  jax.tree.map(np.testing.assert_array_equal, s.opt_state, state.opt_state)


def test_all_finite():
  tree = {"w": jnp.ones((2, 3)), "count": jnp.asarray(3, jnp.int32), "empty": ()}
  assert bool(train_state.all_finite(tree)) and bool(train_state.all_finite(()))
  # The largest finite values are finite (their sum would overflow; x * 0 does not).
  huge = {
    "f32": jnp.full((4,), jnp.finfo(jnp.float32).max),
    "bf16": jnp.full((4,), 3e38, jnp.bfloat16),
  }
  assert bool(jax.jit(train_state.all_finite)(huge))
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    tree["w"] = jnp.ones((2, 3)).at[1, 2].set(bad)
    assert not bool(jax.jit(train_state.all_finite)(tree))
    assert not bool(train_state.all_finite({**huge, "bf16": huge["bf16"].at[0].set(bad)}))


def test_zero_weights_drop_rows(setup):
  # Rows with weight 0 contribute nothing: same update as removing them from the mask.
  b = setup["batch"]
  w = np.ones(B, np.float32)
  w[[0, 5]] = 0
  s_w, m_w = _run(setup, setup["step"], batch=b._replace(weights=w))
  s_m, m_m = _run(setup, setup["step"], batch=b._replace(mask=b.mask * w[:, None]))
  np.testing.assert_allclose(m_w["loss"], m_m["loss"], rtol=1e-6)
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-6), s_w.params, s_m.params)


@pytest.mark.parametrize("m,n", [(1, 0), (1, 3), (4, 0), (3, 2), (10**9, 0)])
def test_staleness_follows_lag_schedule(setup, m, n):
  """A sync-mode run: sample at snapshot v(t), train, record staleness = t - 1 - v(t)."""
  opt = setup["sgd"]
  step = setup["step"]
  state = train_state.init_train_state(setup["params"], opt)
  store = lag.snapshot_init(state.params, lag.snapshot_capacity(m, n))
  b = setup["batch"]
  for t in range(1, 8):
    v = lag.behavior_version(t, m, n)
    params_v, found = lag.snapshot_get(store, v)
    assert bool(found)
    batch = b._replace(
      behavior_logp=setup["logp_fn"](params_v, b), versions=np.full((B, N), v, np.int32)
    )
    state, metrics = step(state, batch, jax.random.key(t))
    assert int(metrics["staleness_max"]) == t - 1 - v == lag.staleness(t, m, n)
    assert float(metrics["staleness_mean"]) == pytest.approx(t - 1 - v)
    if t - 1 == v:  # on-policy batch: the ratio is exactly one
      assert float(metrics["kl_k3"]) == pytest.approx(0.0, abs=1e-6)
    if lag.is_snapshot_version(t, m):
      store = lag.snapshot_update(store, state.params, t)


def test_bad_config_names_field(setup):
  with pytest.raises(ValueError, match="num_micro_batches"):
    train_step.make_train_step(setup["graphdef"], setup["sgd"], LOSS, num_micro_batches=0)
  step = train_step.make_train_step(setup["graphdef"], setup["sgd"], LOSS, micro_batch_size=3)
  with pytest.raises(ValueError, match="micro_batch_size"):
    _run(setup, step)
  step = train_step.make_train_step(setup["graphdef"], setup["sgd"], LOSS, kl_coef=0.1)
  with pytest.raises(ValueError, match="ref_params"):
    _run(setup, step)
  with pytest.raises(ValueError, match="schedule"):
    train_state.make_optimizer(1e-3, schedule="linear")


def test_make_optimizer_schedule_clip_and_decay():
  opt = train_state.make_optimizer(
    0.1, warmup_steps=2, weight_decay=0.5, max_grad_norm=1.0, b1=0.0, b2=0.0, eps=0.0
  )
  params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
  state = opt.init(params)
  grads = {"w": jnp.full((2, 2), 3.0), "b": jnp.full(2, -4.0)}
  lrs = []
  for _ in range(3):
    updates, state = opt.update(grads, state, params)
    lrs.append(updates)
  # Step 0 of the warmup has learning rate 0; step 1 has 0.05; Adam with b1=b2=0 gives sign(g).
  assert float(jnp.abs(lrs[0]["w"]).max()) == 0.0
  # Decay applies to matrices only: w moves by -lr*(1 + 0.5*1), b by +lr.
  np.testing.assert_allclose(lrs[1]["w"], np.full((2, 2), -0.05 * 1.5), rtol=1e-6)
  np.testing.assert_allclose(lrs[1]["b"], np.full(2, 0.05), rtol=1e-6)
  np.testing.assert_allclose(lrs[2]["b"], np.full(2, 0.1), rtol=1e-6)


def test_bfloat16_moments_halve_the_state_and_track_float32_adam():
  """Both Adam moments stored in bfloat16 between steps; the updates follow float32 Adam."""
  rng = np.random.default_rng(0)
  target = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}

  def loss(p):
    return jnp.mean((p["w"] - target) ** 2) + jnp.mean((p["b"] - 1.0) ** 2)

  runs = {}
  for dtype in ("float32", "bfloat16"):
    opt = train_state.make_optimizer(1e-2, b2=0.99, moment_dtype=dtype)
    p, state = params, opt.init(params)
    for _ in range(200):
      updates, state = opt.update(jax.grad(loss)(p), state, p)
      p = optax.apply_updates(p, updates)
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    runs[dtype] = p, floats, float(loss(p))
  f32, bf16 = runs["float32"], runs["bfloat16"]
  assert {x.dtype for x in bf16[1]} == {jnp.dtype(jnp.bfloat16)}  # mu and nu
  assert sum(x.nbytes for x in bf16[1]) * 2 == sum(x.nbytes for x in f32[1])
  assert bf16[2] < 0.05 * float(loss(params)), bf16[2]  # it learns
  np.testing.assert_allclose(bf16[0]["w"], f32[0]["w"], rtol=0.02, atol=0.01)
  with pytest.raises(ValueError, match="moment_dtype"):
    train_state.make_optimizer(1e-3, moment_dtype="float16")


def test_proximal_params_minibatches_and_epochs(setup):
  """decoupled_ppo with prox = params and lr = 0: the trust-region ratio is exactly 1.

  Two minibatches x two epochs = four optimizer steps, so the version advances by 4.
  """
  frozen = optax.sgd(0.0)
  step = train_step.make_train_step(
    setup["graphdef"], frozen, "decoupled_ppo", num_minibatches=2, num_epochs=2, donate=False
  )
  state = train_state.init_train_state(setup["params"], frozen)
  s, m = step(state, setup["batch"], jax.random.key(0), proximal_params=setup["params"])
  assert int(s.version) == 4 and int(s.step) == 1 and int(m["skipped"]) == 0
  assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
  np.testing.assert_allclose(m["ratio_mean"], 1.0, atol=1e-6)
  np.testing.assert_allclose(m["clip_frac"], 0.0, atol=1e-6)
  assert abs(float(m["behavior_ratio_mean"]) - 1.0) > 1e-3


def test_old_logp_reaches_the_loss_and_the_diagnostics(setup):
  """tis_old weighs by pi_old / mu from TrainBatch.old_logp; the factors are reported apart."""
  frozen = optax.sgd(0.0)
  step = train_step.make_train_step(setup["graphdef"], frozen, "tis_old", donate=False)
  state = train_state.init_train_state(setup["params"], frozen)
  batch = setup["batch"]
  key = jax.random.key(0)
  _, same = step(state, batch, key)  # old = mu: weight 1, no mismatch
  logp = np.asarray(setup["logp_fn"](setup["params"], batch))
  _, onpolicy = step(state, batch._replace(old_logp=logp.astype(np.float32)), key)
  np.testing.assert_allclose(same["corr_weight_mean"], 1.0, atol=1e-6)
  assert float(same["mismatch_kl_k3"]) == 0.0
  # pi_old = pi at the same parameters: no staleness; all of pi / mu is mismatch.
  np.testing.assert_allclose(onpolicy["staleness_kl_k3"], 0.0, atol=1e-6)
  np.testing.assert_allclose(onpolicy["mismatch_kl_k3"], onpolicy["behavior_kl_k3"], rtol=1e-4)
  assert abs(float(onpolicy["corr_weight_mean"]) - 1.0) > 1e-2


def test_default_proximal_anchor_is_the_starting_params(setup):
  """decoupled_ppo: without explicit proximal params the anchor is the state's own
  parameters (stop_gradient(logp) for one optimizer step, the starting params for
  several), equal to passing a copy of them."""
  for minibatches in (1, 2):
    step = train_step.make_train_step(
      setup["graphdef"], setup["sgd"], "decoupled_ppo", num_minibatches=minibatches, donate=False
    )
    state = train_state.init_train_state(setup["params"], setup["sgd"])
    key = jax.random.key(1)
    s1, m1 = step(state, setup["batch"], key)
    s2, m2 = step(state, setup["batch"], key, proximal_params=setup["params"])
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)


def test_micro_batches_combine_metrics_by_type(setup):
  """Token-weighted means, extremes and counts equal the one-micro-batch step's."""
  one = setup["step"]
  four = train_step.make_train_step(
    setup["graphdef"], setup["sgd"], LOSS, num_micro_batches=4, donate=False
  )
  state = train_state.init_train_state(setup["params"], setup["sgd"])
  _, m1 = one(state, setup["batch"], jax.random.key(0))
  _, m4 = four(state, setup["batch"], jax.random.key(0))
  for k in ("loss", "entropy", "ratio_mean", "ratio_max", "ratio_min", "clip_frac", "kl_k3"):
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert float(m4["tokens"]) == float(m1["tokens"]) == float(setup["batch"].mask.sum())


def test_no_recompilation_after_warmup(setup):
  compiles = []

  class _Count(logging.Handler):
    def emit(self, record):
      if "ompil" in record.getMessage():
        compiles.append(record.getMessage())

  step = setup["step"]
  state, _ = _run(setup, step)
  handler = _Count()
  logging.getLogger("jax").addHandler(handler)
  try:
    with jax.log_compiles(True):
      for t in range(3):
        batch = setup["batch"]._replace(versions=np.full((B, N), t, np.int32))
        state, metrics = step(state, batch, jax.random.key(t))
        float(metrics["loss"])
  finally:
    logging.getLogger("jax").removeHandler(handler)
  assert compiles == []


def test_sft_step_skips_nonfinite(setup):
  """A NaN loss keeps params and optimizer state and reports the skip; a good batch trains."""
  graphdef, params, b = setup["graphdef"], setup["params"], setup["batch"]
  opt = optax.adamw(1e-2)
  opt_state = opt.init(params)
  step = sft.make_sft_step(graphdef, opt)
  good = sft.SFTBatch(b.prompt_tokens, b.prompt_mask, b.tokens, b.mask)
  bad = good._replace(mask=np.where(np.arange(N) == 0, np.nan, b.mask).astype(np.float32))
  p1, o1, loss, skipped = step(params, opt_state, bad)
  assert int(skipped) == 1 and np.isnan(float(loss))
  jax.tree.map(np.testing.assert_array_equal, (p1, o1), (params, opt_state))
  p2, _, loss, skipped = step(params, opt_state, good)
  assert int(skipped) == 0 and np.isfinite(float(loss))
  moved = jax.tree.map(lambda a, c: float(jnp.abs(a - c).max()), p2, params)
  assert max(jax.tree.leaves(moved)) > 0
