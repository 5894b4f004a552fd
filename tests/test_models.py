"""Tests for offpolicy_jax.models: HF parity, checkpoint io, padding, chunked log-probs."""

import functools
import json
import os
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.models import hf as hf_io
from offpolicy_jax.models import layout
from offpolicy_jax.scale import sharding

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
_LLAMA3_SCALING = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16,
}


def _hf_config(family):
  if family == "qwen2":
    return transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True)
  if family == "qwen3":
    return transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=False)
  # Positions up to 40 > original_max_position_embeddings: the llama3 scaling matters.
  return transformers.LlamaConfig(
    **_COMMON, rope_scaling=_LLAMA3_SCALING, rope_theta=500000.0, tie_word_embeddings=False
  )


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  """family -> (torch model, checkpoint dir) of tiny random HF models."""
  out = {}
  for family in ("qwen2", "qwen3", "llama"):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family)).eval()
    with torch.no_grad():
      for p in model.parameters():  # Non-trivial norms and biases.
        p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp(family))
    model.save_pretrained(path, safe_serialization=True)
    out[family] = (model, path)
  return out


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(0).randint(0, 64, (2, 40)).astype(np.int32)


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_from_pretrained_matches_transformers(hf_models, tokens, family):
  hf_model, path = hf_models[family]
  model = models.from_pretrained(path)
  assert model.config.family == family
  assert (model.config.rope_scaling is not None) == (family == "llama")
  logits = model(jnp.asarray(tokens))
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, _torch_logits(hf_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_save_pretrained_round_trip(hf_models, tokens, tmp_path, family):
  hf_model, path = hf_models[family]
  models.save_pretrained(models.from_pretrained(path), str(tmp_path))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  np.testing.assert_allclose(
    _torch_logits(reloaded, tokens), _torch_logits(hf_model, tokens), atol=1e-6, rtol=0
  )


def test_sharded_checkpoint_into_mesh(hf_models, tokens, tmp_path):
  hf_model, path = hf_models["qwen3"]
  hf_model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="20KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  model = models.from_pretrained(str(tmp_path))
  np.testing.assert_allclose(
    model(jnp.asarray(tokens)), _torch_logits(hf_model, tokens), atol=1e-4, rtol=0
  )
  mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = [("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor")]
  sharded = models.from_pretrained(str(tmp_path), mesh=mesh, rules=rules)
  gate = sharded.layers[0].mlp.gate_proj[...]
  assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (16, 12)
  # Axes the rules do not list ("heads") are replicated; the default is the one
  # rules table of `sharding`, which shards them over "tensor".
  q = sharded.layers[0].self_attn.q_proj[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, None)
  default = models.from_pretrained(str(tmp_path), mesh=mesh)
  q = default.layers[0].self_attn.q_proj[...]
  assert q.sharding.spec == sharding.logical_to_spec(("embed", "heads", "head_dim"), q.shape, mesh)
  assert q.sharding.spec[1] == "tensor"
  chex.assert_trees_all_close(
    nnx.to_pure_dict(nnx.state(sharded)), nnx.to_pure_dict(nnx.state(model)), atol=0, rtol=0
  )
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda m, t: m(t))(sharded, jnp.asarray(tokens))
  np.testing.assert_allclose(logits, _torch_logits(hf_model, tokens), atol=1e-4, rtol=0)


def test_bfloat16_checkpoint_loads(hf_models, tokens, tmp_path):
  hf_model, path = hf_models["llama"]
  model = models.from_pretrained(path)
  models.save_pretrained(model, str(tmp_path), dtype=jnp.bfloat16)
  loaded = models.from_pretrained(str(tmp_path), compute_dtype=jnp.bfloat16)
  assert loaded.embed_tokens[...].dtype == jnp.float32
  logits = loaded(jnp.asarray(tokens))
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, _torch_logits(hf_model, tokens), atol=0.1)


