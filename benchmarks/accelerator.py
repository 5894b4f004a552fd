"""One table per chip: compile seconds, decode and train throughput, MFU, roofline, peak memory.

For each preset, on whatever device JAX sees (random-init weights, nothing
downloaded):

  compile   seconds to lower and compile the sampler, the scorer and the train
            step from abstract shapes (`compile_time.py`)
  sampler   G prompts x K samples, P prompt + N new tokens forced (no EOS):
            prefill seconds, decode tokens/s, and the fraction of the decode
            roofline (`roofline.decode_step_cost` over the chip's bandwidth)
  train     GRPO on G * K rows of P + N tokens, micro-batches of `--micro_batch`
            rows, shared prefix: tokens/s and MFU, the model FLOPs of PaLM's
            appendix B (6 N + 12 L H Q T per trained token, Chowdhery et al.,
            arXiv:2204.02311) over the chip's nominal bf16 peak (`NOMINAL`) and
            over a matmul measured here
  memory    the device's peak bytes in use (the process's peak RSS on CPU), beside
            the memory planner's estimate for the same run on one device
            (`run.planner.plan`, analytic activations: what `experiments.plan`
            prints before a run) and XLA's temporaries of the compiled train step

  python benchmarks/accelerator.py --presets qwen2.5-0.5b,qwen2.5-1.5b [--json out.json] \\
      [--gsm8k_preset qwen2.5-0.5b --gsm8k_steps 20]   # then the real-model path, timed
  python benchmarks/accelerator.py --presets small --prompts 2 --group 2 --prompt_len 16 \\
      --new_tokens 16 --micro_batch 4          # reduced sizes, CPU

Nominal peaks: the vendors' dense bf16 matmul rate and HBM bandwidth per chip;
on a device not in the table (a CPU), the measured matmul and bandwidth stand in.
"""

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_time  # noqa: E402
import flags  # noqa: E402
import gsm8k_path  # noqa: E402
import roofline  # noqa: E402

from offpolicy_jax import config_schema, models  # noqa: E402
from offpolicy_jax.learn import train_state  # noqa: E402
from offpolicy_jax.run import planner  # noqa: E402
from offpolicy_jax.sampling import sampler as sampling  # noqa: E402
from offpolicy_jax.step import run_state  # noqa: E402

# device_kind substring -> (dense bf16 FLOP/s, HBM bytes/s), per chip, from the vendors' sheets.
NOMINAL = {
  "H200": (989e12, 4.8e12),
  "H100": (989e12, 3.35e12),
  "A100": (312e12, 2.0e12),
  "TPU v4": (275e12, 1.2e12),
  "TPU v5 lite": (197e12, 0.82e12),
  "TPU v5e": (197e12, 0.82e12),
  "TPU v5p": (459e12, 2.76e12),
  "TPU v5": (459e12, 2.76e12),
  "TPU v6 lite": (918e12, 1.64e12),
  "TPU v6e": (918e12, 1.64e12),
}


@dataclasses.dataclass(frozen=True)
class Shapes:
  prompts: int
  group: int
  prompt_len: int
  new_tokens: int
  micro_batch: int


def nominal(device_kind: str) -> tuple[float, float] | None:
  """(peak bf16 FLOP/s, HBM bytes/s) of a chip named `device_kind`, or None."""
  for name, peaks in NOMINAL.items():
    if name.lower() in device_kind.lower():
      return peaks
  return None


def train_flops_per_token(config: models.ModelConfig, seq_len: int) -> float:
  """PaLM appendix B: 6 N (N the non-embedding parameters and the output layer) + 12 L H Q T."""
  c = config
  n = roofline.matmul_params(c)
  return 6 * n + 12 * c.num_layers * c.num_heads * c.head_dim * seq_len


def _median_s(fn, repeats: int) -> float:
  return roofline.median_time(fn, repeats=repeats)


def _peak_bytes() -> tuple[int, str]:
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"


def planned(config: models.ModelConfig, s: Shapes) -> dict:
  """The memory planner's per-device bytes for this benchmark's run on one device.

  The same model (its config.json, so the planner sees the real vocabulary),
  shapes, compute dtype, scan and remat, and loss; on-policy with one batch of replay, so the
  planner counts no lag snapshots, as the benchmark holds none.
  """
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
      json.dump(models.config_to_hf(config, "float32"), f)
    c = config_schema.config_dict()
    c.model, c.model_dtype, c.model_scan_layers = path, config.dtype, config.scan_layers
    c.model_remat = config.remat
    c.prompts_per_step, c.group_size = s.prompts, s.group
    c.max_prompt_len, c.max_new_tokens = s.prompt_len, s.new_tokens
    c.train.micro_batch_size = s.micro_batch
    c.loss.name = "grpo"
    c.lag.sync_interval, c.lag.sync_offset = 1, 0
    c.replay.capacity_batches = 1
    plan = planner.plan(c, devices=1, bytes_per_device=None, activations="analytic")
  return {
    "planned_peak_bytes": plan.peak_bytes,
    "planned_state_bytes": plan.state_bytes,
    "planned_params_bytes": plan.bytes["params"],
    "planned_optimizer_bytes": plan.bytes["optimizer state"],
    "planned_kv_cache_bytes": plan.bytes["KV cache (sampler)"],
    "planned_activation_bytes": plan.bytes["activations (train step)"],
  }


