"""Blocks stacked over layers (`ModelConfig.scan_layers`, `models.layout`): the same numbers as
per-layer blocks in every forward (teacher forcing, the sampler's cached decode, adapters,
experts), HF and PEFT files read and written per layer, and trees converted both ways."""

import dataclasses
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.models import layout, lora
from offpolicy_jax.sampling import continuous as continuous_lib
from offpolicy_jax.sampling import sampler

G, K, P, N = 2, 2, 5, 6


def _pair(config, key=0, scan_decode=False):
  """(per-layer model, stacked model) of `config` from one seed."""
  plain = models.Decoder(dataclasses.replace(config, scan_layers=False), rngs=nnx.Rngs(key))
  stacked = dataclasses.replace(config, scan_layers=True, scan_decode=scan_decode)
  return plain, models.Decoder(stacked, rngs=nnx.Rngs(key))


def _pure(model, kind=nnx.Param):
  return nnx.to_pure_dict(nnx.state(model, kind))


def _sample(model, continuous=False):
  graphdef, params = nnx.split(model)
  kw = dict(max_new_tokens=N, group_size=K, temperature=1.0)
  if continuous:  # one group resident at a time: rows and prompts move between slots
    fn = continuous_lib.make_continuous_sampler(graphdef, slots=1, **kw)
  else:
    fn = sampler.make_sampler(graphdef, **kw)
  prompts = jax.random.randint(jax.random.key(1), (G, P), 1, model.config.vocab_size)
  return fn(params, prompts, jnp.array([P, P - 2]), jax.random.key(2))


@pytest.mark.parametrize(
  "preset, scan_decode", [("tiny", False), ("tiny", True), ("tiny-moe", True)]
)
def test_stacked_blocks_hold_and_sample_the_same_numbers(preset, scan_decode):
  plain, stacked = _pair(models.get_config(preset), scan_decode=scan_decode)
  chex.assert_trees_all_equal(_pure(stacked), layout.stack(_pure(plain)))
  spec = nnx.get_partition_spec(nnx.state(stacked))["layers"]["self_attn"]["q_proj"]
  assert tuple(spec.get_value()) == ("layers", "embed", "heads", "head_dim")
  # Per layer (`layout.for_decoding`) or one scan over the stacked blocks and caches.
  cache = stacked.init_cache(2, 3)
  assert isinstance(cache.k, tuple) != scan_decode
  for continuous in (False, True):
    a, b = _sample(plain, continuous), _sample(stacked, continuous)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_scanned_extend_writes_the_cache_as_per_layer_blocks():
  """`extend_shared` (a multi-turn observation) over stacked caches, rows with 0 tokens kept."""
  plain, stacked = _pair(models.get_config("tiny"), scan_decode=True)
  prompt = jax.random.randint(jax.random.key(3), (G, P), 1, 50)
  mask = jnp.ones((G, P))
  tokens = jax.random.randint(jax.random.key(4), (G * K, 3), 1, 50)
  counts = jnp.array([3, 0, 2, 1])
  out = []
  for m in (plain, stacked):
    prefix = m(prompt, attention_mask=mask, cache=m.init_cache(G, P), cache_index=0)[1]
    h, suffix = m.extend_shared(tokens, counts, prefix, m.init_cache(G * K, 6), mask, 0)
    out.append((h, jnp.stack(suffix.k) if isinstance(suffix.k, tuple) else suffix.k))
  np.testing.assert_allclose(out[1][0][counts > 0], out[0][0][counts > 0], atol=1e-5)
  np.testing.assert_allclose(out[1][1], out[0][1], atol=1e-5)
  assert float(jnp.abs(out[1][1][:, 1]).max()) == 0.0  # row 1 wrote nothing


def test_adapters_are_stacked_and_merge_as_per_layer():
  lc = models.LoraConfig(4, 8.0, ("down_proj", "o_proj", "q_proj"))
  plain, stacked = _pair(models.get_config("tiny", lora=lc))
  # B starts at 0: give it values so the merge is visible.
  for m in (plain, stacked):
    nnx.update(m, jax.tree.map(lambda x: x + 0.01, nnx.state(m, nnx.LoRAParam)))
  chex.assert_trees_all_equal(
    _pure(stacked, nnx.LoRAParam), layout.stack(_pure(plain, nnx.LoRAParam))
  )
  merged_plain, merged_stacked = lora.without_adapters(plain), lora.without_adapters(stacked)
  chex.assert_trees_all_close(
    _pure(merged_stacked), layout.stack(_pure(merged_plain)), atol=1e-6, rtol=1e-6
  )
  tokens = jnp.arange(14).reshape(2, 7) % plain.config.vocab_size
  np.testing.assert_allclose(stacked(tokens), plain(tokens), atol=1e-5)