def test_missing_tensor_is_named(hf_models, tmp_path):
  _, path = hf_models["qwen2"]
  tensors = hf_io._open_checkpoint(path)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  safetensors.numpy.save_file(
    {k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp_path / "model.safetensors")
  )
  with open(os.path.join(path, "config.json")) as f:
    (tmp_path / "config.json").write_text(f.read())
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
    models.from_pretrained(str(tmp_path))


def test_unsupported_architecture_is_named(tmp_path):
  (tmp_path / "config.json").write_text(
    json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
  )
  with pytest.raises(ValueError, match="GPT2LMHeadModel"):
    models.from_pretrained(str(tmp_path))


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny, tmp_path_factory):
  """A saved tiny model (config.json + model.safetensors) that tests copy, then corrupt."""
  path = tmp_path_factory.mktemp("tiny_ckpt")
  models.save_pretrained(tiny, str(path))
  return path


def _copy(src, dst):
  shutil.copytree(src, dst, dirs_exist_ok=True)
  return dst


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_corrupt_json_is_named(tiny_checkpoint, tmp_path, name):
  path = _copy(tiny_checkpoint, tmp_path)
  (path / name).write_text('{"vocab_size": 64,\n "hidden_size": }')
  match = re.escape(f"{path / name}: invalid JSON: Expecting value at line 2 column 17")
  with pytest.raises(ValueError, match=match):
    models.from_pretrained(str(path))
  (path / name).write_text("[1, 2]")
  with pytest.raises(ValueError, match=re.escape(f"{path / name}: expected a JSON object")):
    models.from_pretrained(str(path))


def _header(file):
  raw = file.read_bytes()
  n = int(np.frombuffer(raw[:8], "<u8")[0])
  return json.loads(raw[8 : 8 + n]), 8 + n


def test_truncated_safetensors_names_tensor_and_bytes(tiny, tiny_checkpoint, tmp_path):
  path = _copy(tiny_checkpoint, tmp_path)
  file = path / "model.safetensors"
  header, offset = _header(file)
  size = file.stat().st_size
  # One byte short: only the tensor stored last is cut.
  del header["__metadata__"]
  name, info = max(header.items(), key=lambda kv: kv[1]["data_offsets"][1])
  start, end = info["data_offsets"]
  assert offset + end == size
  file.write_bytes(file.read_bytes()[:-1])
  want = (
    f"{file}: truncated safetensors file: the header says tensor {name!r} spans bytes "
    f"{offset + start}..{offset + end} but the file has {size - 1} bytes"
  )
  with pytest.raises(ValueError, match=re.escape(want)):
    models.from_pretrained(str(path))
  # Cut inside the header.
  file.write_bytes(file.read_bytes()[:20])
  want = f"{file}: truncated or corrupt safetensors file: the header length is {offset - 8} bytes"
  with pytest.raises(ValueError, match=re.escape(want) + ".*the file has 20 bytes"):
    models.from_pretrained(str(path))
  # Intact files still load.
  loaded = models.from_pretrained(str(_copy(tiny_checkpoint, tmp_path / "intact")))
  chex.assert_trees_all_close(
    nnx.to_pure_dict(nnx.state(loaded)), nnx.to_pure_dict(nnx.state(tiny)), atol=0, rtol=0
  )


def test_corrupt_safetensors_header_is_named(tiny_checkpoint, tmp_path):
  path = _copy(tiny_checkpoint, tmp_path)
  file = path / "model.safetensors"
  header, offset = _header(file)
  raw = bytearray(file.read_bytes())
  raw[8] = ord("!")  # The header's opening brace.
  file.write_bytes(bytes(raw))
  want = f"{file}: corrupt safetensors header (bytes 8..{offset}): Expecting value"
  with pytest.raises(ValueError, match=re.escape(want)):
    models.from_pretrained(str(path))
  # A header entry whose offsets disagree with its shape.
  name = "model.norm.weight"
  header[name]["data_offsets"][1] += 4
  text = json.dumps(header).encode()
  file.write_bytes(np.uint64(len(text)).tobytes() + text + bytes(raw[offset:]))
  (d,), (start, end) = header[name]["shape"], header[name]["data_offsets"]
  want = (
    f"{file}: corrupt safetensors header: tensor {name!r} of dtype F32 and shape [{d}] "
    f"needs {4 * d} bytes but its data_offsets are {start}..{end}"
  )
  with pytest.raises(ValueError, match=re.escape(want)):
    models.from_pretrained(str(path))


