"""Decode throughput of the jitted KV-cache sampler against its roofline (and `transformers`).

G distinct prompts of P random tokens, K samples each, N new tokens forced (no
EOS), float32, on this machine's default JAX device. Every system runs one
warm-up, then `--rounds` interleaved rounds; the table gives medians. Decode
rate excludes the prefill: (N - 1) * B tokens in t(N new) - t(1 new).

The roofline (`benchmarks/roofline.py`): per decode step, the FLOPs and bytes a
step must at least do (own keys attended: the mean filled length (N + 1) / 2),
the measured matmul peak and memory bandwidth, the fraction of each reached,
and the fraction of the roofline time max(FLOPs / peak, bytes / bandwidth).

  python benchmarks/sampler.py [--preset small] [--prompts 8] [--group 1] \
      [--prompt_len 32] [--new_tokens 64] [--variants xla:0,xla:32,dot_product:32] [--hf]

`--hf` also times `transformers` generate on the same weights (torch in this
environment; `--torch_threads` picks the thread counts).
"""

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roofline  # noqa: E402

from offpolicy_jax import models  # noqa: E402
from offpolicy_jax.sampling import sampler as sampling  # noqa: E402


def _timer(fn):
  def timed():
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

  return timed


def _ours(config, params, prompts, lengths, group, new_tokens, block):
  """{(N or 1): timed call} of our sampler for `config` (same parameters)."""
  graphdef = nnx.split(nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0))))[0]
  out = {}
  for n in (new_tokens, 1):
    fn = sampling.make_sampler(
      graphdef, max_new_tokens=n, group_size=group, eos_id=None, decode_block=block
    )
    call = lambda f=fn: jax.block_until_ready(f(params, prompts, lengths, jax.random.key(0)))
    out[n] = _timer(call)
  return out


def _hf(model, prompts, group, new_tokens, threads):
  """{(N or 1): timed call} of `transformers` generate on the same weights."""
  import torch
  import transformers

  with tempfile.TemporaryDirectory() as path:
    models.save_pretrained(model, path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  hf_model.eval()
  input_ids = torch.tensor(np.repeat(prompts, group, axis=0), dtype=torch.long)

  def generate(n):
    torch.set_num_threads(threads)
    with torch.no_grad():
      hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=True,
        top_p=1.0,
        top_k=0,
        temperature=1.0,
        pad_token_id=0,
      )

  return {n: _timer(lambda n=n: generate(n)) for n in (new_tokens, 1)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--prompts", type=int, default=8, help="G distinct prompts")
  parser.add_argument("--group", type=int, default=1, help="K samples per prompt")
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument(
    "--variants",
    default="xla:0,xla:32",
    help="comma-separated attention:decode_block pairs of our sampler (decode_block 0: the "
    "whole cache at every step)",
  )
  parser.add_argument("--hf", action="store_true", help="also time transformers generate")
  parser.add_argument("--torch_threads", default="1,2", help="thread counts for --hf")
  parser.add_argument("--peak_size", type=int, default=2048)
  args = parser.parse_args()

  base = models.get_config(args.preset, dtype="float32")
  model = models.Decoder(base, rngs=nnx.Rngs(0))
  params = nnx.split(model)[1]
  g, k, p, n = args.prompts, args.group, args.prompt_len, args.new_tokens
  b = g * k
  prompts = np.random.RandomState(0).randint(1, base.vocab_size, (g, p)).astype(np.int32)
  lengths = np.full((g,), p, np.int32)

  systems = {}
  for variant in args.variants.split(","):
    attention, block = variant.split(":")
    config = dataclasses.replace(base, attention=attention)
    systems[f"offpolicy_jax, attention={attention}, decode_block={block}"] = _ours(
      config, params, prompts, lengths, k, n, int(block)
    )
  if args.hf:
    import torch

    for threads in (int(t) for t in args.torch_threads.split(",")):
      name = f"transformers generate (torch {torch.__version__}, {threads} threads)"
      systems[name] = _hf(model, prompts, k, n, threads)

  times = {name: {m: [] for m in (n, 1)} for name in systems}
  for r in range(args.rounds + 1):
    for name, calls in systems.items():
      for m, call in calls.items():
        t = call()
        if r:
          times[name][m].append(t)
  peak = roofline.matmul_peak(args.peak_size)
  bandwidth = roofline.memory_bandwidth()
  cost = roofline.decode_step_cost(base, prompts=g, group_size=k, prompt_len=p, span=(n + 1) / 2)

  print(
    f"preset={args.preset} params={base.num_params() / 1e6:.1f}M prompts={g} group={k} "
    f"prompt_len={p} new_tokens={n} device={jax.devices()[0].platform}; medians of "
    f"{args.rounds} interleaved rounds after a warm-up"
  )
  print("| sampler | total s | new tokens/s (incl. prefill) | decode tokens/s | ms / decode step |")
  print("|---|---|---|---|---|")
  step_s = {}
  for name in systems:
    total, one = (float(np.median(times[name][m])) for m in (n, 1))
    step_s[name] = (total - one) / (n - 1)
    print(
      f"| {name} | {total:.3f} | {b * n / total:,.0f} | {b / step_s[name]:,.0f} | "
      f"{1e3 * step_s[name]:.1f} |"
    )
  bound = cost.bound_s(peak, bandwidth)
  limit = "compute" if cost.flops / peak > cost.bytes / bandwidth else "memory"
  print()
  print(
    f"Roofline per decode step of {b} rows (own keys attended: mean (N + 1) / 2): "
    f"{cost.flops / 1e9:.3f} GFLOP, {cost.bytes / 2**20:.1f} MiB; measured matmul peak "
    f"{peak / 1e9:.1f} GFLOP/s, memory bandwidth {bandwidth / 1e9:.1f} GB/s; bound "
    f"{1e3 * bound:.2f} ms ({limit})"
  )
  print()
  print("| sampler | GFLOP/s (% of peak) | GB/s (% of bandwidth) | fraction of roofline |")
  print("|---|---|---|---|")
  for name, t in step_s.items():
    print(
      f"| {name} | {cost.flops / t / 1e9:.1f} ({cost.flops / t / peak:.0%}) | "
      f"{cost.bytes / t / 1e9:.1f} ({cost.bytes / t / bandwidth:.0%}) | {bound / t:.0%} |"
    )
  f32 = base.kv_bytes_per_token()
  print(
    f"KV cache per token: {f32:,} bytes (float32); this run's cache: "
    f"{(g * p + b * n) * f32 / 2**20:.1f} MiB"
  )


if __name__ == "__main__":
  main()
