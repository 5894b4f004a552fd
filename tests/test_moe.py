"""Mixture-of-experts decoder (`models.moe`): HF parity, dropless dispatch, the log-prob contract.

Parity is against `transformers`' Qwen3-MoE and Mixtral on tiny random
checkpoints the tests write; the contract test samples with the tiny MoE
preset and scores as the learner does.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from offpolicy_jax import models, types
from offpolicy_jax.learn import scorer
from offpolicy_jax.models import moe
from offpolicy_jax.sampling import sampler as sampling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_COMMON = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
)
HF_CONFIGS = {
  "qwen3_moe": dict(
    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True
  ),
  # Unnormalised top-k weights, k = 3 of 5 experts.
  "qwen3_moe_raw": dict(
    head_dim=16,
    num_experts=5,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    norm_topk_prob=False,
  ),
  "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def _hf_config(name, **extra):
  cls = transformers.MixtralConfig if name == "mixtral" else transformers.Qwen3MoeConfig
  return cls(**_COMMON, **HF_CONFIGS[name], **extra)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  """name -> (torch model, checkpoint dir) of tiny random HF MoE models."""
  out = {}
  for name in HF_CONFIGS:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(name)).eval()
    with torch.no_grad():
      for p in model.parameters():  # Non-trivial norms and routers.
        p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path, safe_serialization=True)
    out[name] = (model, path)
  return out


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(0).randint(0, 64, (2, 40)).astype(np.int32)


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_from_pretrained_matches_transformers_and_exports_back(hf_models, tokens, tmp_path, name):
  hf_model, path = hf_models[name]
  model = models.from_pretrained(path)
  c = model.config
  assert c.family == name.removesuffix("_raw")
  assert (c.num_experts, c.norm_topk_prob) == {"qwen3_moe": (4, True), "mixtral": (4, True)}.get(
    name, (5, False)
  )
  expected = _torch_logits(hf_model, tokens)
  np.testing.assert_allclose(model(jnp.asarray(tokens)), expected, atol=1e-5, rtol=0)
  models.save_pretrained(model, str(tmp_path))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  np.testing.assert_allclose(_torch_logits(reloaded, tokens), expected, atol=1e-6, rtol=0)


def test_experts_load_into_a_mesh_device_by_device(hf_models, tokens):
  _, path = hf_models["qwen3_moe"]
  mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharded = models.from_pretrained(path, mesh=mesh, rules=[("expert", "expert"), ("embed", "fsdp")])
  gate = sharded.layers[1].mlp.gate_proj[...]
  assert gate.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", None)
  assert gate.addressable_shards[0].data.shape == (1, 16, 24)
  plain = models.from_pretrained(path)
  np.testing.assert_array_equal(gate, plain.layers[1].mlp.gate_proj[...])


def _dense_reference(layer: moe.MoE, x_td: np.ndarray) -> np.ndarray:
  """Each token through its k experts one at a time, in float64."""
  p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}
  c = layer.config
  out = np.zeros_like(x_td, np.float64)
  for t, x in enumerate(np.asarray(x_td, np.float64)):
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs)[: c.num_experts_per_tok]
    w = probs[chosen] / (probs[chosen].sum() if c.norm_topk_prob else 1.0)
    for e, we in zip(chosen, w, strict=True):
      g, u = x @ p["gate_proj"][e], x @ p["up_proj"][e]
      out[t] += we * ((g / (1 + np.exp(-g)) * u) @ p["down_proj"][e])
  return out


def test_dispatch_is_dropless_and_each_token_independent():
  c = models.get_config("tiny-moe")
  layer = moe.MoE(c, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (12, c.hidden_size))
  full = np.asarray(layer.mix(x, layer.routing(x)))
  np.testing.assert_allclose(full, _dense_reference(layer, np.asarray(x)), atol=1e-5)
  alone = np.concatenate(
    [np.asarray(layer.mix(x[i : i + 1], layer.routing(x[i : i + 1]))) for i in range(12)]
  )
  np.testing.assert_allclose(full, alone, atol=1e-6)
  # Every token forced onto the same two experts: none dropped (no capacity).
  crowded = moe.Routing(jnp.tile(jnp.array([[2, 0]]), (12, 1)), jnp.full((12, 2), 0.5), None)
  out = np.asarray(layer.mix(x, crowded))
  expert = lambda e: (
    jax.nn.silu(x @ layer.gate_proj[e]) * (x @ layer.up_proj[e]) @ layer.down_proj[e]
  )
  np.testing.assert_allclose(out, 0.5 * (expert(2) + expert(0)), atol=1e-5)


def test_replaying_a_routing_gives_the_same_output_and_its_own_weights():
  c = models.get_config("tiny-moe")
  layer = moe.MoE(c, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (9, c.hidden_size))
  own = layer.routing(x)
  replayed = layer.routing(x, experts=own.experts)
  np.testing.assert_array_equal(replayed.experts, own.experts)
  np.testing.assert_allclose(replayed.weights, own.weights, rtol=1e-6)
  other = layer.routing(x, experts=(own.experts + 1) % c.num_experts)
  assert not np.allclose(layer.mix(x, other), layer.mix(x, own))
  np.testing.assert_allclose(np.sum(other.weights, axis=-1), 1.0, rtol=1e-6)


def test_grouped_matmul_gradients_match_jax_under_vmap_over_seeds():
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(2, 7, 4), jnp.float32)
  w = jnp.asarray(rng.randn(2, 3, 4, 5), jnp.float32)
  sizes = jnp.array([[2, 0, 5], [3, 4, 0]], jnp.int32)
  loss = lambda mm: lambda x, w, s: jnp.sum(jnp.sin(mm(x, w, s)))
  ours = jax.vmap(jax.grad(loss(moe.grouped_matmul), argnums=(0, 1)))(x, w, sizes)
  for s in range(2):
    ref = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x[s], w[s], sizes[s])
    for a, b in zip(ours, ref, strict=True):
      np.testing.assert_allclose(a[s], b, atol=1e-5)
  # Weights shared by the seeds (a LoRA run's frozen experts): unbatched under vmap.
  shared = jax.vmap(jax.grad(loss(moe.grouped_matmul), argnums=(0, 1)), in_axes=(0, None, 0))
  dx, dw = shared(x, w[0], sizes)
  for s in range(2):
    ref = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x[s], w[0], sizes[s])
    np.testing.assert_allclose(dx[s], ref[0], atol=1e-5)
    np.testing.assert_allclose(dw[s], ref[1], atol=1e-5)


def test_load_balancing_loss_matches_transformers():
  from transformers.models.mixtral import modeling_mixtral

  rng = np.random.RandomState(0)
  logits = rng.randn(2, 10, 4).astype(np.float32)  # 2 layers, 10 tokens, 4 experts
  mask = (rng.rand(1, 10) > 0.3).astype(np.int64)
  ref = modeling_mixtral.load_balancing_loss_func(
    tuple(torch.tensor(x) for x in logits), 4, 2, torch.tensor(mask)
  )
  routings = [moe.route(jnp.asarray(x), 2, True) for x in logits]
  stacked = moe.Routing(*(jnp.concatenate(z) for z in zip(*routings, strict=True)))
  ours = moe.load_balancing_loss(stacked, np.tile(mask[0], 2))
  np.testing.assert_allclose(float(ours), float(ref), rtol=1e-5)
  balanced = moe.Routing(jnp.array([[0, 1], [2, 3]]), None, jnp.full((2, 4), 0.25))
  assert float(moe.load_balancing_loss(balanced)) == pytest.approx(2.0)


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("decoder_sparse_step", 2, "decoder_sparse_step=2 is not supported"),
    ("mlp_only_layers", [1], "mlp_only_layers=[1] is not supported"),
  ],
)
def test_unsupported_hf_moe_fields_are_refused_by_name(tmp_path, field, value, message):
  config = _hf_config("qwen3_moe", **{field: value})
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    models.config_from_hf(config.to_dict())


@pytest.mark.parametrize(
  "overrides,message",
  [
    (dict(num_experts_per_tok=5), r"num_experts_per_tok must be in \[1, num_experts=4\], got 5"),
    (dict(num_experts=0), "num_experts: family 'qwen3_moe' needs num_experts >= 1"),
    (dict(lora=models.LoraConfig(rank=2)), r"lora targets \(a run.s lora.targets\): with experts"),
  ],
)
def test_bad_expert_configs_are_refused_by_name(overrides, message):
  with pytest.raises(ValueError, match=message):
    models.get_config("tiny-moe", **overrides)


def test_the_sampler_log_probs_equal_teacher_forcing(numpy_init):
  graphdef, params = numpy_init(models.get_config("tiny-moe"), scale=4.0)
  prompts = np.array([[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16]], np.int32)
  lengths = np.array([3, 6], np.int32)
  sampler = sampling.make_sampler(
    graphdef, max_new_tokens=8, group_size=3, temperature=0.7, top_p=0.8, eos_id=3
  )
  out = sampler(params, prompts, lengths, jax.random.key(1))
  zeros_b = jnp.zeros(out.tokens.shape[0])
  batch = types.pack_groups(
    prompts,
    lengths,
    out.tokens,
    out.mask,
    out.logprobs,
    jnp.zeros(out.tokens.shape, jnp.int32),
    zeros_b,
    zeros_b,
    out.kept,
  )
  mask = np.asarray(out.mask) > 0
  assert mask.sum() > 20
  for shared in (0, 3):
    logp = scorer.token_logprobs(graphdef, params, batch, 0.7, shared, truncated=True)[0]
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(out.logprobs)[mask], atol=1e-5)


def test_active_parameters_count_k_of_e_experts():
  c = models.get_config("qwen3-30b-a3b")
  assert 30.0e9 < c.num_params() < 31.0e9 and 3.2e9 < c.num_active_params() < 3.5e9
  dense = models.get_config("tiny")
  assert dense.num_active_params() == dense.num_params()
  assert (
    dataclasses.replace(c, num_experts_per_tok=c.num_experts).num_active_params() == c.num_params()
  )


def _batch_of(numpy_init, config, seed=0):
  graphdef, params = numpy_init(config, scale=4.0, seed=seed)
  rng = np.random.RandomState(seed)
  g, k, p, n = 2, 3, 5, 6
  prompt_mask = np.ones((g, p), np.int32)
  prompt_mask[0, :2] = 0
  mask = (rng.rand(g * k, n) > 0.2).astype(np.float32)
  tokens = rng.randint(4, 64, (g * k, n)).astype(np.int32)
  zeros_b = jnp.zeros(g * k)
  batch = types.pack_groups(
    rng.randint(4, 64, (g, p)).astype(np.int32),
    prompt_mask.sum(1).astype(np.int32),
    tokens,
    mask,
    jnp.zeros((g * k, n)),
    jnp.zeros((g * k, n), jnp.int32),
    zeros_b + 1.0,
    zeros_b,
    jnp.zeros((g * k, n), jnp.int32),
  )
  return graphdef, params, batch, k


@pytest.mark.parametrize("scan_layers", [False, True])
def test_router_stats_are_the_same_with_a_shared_prefix_and_scanned_layers(numpy_init, scan_layers):
  config = dataclasses.replace(models.get_config("tiny-moe"), scan_layers=scan_layers)
  graphdef, params, batch, k = _batch_of(numpy_init, config)
  alone = scorer.token_logprobs(graphdef, params, batch, 1.0, 0, full=True).stats
  shared = scorer.token_logprobs(graphdef, params, batch, 1.0, k, full=True).stats
  real = float(np.sum(batch.prompt_mask) + np.sum(batch.mask))
  assert alone.tokens.shape == (config.num_layers,)  # one entry per block
  np.testing.assert_array_equal(alone.tokens, real)
  # A shared prefix runs each prompt once and counts it K times: the same stats.
  for a, b in zip(alone, shared, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.sum(alone.chosen, -1), alone.tokens * config.num_experts_per_tok)
  assert float(np.sum(alone.agree)) == 0.0  # nothing recorded to agree with
  assert 1.0 <= float(alone.max_load()) <= config.num_experts / config.num_experts_per_tok
  dense_graph, dense_params = numpy_init(models.get_config("tiny"))
  assert scorer.token_logprobs(dense_graph, dense_params, batch, 1.0, 0, full=True).stats is None


def test_the_load_balancing_loss_joins_the_policy_loss_by_its_coefficient(numpy_init):
  from offpolicy_jax import losses
  from offpolicy_jax.learn import micro_batch_loss, step_options

  graphdef, params, batch, k = _batch_of(numpy_init, models.get_config("tiny-moe"))
  batch = batch._replace(advantages=jnp.ones_like(batch.mask))

  def run(coef):
    options = step_options.StepOptions(losses.get_spec("grpo"), group_size=k, router_aux_coef=coef)
    fn = lambda p: micro_batch_loss.micro_batch_loss(p, batch, graphdef, options, None, None)
    (loss_sum, metrics), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return loss_sum, metrics, grads

  plain, metrics, g0 = run(0.0)
  with_aux, _, g1 = run(0.5)
  aux = metrics["moe/aux_loss"]
  count = float(np.sum(batch.mask))  # token_mean: the loss's count is its valid tokens
  np.testing.assert_allclose(
    float(with_aux - plain), 0.5 * float(aux.total / aux.weight) * count, rtol=1e-5
  )
  router = lambda g: np.asarray(g["layers"][0]["mlp"]["router"][...])
  assert np.abs(router(g1) - router(g0)).max() > 1e-6