def test_presets_have_published_sizes():
  published = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "llama3.2-1b": 1_235_814_400,
    "llama3.1-8b": 8_030_261_248,
  }
  for name, count in published.items():
    assert models.get_config(name).num_params() == count, name
  assert 80_000 < models.get_config("tiny").num_params() < 120_000
  assert 20e6 < models.get_config("small").num_params() < 30e6
  with pytest.raises(ValueError, match="preset_name"):
    models.get_config("gpt5")
  with pytest.raises(ValueError, match="not_a_field"):
    models.get_config("tiny", not_a_field=1)


@pytest.fixture(scope="module")
def tiny(numpy_init):
  return nnx.merge(*numpy_init(models.get_config("tiny")))


@pytest.fixture(scope="module")
def forward():
  """Jitted full forward shared by the tests (all calls use [2, 12] inputs)."""
  return jax.jit(lambda model, tokens, mask: model(tokens, attention_mask=mask))


def test_logical_axis_names(tiny):
  specs = nnx.get_partition_spec(nnx.state(tiny))
  p = jax.sharding.PartitionSpec
  assert specs["embed_tokens"].get_value() == p("vocab", "embed")
  attn = specs["layers"][0]["self_attn"]
  assert attn["q_proj"].get_value() == p("embed", "heads", "head_dim")
  assert attn["k_proj"].get_value() == p("embed", "kv_heads", "head_dim")
  assert specs["layers"][0]["mlp"]["down_proj"].get_value() == p("mlp", "embed")


def test_left_padding_is_exact(tiny, forward):
  rng = np.random.RandomState(1)
  r1, r2, tail = rng.randint(1, 64, 12), rng.randint(1, 64, 7), rng.randint(1, 64, 5)
  # Row 1 of `padded` is r2 behind 5 pads (token 0 and token 9: pad ids must not matter).
  padded = np.stack([r1, np.concatenate([[0, 9, 0, 9, 0], r2])]).astype(np.int32)
  padded_mask = np.array([[1] * 12, [0] * 5 + [1] * 7], np.int32)
  # Causality: positions < 7 of r2 + tail see exactly r2 alone.
  plain = np.stack([np.concatenate([r2, tail]), r1]).astype(np.int32)
  got = forward(tiny, padded, padded_mask)
  ref = forward(tiny, plain, np.ones((2, 12), np.int32))
  np.testing.assert_allclose(got[1, 5:], ref[0, :7], atol=1e-5, rtol=0)
  np.testing.assert_allclose(got[0], ref[1], atol=1e-5, rtol=0)


def _np_logp_entropy(logits, targets, temperature):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
  return logp, -(np.exp(logp_all) * logp_all).sum(-1)


