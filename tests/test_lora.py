"""Tests for LoRA adapters (models.lora): exactness, merging, sampler, PEFT round trip."""

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.models import lora
from offpolicy_jax.sampling import sampler as sampling

_LORA = models.LoraConfig(rank=4, alpha=8.0)


def _tiny(lora_config=_LORA, **kw):
  return models.get_config("tiny", vocab_size=40, lora=lora_config, **kw)


def _random_b(model, scale=0.3, seed=1):
  """`model` with non-zero B matrices (a trained-looking adapter)."""
  graphdef, adapter, base = nnx.split(model, nnx.LoRAParam, ...)
  leaves, tree = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), base)


def _tokens(b=2, t=7, vocab=40, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def test_fresh_adapter_is_exactly_the_base_and_the_base_does_not_depend_on_it():
  plain = models.Decoder(_tiny(None), rngs=nnx.Rngs(3))
  adapted = models.Decoder(_tiny(), rngs=nnx.Rngs(3))
  base, adapter = lora.split(nnx.state(adapted))
  chex.assert_trees_all_equal(nnx.to_pure_dict(base), nnx.to_pure_dict(nnx.state(plain)))
  assert all(float(jnp.abs(b).max()) == 0 for b in jax.tree.leaves(adapter)[1::2])
  tokens = _tokens()
  np.testing.assert_array_equal(np.asarray(adapted(tokens)), np.asarray(plain(tokens)))
  per_layer = sum(4 * sum(s) for s in _tiny().adapter_shapes().values())
  assert _tiny().num_adapter_params() == per_layer * _tiny().num_layers
  assert sum(x.size for x in jax.tree.leaves(adapter)) == _tiny().num_adapter_params()


@pytest.mark.parametrize("targets", [models.LORA_TARGETS, ("q_proj", "down_proj")])
def test_adapted_forward_equals_the_merged_weights(targets):
  config = _tiny(models.LoraConfig(rank=3, alpha=5.0, targets=targets), qkv_bias=True)
  fresh = models.Decoder(config, rngs=nnx.Rngs(0))
  model = _random_b(fresh)
  merged = lora.without_adapters(model)
  assert merged.config.lora is None
  tokens = _tokens()
  ours, ref = model(tokens), merged(tokens)
  assert float(jnp.abs(ours - fresh(tokens)).max()) > 1e-3  # the adapter matters
  np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_join_split_and_init_adapter():
  config = _tiny()
  model = models.Decoder(config, rngs=nnx.Rngs(params=jax.random.key(5)))
  base, adapter = lora.split(nnx.state(model))
  chex.assert_trees_all_equal(
    nnx.to_pure_dict(lora.init_adapter(config, jax.random.key(5))), nnx.to_pure_dict(adapter)
  )
  joined = lora.join(base, adapter)
  assert jax.tree.structure(joined) == jax.tree.structure(nnx.state(model))
  assert lora.join(None, adapter) is adapter
  plain = models.Decoder(_tiny(None), rngs=nnx.Rngs(0))
  added = lora.with_adapters(plain, _LORA, jax.random.key(1))
  tokens = _tokens()
  np.testing.assert_array_equal(np.asarray(added(tokens)), np.asarray(plain(tokens)))
  with pytest.raises(ValueError, match="already has adapters"):
    lora.with_adapters(added, _LORA, jax.random.key(1))


def test_sampler_with_adapters_matches_the_merged_model():
  model = _random_b(models.Decoder(_tiny(), rngs=nnx.Rngs(0)), scale=0.1)
  merged = lora.without_adapters(model)
  prompts = jnp.array([[0, 3, 4, 5], [6, 7, 8, 9]], jnp.int32)
  lengths = jnp.array([3, 4], jnp.int32)
  key = jax.random.key(2)
  outs = []
  for m in (model, merged):
    graphdef, params = nnx.split(m)
    fn = sampling.make_sampler(graphdef, max_new_tokens=5, group_size=2, temperature=1.0)
    outs.append(fn(params, prompts, lengths, key))
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs), atol=1e-5)


def test_config_checks():
  with pytest.raises(ValueError, match="rank"):
    models.LoraConfig(rank=0)
  with pytest.raises(ValueError, match="targets"):
    models.LoraConfig(rank=2, targets=("qkv",))
  with pytest.raises(ValueError, match="alpha"):
    models.LoraConfig(rank=2, alpha=0.0)
  for p in (-0.1, 1.0):
    with pytest.raises(ValueError, match="dropout"):
      models.LoraConfig(rank=2, dropout=p)


# ------------------------------------------------------------------ PEFT


def test_peft_round_trip_matches_hf_and_peft(tmp_path):
  """Ours == HF + peft on a tiny random Qwen2 (export), and import restores the adapter."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  hf_config = transformers.Qwen2Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
  )
  torch.manual_seed(0)
  hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
  base_dir, adapter_dir, merged_dir = (str(tmp_path / d) for d in ("base", "adapter", "merged"))
  hf_model.save_pretrained(base_dir)
  base = models.from_pretrained(base_dir)
  lc = dataclasses.replace(_LORA, dropout=0.1)  # exported, and inert outside training
  model = _random_b(lora.with_adapters(base, lc, jax.random.key(0)), scale=0.2)
  lora.save_peft(model, adapter_dir, base_model_name_or_path=base_dir)
  lora.save_merged(model, merged_dir)
  config = json.load(open(os.path.join(adapter_dir, lora.CONFIG_FILE)))
  assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
  assert config["lora_dropout"] == 0.1

  tokens = np.array(_tokens(2, 9, 64))
  ours = np.asarray(model(jnp.asarray(tokens)))
  with torch.no_grad():
    fresh = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with_peft = peft.PeftModel.from_pretrained(fresh, adapter_dir).eval()
    theirs = with_peft(torch.as_tensor(tokens)).logits.float().numpy()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    theirs_merged = merged(torch.as_tensor(tokens)).logits.float().numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ours, theirs_merged, atol=1e-5, rtol=0)

  back = lora.load_peft(base, adapter_dir)
  assert back.config.lora == dataclasses.replace(lc, targets=tuple(sorted(lc.targets)))
  chex.assert_trees_all_close(
    nnx.to_pure_dict(nnx.state(back)), nnx.to_pure_dict(nnx.state(model)), atol=0, rtol=0
  )


def test_load_peft_names_what_is_wrong(tmp_path):
  model = models.Decoder(_tiny(), rngs=nnx.Rngs(0))
  lora.save_peft(model, str(tmp_path))
  file = tmp_path / lora.CONFIG_FILE
  config = json.loads(file.read_text())
  file.write_text(json.dumps({**config, "use_dora": True}))
  with pytest.raises(ValueError, match="use_dora"):
    lora.load_peft(model, str(tmp_path))
  file.write_text(json.dumps({**config, "r": 5}))
  with pytest.raises(ValueError, match="lora_A.weight' has shape"):
    lora.load_peft(model, str(tmp_path))