def _xla_temp_bytes(program: compile_time.Program) -> int | None:
  """XLA's temporaries of a compiled program (None where the backend does not say)."""
  stats = program.compiled.memory_analysis()
  return None if stats is None else int(stats.temp_size_in_bytes)


def _inputs(config, s: Shapes):
  """Random prompts [G, P], their lengths, and a GRPO batch of G * K rows (all tokens real)."""
  g, k, p, n = s.prompts, s.group, s.prompt_len, s.new_tokens
  rng = np.random.RandomState(0)
  prompts = jnp.asarray(rng.randint(1, config.vocab_size, (g, p)), jnp.int32)
  b = g * k
  batch = run_state.empty_batch(run_state.Sizes(g, k, p, n))._replace(
    prompt_tokens=jnp.repeat(prompts, k, axis=0),
    prompt_mask=jnp.ones((b, p)),
    tokens=jnp.asarray(rng.randint(1, config.vocab_size, (b, n)), jnp.int32),
    mask=jnp.ones((b, n)),
    advantages=jnp.asarray(rng.randn(b), jnp.float32),
    weights=jnp.ones((b,)),
  )
  return prompts, jnp.full((g,), p, jnp.int32), batch


def sampler_numbers(config, graphdef, params, progs, s: Shapes, repeats, bandwidth) -> dict:
  """Prefill and decode rates of the compiled sampler; the scorer's rate on its output."""
  g, k, p, n = s.prompts, s.group, s.prompt_len, s.new_tokens
  prompts, lengths, _ = _inputs(config, s)
  key = jax.random.key(0)
  one = sampling.make_sampler(graphdef, max_new_tokens=1, group_size=k, eos_id=None)
  t_one = _median_s(lambda: one(params, prompts, lengths, key), repeats)
  t_all = _median_s(lambda: progs["sampler"].compiled(params, prompts, lengths, key), repeats)
  # None when the decode is too short to time against the one-token call (raise N or repeats).
  step_s = (t_all - t_one) / max(n - 1, 1) if t_all > t_one else None
  cost = roofline.decode_step_cost(config, prompts=g, group_size=k, prompt_len=p, span=(n + 1) / 2)
  out = progs["sampler"].compiled(params, prompts, lengths, key)
  t_score = _median_s(lambda: progs["scorer"].compiled(params, prompts, lengths, out), repeats)
  return {
    "prefill_s": t_one,
    "prefill_tokens_per_s": g * p / t_one,
    "decode_tokens_per_s": g * k / step_s if step_s else None,
    "decode_step_ms": 1e3 * step_s if step_s else None,
    "decode_bytes_per_step": cost.bytes,
    "decode_roofline_fraction": cost.bytes / bandwidth / step_s if step_s else None,
    "scorer_tokens_per_s": g * k * (p + n) / t_score,
  }


def train_numbers(config, params, progs, s: Shapes, repeats: int, peaks: dict) -> dict:
  """Rate and MFU of the compiled train step (its state is donated: each call takes the last)."""
  _, _, batch = _inputs(config, s)
  optimizer = train_state.make_optimizer(1e-6)
  state = train_state.TrainState(
    params, optimizer.init(params), jnp.int32(0), jnp.int32(0), jnp.int32(0)
  )
  holder = [state]

  def step():
    holder[0] = progs["train"].compiled(holder[0], batch, jax.random.key(0))[0]
    return holder[0]

  t = _median_s(step, repeats)
  tokens = s.prompts * s.group * (s.prompt_len + s.new_tokens)
  flops = tokens * train_flops_per_token(config, s.prompt_len + s.new_tokens)
  return {
    "train_step_s": t,
    "train_tokens_per_s": tokens / t,
    "train_tflops_per_s": flops / t / 1e12,
    "mfu_nominal": flops / t / peaks["nominal_flops"] if peaks["nominal_flops"] else None,
    "mfu_measured_matmul": flops / t / peaks["matmul_flops"],
  }


