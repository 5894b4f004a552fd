"""The planner's per-device bytes against live arrays and compiled programs (8 CPU devices)."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import default
from offpolicy_jax import lag, models
from offpolicy_jax.learn import train_step
from offpolicy_jax.rollout import partial as partial_rollout
from offpolicy_jax.run import components, planner
from offpolicy_jax.scale import disagg, sharding
from offpolicy_jax.step import run_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.2  # the bar: estimates within 20% of what is measured


def _config(variant: str):
  c = default.base_config()
  c.sft.enabled = False
  if variant == "sharded":  # more prompts and tokens, rows over data=2 x fsdp=2, 2 micro-batches
    c.prompts_per_step, c.max_prompt_len, c.max_new_tokens = 16, 24, 24
    c.mesh.data, c.mesh.fsdp = 2, 2
    c.train.micro_batch_size = 64
  c.lock()
  return c


def _device_bytes(tree, device=None) -> int:
  """Bytes `device` (default: the first) holds of the live arrays of `tree`."""
  d0 = device or jax.devices()[0]
  shards = (s for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == d0)
  return sum(s.data.nbytes for s in shards)


@functools.lru_cache(maxsize=2)
def _measured(variant: str):
  """The run's real state (as the loop builds it) and the compiled train step's temporaries."""
  config = _config(variant)
  fns = components.build_components(config).fns
  slots = lag.snapshot_capacity(config.lag.sync_interval, config.lag.sync_offset)
  state = run_state.init_state(
    fns, fns.model.init_params(0), capacity_batches=config.replay.capacity_batches, snapshots=slots
  )
  batch = sharding.shard_batch(run_state.empty_batch(fns.sizes), fns.model.mesh)
  step = functools.partial(
    train_step.train_step, fns.model.graphdef, fns.learner.optimizer, fns.learner.options
  )
  with jax.set_mesh(fns.model.mesh):
    compiled = (
      jax.jit(step, donate_argnums=0).lower(state.train, batch, jax.random.key(0), None).compile()
    )
  measured = {
    "params": _device_bytes(state.train.params),
    "optimizer state": _device_bytes(state.train.opt_state),
    "replay buffer": _device_bytes(state.replay),
    "lag snapshots": _device_bytes(state.snapshots.params),
    "activations (train step)": compiled.memory_analysis().temp_size_in_bytes,
  }
  return config, measured, _device_bytes(state)


@pytest.mark.parametrize("variant", ["default", "sharded"])
def test_estimate_within_20_percent_of_live_arrays_and_compiled_step(variant):
  config, measured, state_bytes = _measured(variant)
  got = planner.plan(config, devices=8, bytes_per_device=None, activations="analytic")
  for name, actual in measured.items():
    assert abs(got.bytes[name] - actual) <= TOLERANCE * actual, (name, got.bytes[name], actual)
  # State arrays are counted exactly (up to the replicated int32 counters).
  assert abs(got.state_bytes - state_bytes) <= 64
  total = state_bytes + measured["activations (train step)"]
  assert abs(got.peak_bytes - total) <= TOLERANCE * total


def test_compiled_activations_equal_the_real_train_step():
  config, measured, _ = _measured("default")
  got = planner.plan(config, devices=1, bytes_per_device=2**30, device_type="cpu")
  assert got.activations_source.startswith("compiled")
  assert got.bytes["activations (train step)"] == measured["activations (train step)"]
  assert got.headroom is not None and got.headroom > 0.9


def test_model_remat_reaches_the_compiled_train_step_and_the_plan():
  """`model_remat` rematerialises the blocks of the run's train step: XLA's temporaries of the
  scanned step shrink, and so does the analytic estimate (docs/speed.md: its calibration)."""

  def activations(remat: bool, source: str) -> int:
    c = _config("default")
    c.unlock()
    c.max_prompt_len, c.max_new_tokens, c.model_scan_layers, c.model_remat = 24, 48, True, remat
    c.lock()
    got = planner.plan(c, devices=1, bytes_per_device=None, device_type="cpu", activations=source)
    assert got.activations_source.startswith(source)
    return got.bytes["activations (train step)"]

  compiled = {r: activations(r, "compiled") for r in (False, True)}
  analytic = {r: activations(r, "analytic") for r in (False, True)}
  assert compiled[True] < 0.8 * compiled[False], compiled
  assert analytic[True] < analytic[False], analytic
  # Within 2x: for this 2-layer model the estimate's two blocks in the backward are all of them.
  assert compiled[True] / 2 <= analytic[True] <= 2 * compiled[True], (analytic, compiled)


def test_mesh_larger_than_this_machine_is_planned_arithmetically():
  got = planner.plan(_config("default"), devices=32, bytes_per_device=None, mesh_shape=(1, -1, 1))
  assert got.mesh == {"data": 1, "fsdp": 32, "tensor": 1}
  assert got.activations_source == "analytic"
  one = planner.plan(_config("default"), devices=1, bytes_per_device=None, activations="analytic")
  assert got.bytes["params"] < one.bytes["params"]  # vocab x embed and mlp x embed shard over fsdp


def _traced_caches(monkeypatch, fn, *args) -> list[tuple[int, int]]:
  """`(rows, positions)` of every KV cache `fn` allocates, from tracing it (nothing runs)."""
  calls, real = [], models.Decoder.init_cache

  def record(self, batch, max_len, dtype=None):
    calls.append((batch, max_len))
    return real(self, batch, max_len, dtype)

  monkeypatch.setattr(models.Decoder, "init_cache", record)
  jax.eval_shape(fn, *args)
  return calls


@pytest.mark.parametrize(
  "overrides",
  [{"rollout.partial_budget": 3}, {"mesh.sampler_devices": 4, "mesh.data": -1}],
  ids=["partial_rollouts", "disaggregated"],
)
def test_plan_sizes_replay_snapshots_and_kv_cache_as_the_run_does(overrides, monkeypatch):
  config = default.base_config()
  config.sft.enabled = False
  config.update_from_flattened_dict(overrides)
  config.lock()
  comps = components.build_components(config)
  fns, run = comps.fns, comps.run
  params = fns.model.init_params(0)
  slots = components.snapshot_slots(run.lag.mode, run.lag.sync_interval, run.lag.sync_offset)
  state = run_state.init_state(
    fns, params, capacity_batches=comps.replay_capacity_batches, snapshots=slots
  )
  got = planner.plan(config, devices=8, bytes_per_device=None, activations="analytic")
  # Replay buffer (partial rollouts: L = ceil(8 / 3) = 3 batches > capacity_batches) and snapshots.
  assert comps.replay_capacity_batches == (3 if config.rollout.partial_budget else 2)
  trainer_device = fns.model.mesh.devices.flat[0]
  assert abs(got.bytes["replay buffer"] - _device_bytes(state.replay, trainer_device)) <= 64
  assert got.bytes["lag snapshots"] == _device_bytes(state.snapshots.params, trainer_device)
  # The KV caches the run's own sampler allocates, on the mesh it samples on.
  g, p = fns.sizes.prompts_per_step, fns.sizes.max_prompt_len
  if isinstance(fns.rollout, partial_rollout.Partial):
    advance = fns.rollout.sampler.advance
    caches = _traced_caches(monkeypatch, advance, params, state.rollout, 0, _KEY)
  else:
    tokens, lengths = jnp.zeros((g, p), jnp.int32), jnp.full((g,), p, jnp.int32)
    caches = _traced_caches(monkeypatch, fns.sampler.__wrapped__, params, tokens, lengths, _KEY)
  assert tuple(caches) == planner.sampler_caches(config)
  mesh = fns.sampler_mesh or fns.model.mesh
  assert got.sampler == (None if fns.sampler_mesh is None else dict(mesh.shape))
  mc = nnx.merge(fns.model.graphdef, params).config
  shards = sharding.axis_size(mesh, sharding.BATCH_AXES)
  per_token = mc.kv_bytes_per_token() // mesh.shape[sharding.TENSOR]
  assert got.bytes["KV cache (sampler)"] == sum(r // shards * n * per_token for r, n in caches)
  if fns.sampler_mesh is not None:  # the sampler's devices hold a copy of the parameters
    copy = disagg.SamplerParams(fns.sampler_mesh).place(params)
    assert got.sampler_params_bytes == _device_bytes(copy, fns.sampler_mesh.devices.flat[0])
    assert got.peak_bytes == max(
      got.state_bytes + got.bytes["activations (train step)"],
      got.sampler_params_bytes + got.bytes["KV cache (sampler)"],
    )


_KEY = jax.random.key(0)


def _run(*flags):
  env = {**os.environ, "PYTHONPATH": ROOT}
  cmd = [sys.executable, "-m", "experiments.plan", *flags]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_binary_prints_a_verdict_for_gsm8k_on_v5e_8():
  out = _run("--config=configs/gsm8k_qwen25_1p5b.py", "--devices=v5e-8")
  assert out.returncode == 0, out.stderr
  assert "verdict: " in out.stdout and "16.0 GiB" in out.stdout
  assert "qwen2.5-1.5b" in out.stdout and "activations: analytic" in out.stdout


@pytest.mark.parametrize(
  "flags, field",
  [
    (["--devices=v9-8"], "devices"),
    (["--devices=0"], "devices"),
    (["--devices=-3", "--memory_gib=16"], "devices"),  # not read as 3
    (["--devices=v5e-8", "--config.mesh.tensor=3"], "mesh.fsdp"),
  ],
)
def test_binary_bad_input_names_the_field(flags, field):
  out = _run("--config=configs/gsm8k_qwen25_1p5b.py", *flags)
  assert out.returncode != 0
  assert field in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
  "rank, kl, per_token, rule",
  [
    (0, 0.0, 6.0, "6ND train + 2ND sample"),
    (2, 0.0, 4.0, "4ND train + 2ND sample"),
    (2, 0.01, 6.0, "6ND train (incl. 2ND reference forward) + 2ND sample"),
  ],
)
def test_step_flops_count_no_base_weight_gradients_with_adapters(rank, kl, per_token, rule):
  """Full: 6ND per trained token; adapters: 4ND (frozen base); a reference forward: +2ND."""
  c = default.base_config()
  c.sft.enabled, c.lora.rank, c.loss.kl_coef, c.train.num_epochs = False, rank, kl, 2
  got = planner.plan(c, devices=1, bytes_per_device=None, activations="analytic")
  mc, _ = planner.model_config(c)
  n_params = mc.num_params() + (mc.num_adapter_params() if rank else 0)
  g, k, p, n = components.sizes(c)[:4]
  want = per_token * n_params * g * k * (p + n) * 2 + 2 * n_params * (g * p + g * k * n)
  assert got.step_flops == pytest.approx(want, rel=1e-12)
  assert got.flops_rule == rule


def test_bad_field_values_are_named_before_any_size_is_read():
  for field, value in (("prompts_per_step", -1), ("max_prompt_len", 0)):
    config = default.base_config()
    config[field] = value
    with pytest.raises(ValueError, match=f"^config.{field}: "):
      planner.plan(config, devices=1, bytes_per_device=None)


def test_a_mixture_of_experts_counts_its_active_parameters_and_recorded_routing():
  """FLOPs use k of E experts per block; routing replay adds the recorded experts to the buffer."""
  c = default.base_config()
  c.sft.enabled, c.model = False, "tiny-moe"
  got = planner.plan(c, devices=1, bytes_per_device=None, activations="analytic")
  mc, _ = planner.model_config(c)
  assert mc.num_active_params() < mc.num_params()
  g, k, p, n = components.sizes(c)[:4]
  n_params = mc.num_active_params()
  want = 6.0 * n_params * g * k * (p + n) + 2 * n_params * (g * p + g * k * n)
  assert got.step_flops == pytest.approx(want, rel=1e-12)
  c.rollout.routing_replay = "record"
  recorded = planner.plan(c, devices=1, bytes_per_device=None, activations="analytic")
  rows = g * k * components.replay_capacity(c)
  extra = rows * (p + n) * mc.num_layers * mc.num_experts_per_tok  # uint8 expert indices
  buffer = recorded.bytes["replay buffer"] - got.bytes["replay buffer"]
  assert buffer == extra


@pytest.mark.parametrize("critic", ["policy", "tiny-moe"])
def test_a_separate_critic_is_planned_as_the_run_builds_it(critic):
  c = _config("default").copy_and_resolve_references()
  c.loss.name, c.critic.model = "ppo_critic", critic
  c.critic.kl_coef, c.critic.reward_norm = 0.0, False  # no reference forward
  params = components.build_components(c).fns.model.init_params(0)
  got = planner.plan(c, devices=8, bytes_per_device=None, activations="analytic")
  assert got.bytes["params"] == _device_bytes(params)
  mc, _ = planner.model_config(c)
  assert mc.critic is not None and mc.critic.num_params() > 0
  # The policy trains and samples (6N + 2N), the critic only trains (6N, its active params).
  g, k, p, n = components.sizes(c)[:4]
  policy = mc.num_params() - mc.critic.num_params()
  trained = 6.0 * (policy + mc.critic.num_active_params()) * g * k * (p + n)
  assert got.step_flops == pytest.approx(trained + 2.0 * policy * (g * p + g * k * n))


def test_a_preset_critic_takes_the_policys_vocabulary():
  c = _config("default").copy_and_resolve_references()
  c.model, c.loss.name, c.critic.model = "Qwen2.5-0.5B-Instruct", "ppo_critic", "qwen2.5-0.5b"
  mc, note = planner.model_config(c)  # a checkpoint name not on disk: its preset's architecture
  assert mc.critic.vocab_size == mc.vocab_size == models.get_config("qwen2.5-0.5b").vocab_size
  assert "qwen2.5-0.5b" in note
  got = planner.plan(c, devices=8, bytes_per_device=None, activations="analytic")
  assert "critic train" in got.flops_rule