def test_hf_and_peft_files_are_per_layer_in_either_layout(tmp_path):
  lc = models.LoraConfig(4, 8.0, ("k_proj", "up_proj"))
  plain, stacked = _pair(models.get_config("tiny", lora=lc))
  for m in (plain, stacked):
    nnx.update(m, jax.tree.map(lambda x: x + 0.01, nnx.state(m, nnx.LoRAParam)))
  files = {}
  for name, m in (("plain", plain), ("stacked", stacked)):
    models.save_pretrained(lora.without_adapters(m), str(tmp_path / name / "hf"))
    lora.save_peft(m, str(tmp_path / name / "peft"))
    for kind, file in (("hf", "model.safetensors"), ("peft", lora.ADAPTER_FILE)):
      import safetensors.numpy

      files[name, kind] = safetensors.numpy.load_file(str(tmp_path / name / kind / file))
  for kind in ("hf", "peft"):
    chex.assert_trees_all_close(files["stacked", kind], files["plain", kind], atol=1e-6)
  # A per-layer checkpoint read into either layout, the adapters too.
  hf = str(tmp_path / "plain" / "hf")
  base = models.from_pretrained(hf, scan_layers=True)
  assert base.config.scan_layers and "layers" in _pure(base)
  chex.assert_trees_all_close(_pure(base), _pure(lora.without_adapters(stacked)), atol=1e-6)
  loaded = lora.load_peft(base, str(tmp_path / "plain" / "peft"))
  chex.assert_trees_all_close(
    _pure(loaded, nnx.LoRAParam), _pure(stacked, nnx.LoRAParam), atol=1e-6
  )


def test_stacked_import_into_a_mesh_reads_each_shard(tmp_path):
  plain = models.Decoder(models.get_config("tiny"), rngs=nnx.Rngs(3))
  models.save_pretrained(plain, str(tmp_path))
  mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = [("embed", "fsdp"), ("mlp", "tensor")]
  stacked = models.from_pretrained(str(tmp_path), mesh=mesh, rules=rules, scan_layers=True)
  gate = stacked.layers.mlp.gate_proj[...]
  assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  L, d, f = gate.shape
  assert gate.addressable_shards[0].data.shape == (L, d // 2, f // 4)
  chex.assert_trees_all_close(_pure(stacked), layout.stack(_pure(plain)), atol=0, rtol=0)


def test_tree_conversion_round_trips_optimizer_states_and_names_bad_stacks():
  tree = {"layers": {0: {"w": jnp.ones((2, 3))}, 1: {"w": jnp.zeros((2, 3))}}, "norm": jnp.ones(3)}
  opt = ({"mu": tree, "count": jnp.int32(0)},)
  stacked = layout.stack(opt)
  assert stacked[0]["mu"]["layers"]["w"].shape == (2, 2, 3)
  assert stacked[0]["count"] == 0 and stacked[0]["mu"]["norm"].shape == (3,)
  chex.assert_trees_all_equal(layout.unstack(stacked, 2), opt)
  chex.assert_trees_all_equal(layout.stack(stacked), stacked)  # already stacked: unchanged
  abstract = layout.stack(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree))
  assert abstract["layers"]["w"].shape == (2, 2, 3)
  with pytest.raises(ValueError, match=r"layers\['w'\] has shape \(2, 2, 3\): not stacked over 3"):
    layout.unstack(stacked, 3)
  with pytest.raises(ValueError, match="layers \\[0, 2\\] are not 0..1"):
    layout.stack({"layers": {0: {"w": jnp.ones(1)}, 2: {"w": jnp.ones(1)}}})