def test_sequence_logprobs_matches_numpy(tiny, forward):
  rng = np.random.RandomState(2)
  prompt = rng.randint(1, 64, (2, 5)).astype(np.int32)
  prompt_mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.float32)
  resp = rng.randint(1, 64, (2, 7)).astype(np.int32)
  resp_mask = np.array([[1] * 7, [1] * 4 + [0] * 3], np.float32)
  fn = jax.jit(lambda m, *a: models.sequence_logprobs(m, *a, temperature=0.7, chunk_size=3))
  logp, entropy = fn(tiny, prompt, prompt_mask, resp, resp_mask)
  full = forward(
    tiny,
    np.concatenate([prompt, resp], 1),
    np.concatenate([prompt_mask, np.ones_like(resp_mask)], 1),
  )
  ref_logp, ref_ent = _np_logp_entropy(full[:, 4:-1], resp, 0.7)
  np.testing.assert_allclose(logp, ref_logp * resp_mask, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(entropy, ref_ent * resp_mask, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(logp).sum()) > 1.0


def test_logprobs_matches_numpy(tiny, forward):
  rng = np.random.RandomState(3)
  toks = rng.randint(1, 64, (2, 12)).astype(np.int32)
  targets = rng.randint(1, 64, (2, 12)).astype(np.int32)
  mask = np.array([[0] * 3 + [1] * 9, [1] * 12], np.float32)
  logp, entropy = jax.jit(lambda m, *a: models.logprobs(m, *a, chunk_size=5))(
    tiny, toks, targets, mask
  )
  ref_logp, ref_ent = _np_logp_entropy(forward(tiny, toks, mask), targets, 1.0)
  np.testing.assert_allclose(logp, ref_logp * mask, atol=1e-5, rtol=0)
  np.testing.assert_allclose(entropy, ref_ent * mask, atol=1e-5, rtol=0)


def _one_layer(tiny, remat):
  """(graphdef, params) of a 1-layer tiny model holding the first layer of `tiny`."""
  config = models.get_config("tiny", num_layers=1, remat=remat)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0))))
  pure = nnx.to_pure_dict(nnx.state(tiny))
  pure["layers"] = {0: pure["layers"][0]}
  nnx.replace_by_pure_dict(state, pure)
  return graphdef, state


def _next_token_loss(params, graphdef):
  """Summed next-token NLL of a fixed [2, 6] batch (for gradient comparisons)."""
  toks = np.arange(1, 13, dtype=np.int32).reshape(2, 6)
  logp, _ = models.logprobs(
    nnx.merge(graphdef, params), toks, np.roll(toks, -1, 1), np.ones((2, 6))
  )
  return -logp.sum()


def test_remat_does_not_change_gradients(tiny):
  graphdef, params = _one_layer(tiny, remat=False)
  remat_graphdef, _ = _one_layer(tiny, remat=True)
  grad = jax.jit(jax.grad(_next_token_loss), static_argnums=1)
  g, g_remat = grad(params, graphdef), grad(params, remat_graphdef)
  chex.assert_trees_all_close(g_remat, g, atol=1e-5)
  assert float(jnp.abs(g["layers"][0]["mlp"]["up_proj"][...]).sum()) > 0


@pytest.mark.parametrize("remat", [False, True])
def test_scan_layers_gives_the_same_logits_and_gradients(tiny, remat):
  """`scan_layers` stacks the blocks' parameters over layers and runs them as one lax.scan:
  the same numbers from the same seed, one leaf per kind of weight."""
  graphdef, params = nnx.split(tiny)
  scanned = models.get_config("tiny", scan_layers=True, remat=remat)
  drawn = nnx.to_pure_dict(nnx.state(models.Decoder(scanned, rngs=nnx.Rngs(0))))
  plain = nnx.to_pure_dict(nnx.state(models.Decoder(tiny.config, rngs=nnx.Rngs(0))))
  chex.assert_trees_all_equal(drawn, layout.stack(plain))  # drawn as the per-layer blocks
  chex.assert_trees_all_equal(layout.unstack(drawn, tiny.config.num_layers), plain)
  _, scan_params = nnx.split(layout.relayout(tiny, True))  # tiny's own weights, stacked
  scan_graphdef = nnx.split(nnx.eval_shape(lambda: models.Decoder(scanned, rngs=nnx.Rngs(0))))[0]
  chex.assert_trees_all_equal(nnx.to_pure_dict(scan_params), layout.stack(nnx.to_pure_dict(params)))
  assert len(jax.tree.leaves(scan_params)) < len(jax.tree.leaves(params))
  grad = jax.jit(jax.value_and_grad(_next_token_loss), static_argnums=1)
  (v, g), (v_scan, g_scan) = grad(params, graphdef), grad(scan_params, scan_graphdef)
  np.testing.assert_allclose(v_scan, v, rtol=1e-5)
  chex.assert_trees_all_close(
    nnx.to_pure_dict(g_scan), layout.stack(nnx.to_pure_dict(g)), atol=1e-5
  )


