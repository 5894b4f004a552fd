"""Export of a run's checkpoint (run.export, experiments/export.py), on a tiny LoRA run."""

import json
import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import errors, models  # noqa: E402
from offpolicy_jax.models import lora, tokenizers  # noqa: E402
from offpolicy_jax.run import components, export, loop  # noqa: E402
from offpolicy_jax.store import checkpointing  # noqa: E402
from tests.test_loop import small_config  # noqa: E402

_RUN = {
  "total_steps": 2,
  "checkpoint_every": 2,
  "eval_prompts": 0,
  "prompts_per_step": 4,
  "lora.rank": 2,
  "lora.alpha": 4.0,
  "lora.dropout": 0.2,
  "train.num_micro_batches": 2,
  "optimizer.learning_rate": 3e-2,
  "task_kwargs.partial_credit": True,
}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("lora_run"))
  rows = loop.train_and_evaluate(small_config(**_RUN), workdir)
  return workdir, rows


@pytest.fixture(scope="module")
def exported(lora_run, tmp_path_factory):
  """The run exported both ways: `(the PEFT export's result, the merged directory)`."""
  workdir, _ = lora_run
  root = tmp_path_factory.mktemp("exported")
  got = export.export_checkpoint(workdir, str(root / "adapter"), fmt="peft")
  merged_dir = str(root / "merged")
  export.export_checkpoint(workdir, merged_dir, fmt="merged")
  return got, merged_dir


def test_a_run_with_adapter_dropout_trains(lora_run):
  _, rows = lora_run
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert all(r["grad_norm"] > 0 and r["skipped"] == 0 for r in rows)


def _ours(workdir):
  """The run's trained model (base + adapter at the latest checkpoint), as export rebuilds it."""
  config = export.recorded_config(workdir)
  assert config.lora.dropout == 0.2
  comps = components.build_components(config)
  base, params, _ = export._restore(workdir, comps, None)
  return nnx.merge(comps.fns.model.graphdef, lora.join(base, params))


def test_peft_and_merged_exports_give_our_logits(lora_run, exported):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  workdir, _ = lora_run
  got, merged_dir = exported
  adapter_dir = got["out"]
  assert got["step"] == 2 and got["base"] == os.path.join(adapter_dir, export.BASE_DIR)
  with open(os.path.join(adapter_dir, lora.CONFIG_FILE)) as f:
    adapter_config = json.load(f)
  assert (adapter_config["r"], adapter_config["lora_dropout"]) == (2, 0.2)

  model = _ours(workdir)
  assert any(float(jnp.abs(b).max()) > 0 for b in _b_matrices(model))  # the adapter trained
  tokens = np.array([[3, 5, 7, 9, 11, 2], [4, 4, 8, 1, 0, 6]])
  ours = np.asarray(model(jnp.asarray(tokens)))
  with torch.no_grad():
    base = transformers.AutoModelForCausalLM.from_pretrained(got["base"]).eval()
    theirs = peft.PeftModel.from_pretrained(base, adapter_dir).eval()(torch.as_tensor(tokens))
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    theirs_merged = merged(torch.as_tensor(tokens)).logits.float().numpy()
  np.testing.assert_allclose(ours, theirs.logits.float().numpy(), atol=1e-5, rtol=0)
  np.testing.assert_allclose(ours, theirs_merged, atol=1e-5, rtol=0)
  # Our own import of the adapter onto the exported base gives the same model.
  back = lora.load_peft(models.from_pretrained(got["base"]), adapter_dir)
  np.testing.assert_allclose(np.asarray(back(jnp.asarray(tokens))), ours, atol=1e-5, rtol=0)


def test_exports_load_with_the_auto_classes_and_generate_stops_at_eos(exported):
  """What a user does first with an export: the Auto classes, then `generate()`, nothing set."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  got, merged_dir = exported
  ref = tokenizers.CharTokenizer()
  text = "12 + 34 = ?\nab  c"
  for d in (merged_dir, got["out"], got["base"]):
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text) and tok.decode(ids) == text, (d, type(tok))
    assert len(tok) == ref.vocab_size, d  # no id beyond the vocabulary
    specials = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    assert specials == (ref.bos_id, ref.eos_id, ref.pad_id, None), d
  for d in (merged_dir, got["base"]):
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    stops = (model.generation_config.eos_token_id, model.generation_config.pad_token_id)
    assert stops == (ref.eos_id, ref.pad_id), d
  # A head that always prefers EOS: generation ends after one token.
  vocab = model.config.vocab_size
  model.lm_head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
  with torch.no_grad():
    model.lm_head.weight.zero_()
    model.lm_head.bias.copy_(torch.nn.functional.one_hot(torch.tensor(ref.eos_id), vocab))
    prompt = tok("12+34=", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8)
  n = prompt["input_ids"].shape[1]
  assert out[0, n:].tolist() == [ref.eos_id]
  assert tok.decode(out[0], skip_special_tokens=True) == "12+34="


def _b_matrices(model):
  return [v for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)) if p[-1] == "lora_b"]


def test_errors_name_what_is_wrong(lora_run, tmp_path):
  workdir, _ = lora_run
  with pytest.raises(errors.WorkdirError, match="not a run directory"):
    export.export_checkpoint(str(tmp_path), str(tmp_path / "out"))
  with pytest.raises(errors.UserError, match="format must be one of"):
    export.export_checkpoint(workdir, str(tmp_path / "out"), fmt="gguf")
  empty = tmp_path / "empty"
  empty.mkdir()
  shutil.copy(os.path.join(workdir, "config.json"), empty)
  with pytest.raises(FileNotFoundError, match="nothing to export"):
    export.export_checkpoint(str(empty), str(tmp_path / "out"))
  config = json.loads((empty / "config.json").read_text())
  config["lora"]["rank"], config["lora"]["dropout"] = 0, 0.0
  (empty / "config.json").write_text(json.dumps(config))
  with pytest.raises(errors.UserError, match="no adapters") as refused:
    export.export_checkpoint(str(empty), str(tmp_path / "out"), fmt="peft")
  assert "--merged" in refused.value.line()
  busy = tmp_path / "busy"
  busy.mkdir()
  (busy / "notes.txt").write_text("mine")
  with pytest.raises(errors.UserError, match="--out .*busy is not empty") as refused:
    export.export_checkpoint(workdir, str(busy), fmt="merged")
  assert "choose an empty or new folder" in refused.value.line()
  assert os.listdir(busy) == ["notes.txt"]

  corrupt = str(tmp_path / "corrupt")
  shutil.copytree(workdir, corrupt)
  params_dir = os.path.join(corrupt, "checkpoints", "2", "params")
  victim = next(
    os.path.join(d, f) for d, _, fs in os.walk(params_dir) for f in fs if not f.startswith("_")
  )
  with open(victim, "r+b") as f:
    f.write(b"\xff\xff\xff\xff")
  with pytest.raises(checkpointing.CheckpointError, match="cannot export.*corrupt"):
    export.export_checkpoint(corrupt, str(tmp_path / "out"))
  # A corrupt meta is found before the model is built, with the same advice.
  shutil.rmtree(corrupt)
  shutil.copytree(workdir, corrupt)
  meta_dir = os.path.join(corrupt, "checkpoints", "2", "meta")
  victim = next(os.path.join(d, f) for d, _, fs in os.walk(meta_dir) for f in fs)
  with open(victim, "r+b") as f:
    f.write(b"\xff\xff\xff\xff")
  with pytest.raises(checkpointing.CheckpointError, match="cannot export.*corrupt.*--step"):
    export.export_checkpoint(corrupt, str(tmp_path / "out"))
