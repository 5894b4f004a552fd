"""benchmarks/accelerator.py and benchmarks/compile_time.py at tiny sizes, and the programs'
size: linear in the parameter leaves (train step) and one attention per layer (sampler)."""

import json
import math
import os
import re
import sys

import jax
import pytest
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.models import attention_ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import accelerator  # noqa: E402
import compile_time  # noqa: E402
import decode_layout  # noqa: E402
import gsm8k_path  # noqa: E402

# 64 new tokens and 3 repeats: the decode is timed as (N tokens - 1 token) / (N - 1), which a
# single timing of a 16-token decode on a loaded 2-core machine could leave negative.
TINY = dict(prompts=2, group=2, prompt_len=8, new_tokens=64, micro_batch=2)


def test_accelerator_table_at_tiny_sizes(tmp_path, capsys, monkeypatch):
  out = tmp_path / "acc.json"
  args = ["--presets", "tiny", "--repeats", "3", "--matmul_size", "128", "--json", str(out)]
  for name, value in TINY.items():
    args += [f"--{name}", str(value)]
  # The real-model path after the table, at the table's shapes (run for real in its own test).
  calls = []
  fake = {"preset": "tiny", "steps": 2, "rows_per_step": 4, "run_s": 1.0, "first_step_s": 0.5}
  fake |= {"step_s": 0.2, "reward_failures": 0, "write_checkpoint_s": 0.1, "sampled_ahead": 1}
  fake |= {p.removeprefix("time/"): 0.05 for p in gsm8k_path.PHASES}
  monkeypatch.setattr(gsm8k_path, "run", lambda *a, **kw: (calls.append((a, kw)), fake)[1])
  args += ["--gsm8k_preset", "tiny", "--gsm8k_steps", "2"]
  (row,) = accelerator.main(args)
  assert calls == [(("tiny",), {"steps": 2, "dtype": "bfloat16", **TINY})]
  for name in ("sampler", "scorer", "train"):
    assert row[f"compile_{name}_s"] > 0
  for key in (
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "decode_roofline_fraction",
    "scorer_tokens_per_s",
    "train_tokens_per_s",
    "mfu_measured_matmul",
    "peak_bytes",
    "planned_peak_bytes",
    "planned_activation_bytes",
    "xla_train_temp_bytes",
  ):
    assert math.isfinite(row[key]) and row[key] > 0, key
  # The plan is the planner's own, for the benchmark's model and shapes.
  assert row["planned_peak_bytes"] == row["planned_state_bytes"] + max(
    row["planned_kv_cache_bytes"], row["planned_activation_bytes"]
  )
  params = models.get_config("tiny").num_params()
  assert row["planned_params_bytes"] == 4 * params  # float32
  # Two float32 Adam moments, and the optimizer's scalar counters.
  assert 0 <= row["planned_optimizer_bytes"] - 2 * 4 * params < 64
  assert row["mfu_nominal"] is None  # a CPU is not in the table of chips
  saved = json.loads(out.read_text())
  assert saved["rows"][0]["preset"] == "tiny" and saved["peaks"]["bandwidth_of"] == "measured"
  assert saved["gsm8k"] == fake
  table = capsys.readouterr().out
  assert "| tiny |" in table and "MFU of matmul" in table and "planned GiB" in table


def test_gsm8k_path_runs_the_real_model_path_and_times_its_phases(tmp_path):
  """A preset saved as a HF checkpoint with a trained tokenizer and a chat template, loaded by
  the GSM8K config's own path, scored by the sandboxed math verifier, timed per phase."""
  out = tmp_path / "gsm8k.json"
  result = gsm8k_path.main(
    ["--preset", "tiny", "--steps", "3", "--prompts", "4", "--group", "2"]
    + ["--new_tokens", "8", "--micro_batch", "8", "--json", str(out)]
  )  # 8 rows: the config's FSDP mesh spans the suite's 8 devices
  assert result["steps"] == 3 and result["rows_per_step"] == 8
  assert result["reward_failures"] == 0
  assert result["sampled_ahead"] == 2  # every step after the first (the config's lag allows it)
  assert result["first_step_s"] > result["step_s"] > 0  # the first step compiles
  phases = sum(result[p.removeprefix("time/")] for p in gsm8k_path.PHASES)
  assert phases <= 1.5 * result["step_s"]  # medians of the parts of the later steps
  assert json.loads(out.read_text())["result"]["preset"] == "tiny"
  rows = gsm8k_path.problems(20)
  answers = [r["answer"].split("####")[-1].strip() for r in rows]
  assert all(a.isdigit() for a in answers) and len(set(answers)) > 1