def run_preset(preset: str, s: Shapes, *, dtype: str, repeats: int, peaks: dict) -> dict:
  """One row of the table: `preset` at shapes `s` (parameters float32, compute `dtype`)."""
  config = models.get_config(preset, dtype=dtype, scan_layers=True, remat=True)
  row: dict = {
    "preset": preset,
    "params_m": config.num_params() / 1e6,
    "active_params_m": config.num_active_params() / 1e6,  # with experts: k of E per block
    **dataclasses.asdict(s),
  }
  progs = compile_time.compile_programs(
    config,
    prompts=s.prompts,
    group=s.group,
    prompt_len=s.prompt_len,
    new_tokens=s.new_tokens,
    micro_batch=s.micro_batch,
  )
  row |= {f"compile_{name}_s": prog.seconds["total_s"] for name, prog in progs.items()}
  row |= planned(config, s)
  row["xla_train_temp_bytes"] = _xla_temp_bytes(progs["train"])
  graphdef, params = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)))
  row |= sampler_numbers(config, graphdef, params, progs, s, repeats, peaks["bandwidth"])
  # The train step donates its state: the sampler's parameters go with it.
  row |= train_numbers(config, params, progs, s, repeats, peaks)
  row["peak_bytes"], row["peak_bytes_of"] = _peak_bytes()
  return row


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], peaks: dict) -> None:
  print(
    f"device: {peaks['device_kind']} ({jax.default_backend()}), jax {jax.__version__}; "
    f"peak {_fmt(peaks['nominal_flops'] and peaks['nominal_flops'] / 1e12, 'g')} TFLOP/s nominal, "
    f"{peaks['matmul_flops'] / 1e12:.2f} measured matmul; bandwidth "
    f"{peaks['bandwidth'] / 1e9:.0f} GB/s ({peaks['bandwidth_of']})"
  )
  print(
    "| preset | compile sampler / scorer / train s | prefill tok/s | decode tok/s | "
    "decode roofline | scorer tok/s | train tok/s | MFU nominal | MFU of matmul | peak GiB | "
    "planned GiB |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['preset']} | {r['compile_sampler_s']:.1f} / {r['compile_scorer_s']:.1f} / "
      f"{r['compile_train_s']:.1f} | {r['prefill_tokens_per_s']:,.0f} | "
      f"{_fmt(r['decode_tokens_per_s'], ',.0f')} | {_fmt(r['decode_roofline_fraction'], '.0%')} | "
      f"{r['scorer_tokens_per_s']:,.0f} | "
      f"{r['train_tokens_per_s']:,.0f} | {_fmt(r['mfu_nominal'], '.1%')} | "
      f"{r['mfu_measured_matmul']:.1%} | {r['peak_bytes'] / 2**30:.3g} ({r['peak_bytes_of']}) | "
      f"{r['planned_peak_bytes'] / 2**30:.3g} |"
    )


def measure_peaks(matmul_size: int, dtype: str) -> dict:
  kind = jax.devices()[0].device_kind
  table = nominal(kind)
  # One product per call under-read an H200 by 4x (dispatch): a chain of them on a GPU or TPU.
  matmul = roofline.matmul_peak(matmul_size, 5, jnp.dtype(dtype))
  bandwidth, of = (table[1], "nominal") if table else (roofline.memory_bandwidth(), "measured")
  return {
    "device_kind": kind,
    "nominal_flops": table[0] if table else None,
    "matmul_flops": matmul,
    "bandwidth": bandwidth,
    "bandwidth_of": of,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b")
  parser.add_argument(
    "--dtype",
    default="bfloat16",
    choices=gsm8k_path.DTYPES,
    help="compute dtype (parameters float32)",
  )
  parser.add_argument("--prompts", type=int, default=16, help="G")
  parser.add_argument("--group", type=int, default=8, help="K")
  parser.add_argument("--prompt_len", type=int, default=256, help="P")
  parser.add_argument("--new_tokens", type=int, default=512, help="N")
  parser.add_argument("--micro_batch", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--matmul_size", type=int, default=4096)
  parser.add_argument("--json", default="", help="also write the rows here")
  parser.add_argument(
    "--gsm8k_preset", default="", help="then the GSM8K config on this preset (gsm8k_path.py)"
  )
  parser.add_argument("--gsm8k_steps", type=int, default=20)
  args = parser.parse_args(argv)
  presets = tuple(args.presets.split(",")) + ((args.gsm8k_preset,) if args.gsm8k_preset else ())
  gsm8k_path.check_args(parser, args, args.gsm8k_steps if args.gsm8k_preset else 1, presets)
  flags.check(parser, args, positive=("repeats", "matmul_size"))
  shapes = Shapes(args.prompts, args.group, args.prompt_len, args.new_tokens, args.micro_batch)
  peaks = measure_peaks(args.matmul_size, args.dtype)
  rows = []
  for preset in args.presets.split(","):
    rows.append(run_preset(preset, shapes, dtype=args.dtype, repeats=args.repeats, peaks=peaks))
    print(json.dumps(rows[-1]), flush=True)
  print_table(rows, peaks)

  def save(gsm8k):
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"args": vars(args), "peaks": peaks, "rows": rows, "gsm8k": gsm8k}, f, indent=1)

  save(None)  # the table is kept whatever happens after it
  if args.gsm8k_preset:  # the shapes of the table, on the real-model path
    save(gsm8k_path.run_and_print(args.gsm8k_preset, args.gsm8k_steps, args))
  return rows


if __name__ == "__main__":
  main()