def test_decoder_constrains_activations_under_a_mesh(tiny):
  """With a mesh set (`jax.set_mesh`) activations get sharding constraints; without, none."""
  from jax.sharding import AxisType

  graphdef, params = nnx.split(tiny)
  toks = np.ones((8, 6), np.int32)
  f = jax.jit(lambda p, t: nnx.merge(graphdef, p).hidden_states(t)[0])
  plain = f.lower(params, toks).as_text()
  mesh = jax.make_mesh((8, 1, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  with jax.set_mesh(mesh):
    constrained = f.lower(params, toks).as_text()
  assert "sharding_constraint" not in plain
  # One after the embedding and one after each block.
  assert constrained.count("sharding_constraint") >= tiny.config.num_layers + 1


def test_bfloat16_compute_with_float32_master_weights_keeps_logprobs_close():
  """Mixed precision (config.model_dtype="bfloat16"): bf16 matmuls, fp32 params, log-softmax."""
  import dataclasses

  cfg32 = models.get_config("small", dtype="float32", param_dtype="float32")
  graphdef32, params = nnx.split(models.Decoder(cfg32, rngs=nnx.Rngs(0)))
  cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
  graphdef16 = nnx.split(nnx.eval_shape(lambda: models.Decoder(cfg16, rngs=nnx.Rngs(0))))[0]
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, cfg32.vocab_size, (4, 16))
  tokens = rng.integers(1, cfg32.vocab_size, (4, 32))
  args = (prompt, np.ones((4, 16)), tokens, np.ones((4, 32)))

  @functools.partial(jax.jit, static_argnums=0)  # one program each, not an op-by-op forward
  def logprobs(graphdef, p):
    return models.sequence_logprobs(nnx.merge(graphdef, p), *args)[0]

  ref = np.asarray(logprobs(graphdef32, params))
  low = logprobs(graphdef16, params)
  assert low.dtype == jnp.float32
  # Measured 0.016 max / 0.0040 mean absolute error on log-probs of about -9.2.
  assert np.abs(np.asarray(low) - ref).max() < 0.05
  assert np.abs(np.asarray(low) - ref).mean() < 0.01
  grads = jax.jit(jax.grad(lambda p: logprobs(graphdef16, p).sum()))(params)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def test_a_hub_id_loads_from_a_prefilled_cache(hf_models, tmp_path, monkeypatch):
  """`config.model=org/name` on an offline machine: the files come from the HF cache."""
  import huggingface_hub

  from offpolicy_jax import config_schema, errors
  from offpolicy_jax.models import hub
  from offpolicy_jax.run import validation

  _, path = hf_models["qwen2"]
  repo = tmp_path / "hub" / "models--testorg--tiny-qwen2"
  commit = "0123456789abcdef0123456789abcdef01234567"
  shutil.copytree(path, repo / "snapshots" / commit)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  hub._snapshot.cache_clear()
  try:
    local = hub.model_dir("testorg/tiny-qwen2")
    assert local == str(repo / "snapshots" / commit)
    got = nnx.state(models.from_pretrained(local))
    want = nnx.state(models.from_pretrained(path))
    chex.assert_trees_all_equal(got, want)
    config = config_schema.config_dict()
    config.model = "testorg/tiny-qwen2"
    validation.validate_config(config)  # the id is a model, as a directory would be
    config.model = "testorg/not-there"
    with pytest.raises(errors.ConfigError, match="'testorg/not-there' .* cache"):
      validation.validate_config(config)
  finally:
    hub._snapshot.cache_clear()
  assert not hub.is_repo_id("tiny") and not hub.is_repo_id("/abs/path")
  assert hub.model_dir("tiny") is None  # a preset