def test_peaks_and_model_flops():
  assert accelerator.nominal("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
  assert accelerator.nominal("TPU v5 lite") == (197e12, 0.82e12)
  assert accelerator.nominal("cpu") is None
  c = models.get_config("tiny")
  # 6 N + 12 L H Q T: the attention term grows with the sequence, the rest does not.
  short, long = (accelerator.train_flops_per_token(c, t) for t in (10, 20))
  assert long - short == 12 * c.num_layers * c.num_heads * c.head_dim * 10


def _hlo(program) -> str:
  return program.compiled.as_text()


def test_programs_stay_small():
  """The train step's select of the kept state is one conditional, not a select per leaf that
  recomputes the all-finite predicate (a term per leaf): the compiled program held about
  leaves^2 is-finite ops, most of a 24-layer step's compile time. The sampler's filled-cache
  attention has at most `MAX_SPANS` branches per layer, however many spans of `decode_block`
  the responses hold (one copy of the attention per branch)."""
  config = models.get_config("tiny", scan_layers=True, remat=True)
  params = nnx.split(nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0))))[1]
  leaves = len(jax.tree.leaves(params))
  progs = compile_time.compile_programs(config, programs=("train",), **TINY)
  assert _hlo(progs["train"]).count("is-finite(") <= 4 * leaves
  dots = {}
  for block in (0, 1, 2):  # 16 and 8 spans asked for
    sampler = compile_time.compile_programs(
      config, programs=("sampler",), decode_block=block, **TINY
    )["sampler"]
    dots[block] = len(re.findall(r"= \S+ dot\(", _hlo(sampler)))
  per_branch = 4 * config.num_layers  # scores and values of the prompt and own keys, per layer
  assert dots[1] == dots[2] == dots[0] + (attention_ops.MAX_SPANS - 1) * per_branch, dots


@pytest.mark.parametrize("program", ["bogus"])
def test_unknown_program_names_the_flag(program):
  with pytest.raises(ValueError, match="--programs: unknown program 'bogus'"):
    compile_time.compile_programs(models.get_config("tiny"), programs=(program,), **TINY)


@pytest.mark.parametrize(
  "script, flags, named",
  [
    ("accelerator", ["--presets", "tiny,nope"], "unknown preset 'nope'"),
    ("accelerator", ["--gsm8k_preset", "nope"], "unknown preset 'nope'"),
    ("accelerator", ["--prompts", "2", "--group", "2", "--micro_batch", "3"], "--micro_batch 3"),
    ("accelerator", ["--matmul_size", "0"], "--matmul_size must be >= 1"),
    ("accelerator", ["--json", "/no/such/dir/a.json"], "--json: no directory"),
    ("gsm8k_path", ["--micro_batch", "0"], "--micro_batch must be >= 1"),
    ("compile_time", ["--prompts", "0"], "--prompts must be >= 1"),
    ("compile_time", ["--scan_layers", "2"], "--scan_layers"),
    ("compile_time", ["--num_layers", "-1"], "--num_layers"),
    ("compile_time", ["--programs", "sampler,bogus"], "--programs: unknown ['bogus']"),
    ("decode_layout", ["--rounds", "0"], "--rounds must be >= 1"),
    ("decode_layout", ["--preset", "nope"], "unknown preset 'nope'"),
  ],
)
def test_benchmark_flags_are_checked_before_any_work(script, flags, named, capsys, monkeypatch):
  module = {
    "accelerator": accelerator,
    "gsm8k_path": gsm8k_path,
    "compile_time": compile_time,
    "decode_layout": decode_layout,
  }
  monkeypatch.setattr(sys, "argv", [f"{script}.py", *flags])  # compile_time parses sys.argv
  with pytest.raises(SystemExit) as e:
    module[script].main(*([flags] if script != "compile_time" else []))
  assert e.value.code == 2
  (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith(f"{script}.py")]
  assert named in line


def test_bf16_decode_reads_weights_cast_once_per_call():
  """Float32 master weights, bfloat16 compute: the casts of the weights to bfloat16 sit outside
  the decode loop (XLA hoists them), so each decode step reads the bfloat16 copy."""
  config = models.get_config("tiny", dtype="bfloat16")
  params = nnx.split(nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0))))[1]
  shapes = {x.shape for x in jax.tree.leaves(params) if x.ndim == 2 and min(x.shape) >= 64}
  txt = _hlo(compile_time.compile_programs(config, programs=("sampler",), **TINY)["sampler"])
  bodies: dict[str, list[str]] = {}
  name = None
  for line in txt.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      name = head.group(1)
      bodies[name] = []
    elif name:
      bodies[name].append(line)

  def reachable(root, seen):
    for line in bodies.get(root, []):
      for callee in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line):
        if callee not in seen:
          seen.add(callee)
          reachable(callee, seen)
    return seen

  def weight_casts(names):
    pattern = re.compile(r"= bf16\[(\d+),(\d+)\]\{[^}]*\} convert\(")
    return [
      line
      for n in names
      for line in bodies.get(n, [])
      if (m := pattern.search(line)) and (int(m.group(1)), int(m.group(2))) in shapes
    ]

  loops = set()
  for root in re.findall(r"body=%?([\w.\-]+)", txt):
    loops |= reachable(root, {root})
  assert weight_casts(set(bodies) - loops), "no weight cast found: the test lost its target"
  assert not weight_casts(loops)


def _size(program) -> int:
  """Instructions of a compiled program (its HLO lines): what its compile time follows."""
  return len(_hlo(program).splitlines())


def test_stacked_programs_do_not_grow_with_depth():
  """Blocks stacked over layers: the train step and the scanned sampler of 16 layers are the
  programs of 4 layers (one block, one leaf per kind of weight), where per-layer blocks add
  instructions with every layer (docs/results/compile_time.md: compile time flat in depth)."""
  sizes = {}
  for layers in (4, 16):
    config = models.get_config(
      "tiny", num_layers=layers, scan_layers=True, scan_decode=True, remat=True
    )
    progs = compile_time.compile_programs(config, programs=("train", "sampler"), **TINY)
    sizes[layers] = {name: _size(p) for name, p in progs.items()}
  for name in ("train", "sampler"):
    assert sizes[16][name] <= 1.05 * sizes[4][name], (name, sizes)