def test_a_stacked_run_trains_as_a_per_layer_one_and_resumes_in_either_layout(tmp_path):
  from offpolicy_jax.run import loop, start
  from offpolicy_jax.store import workdir
  from tests.test_loop import small_config, strip_timing

  kw = {"checkpoint_every": 2, "sft.steps": 2}

  def close(got, want):
    for a, b in zip(strip_timing(got), strip_timing(want), strict=True):
      assert a.keys() == b.keys()
      for k in ("loss", "reward_mean", "grad_norm", "eval/accuracy"):
        if k in a:
          assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a["step"])

  plain = loop.train_and_evaluate(small_config(total_steps=4, **kw), str(tmp_path / "plain"))
  first = [r for r in plain if r["step"] <= 2 and "eval/accuracy" not in r]
  later = [r for r in plain if r["step"] > 2]
  for scan, other in ((True, False), (False, True)):
    run = str(tmp_path / f"from_{'stacked' if scan else 'per_layer'}")
    two = loop.train_and_evaluate(small_config(model_scan_layers=scan, total_steps=2, **kw), run)
    close([r for r in two if "eval/accuracy" not in r], first)
    # Resumed in the other layout: the checkpoint's parameters, optimizer moments and lag
    # snapshots (stacked over slots first) are read and converted; the run goes on as the
    # uninterrupted per-layer one.
    again = small_config(model_scan_layers=other, total_steps=4, **kw)
    with pytest.raises(workdir.ConfigChanged, match="model_scan_layers"):
      loop.train_and_evaluate(again, run)  # a changed program field: allowed explicitly only
    resumed = loop.train_and_evaluate(again, run, allow_config_change=True)
    close(resumed, later)
    assert sum("loss" in r for r in resumed) == 2
    assert os.path.exists(os.path.join(run, workdir.HISTORY_FILE))
  # The last workdir holds step 2 per layer and step 4 stacked: with step 4 corrupt, a resume
  # falls back to step 2 and reads it in its own layout.
  params_dir = os.path.join(run, "checkpoints", "4")
  target = max(
    (os.path.join(d, f) for d, _, fs in os.walk(params_dir) for f in fs if "/params/" in d),
    key=os.path.getsize,
  )
  size = os.path.getsize(target)
  with open(target, "r+b") as f:  # same-size garbage
    f.seek(size // 2)
    f.write(b"\xff" * 16)
  redone = loop.train_and_evaluate(again, run)
  close(redone, later)
  assert [r["step"] for r in redone if "loss" in r] == [3, 4]
  # Evaluating a checkpoint reads it in the evaluating model's layout: the last run's step 4
  # (per-layer -> stacked) evaluated per layer gives its own final evaluation.
  got = start.evaluate_checkpoint(small_config(model_scan_layers=False, total_steps=4, **kw), run)
  assert got["step"] == 4
  assert got["eval/accuracy"] == pytest.approx(redone[-1]["eval/accuracy"], abs=1e-6)


def test_weight_decay_and_the_planner_read_stacked_blocks_as_per_layer_ones():
  from configs import default
  from offpolicy_jax.learn import train_state
  from offpolicy_jax.run import planner

  plain, stacked = _pair(models.get_config("tiny"))
  opt = train_state.make_optimizer(0.1, weight_decay=0.5, max_grad_norm=None)
  decayed = []
  for m in (plain, stacked):
    params = nnx.state(m, nnx.Param)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)
    decayed.append(_pure_of(updates))
  # Matrices decay, norms do not, in either layout (a stacked norm is [L, D]).
  chex.assert_trees_all_close(decayed[1], layout.stack(decayed[0]), atol=1e-7)
  assert float(jnp.abs(decayed[1]["layers"]["input_layernorm"]["weight"]).max()) == 0.0
  assert float(jnp.abs(decayed[1]["layers"]["mlp"]["up_proj"]).max()) > 0.0

  def plan(**fields):
    c = default.base_config()
    c.sft.enabled = False
    for k, v in fields.items():
      c[k] = v
    c.lock()
    return planner.plan(c, devices=1, bytes_per_device=None, activations="analytic")

  blocks = sum(x.nbytes for x in jax.tree.leaves(nnx.state(stacked.layers)))
  kv = "KV cache (sampler)"
  per_layer = plan(model_scan_layers=True).bytes[kv]  # the samplers' sliced copy counted
  assert per_layer - plan(model_scan_layers=True, model_scan_decode=True).bytes[kv] == blocks
  assert plan(model_scan_layers=False).bytes[kv] == per_layer - blocks


def _pure_of(state):
  return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


def test_an_unset_layout_is_no_config_change_and_views_spell_out_ellipses():
  from offpolicy_jax.store import workdir

  changes = workdir.config_changes
  assert changes({"model_scan_layers": False}, {"model_scan_layers": None}) == {}
  assert changes({"model_scan_layers": None}, {"model_scan_layers": True}) == {}
  assert changes({"model_scan_layers": True}, {"model_scan_layers": False}) != {}
  views = layout.LayerViews([np.arange(6).reshape(2, 3) + 10 * i for i in range(4)])
  full = np.stack([np.arange(6).reshape(2, 3) + 10 * i for i in range(4)])
  for index in ((...,), (slice(1, 3), ...), (..., 1), (2, ..., slice(0, 2)), (0, 1, ...)):
    np.testing.assert_array_equal(views[index], full[index])
  np.testing.assert_array_equal(np.asarray(views), full)


def test_a_base_fingerprint_is_recognised_in_either_layout():
  """A checkpoint records its LoRA base's fingerprint in its own layout; the same weights
  stored the other way match it (`run.relayout.fingerprint_matches`), other weights do not."""
  from offpolicy_jax.run import relayout

  plain, stacked = _pair(models.get_config("tiny"))
  per_layer, both = nnx.state(plain, nnx.Param), nnx.state(stacked, nnx.Param)
  recorded = models.lora.fingerprint(per_layer)
  assert models.lora.fingerprint(both) != recorded  # the digits depend on the layout
  assert relayout.fingerprint_matches(recorded, both, stacked=True)
  assert relayout.fingerprint_matches(models.lora.fingerprint(both), per_layer, stacked=False)
  other = jax.tree.map(lambda x: x * 1.001, both)
  assert not relayout.fingerprint_matches(recorded, other, stacked=True)
