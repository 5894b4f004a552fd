"""Decode throughput of the jitted KV-cache sampler vs `transformers` generate.

Both run the same weights (a random "small" preset exported with
`models.save_pretrained` and reloaded by `transformers`), the same batch,
prompt length and number of new tokens, on CPU, in one process. Prints a table
of new tokens/s with and without the prefill (decode rate = (N - 1) * B /
(t(N new tokens) - t(1 new token))) and the KV-cache size.

  python benchmarks/sampler.py [--preset small] [--batch 8] [--prompt_len 32] [--new_tokens 64]
"""

import argparse
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.sampling import sampler as sampling


def _time(fn, repeats):
  fn()  # Warm-up (compilation for the JAX sampler).
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument(
    "--torch_threads",
    default="1,0",
    help="comma-separated torch thread counts to time (0: torch default); the fastest is the "
    "baseline",
  )
  args = parser.parse_args()

  import torch
  import transformers

  default_threads = torch.get_num_threads()
  config = models.get_config(args.preset, dtype="float32")
  model = models.Decoder(config, rngs=nnx.Rngs(0))
  b, p, n = args.batch, args.prompt_len, args.new_tokens
  rng = np.random.RandomState(0)
  prompts = rng.randint(1, config.vocab_size, (b, p)).astype(np.int32)
  lengths = np.full((b,), p, np.int32)

  # transformers is timed first, before the sampler is compiled.
  with tempfile.TemporaryDirectory() as path:
    models.save_pretrained(model, path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  hf_model.eval()
  input_ids = torch.tensor(prompts, dtype=torch.long)
  attention_mask = torch.ones_like(input_ids)

  def hf_generate(new_tokens):
    with torch.no_grad():
      out = hf_model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        top_p=1.0,
        top_k=0,
        temperature=1.0,
        pad_token_id=0,
      )
    assert out.shape == (b, p + new_tokens)

  hf_times = {}
  for threads in [int(t) for t in args.torch_threads.split(",")]:
    torch.set_num_threads(threads or default_threads)
    hf_times[threads or default_threads] = (
      _time(lambda: hf_generate(n), args.repeats),
      _time(lambda: hf_generate(1), args.repeats),
    )

  graphdef, params = nnx.split(model)
  ours = []
  for new_tokens in (n, 1):
    sampler = sampling.make_sampler(
      graphdef,
      max_new_tokens=new_tokens,
      group_size=1,
      temperature=1.0,
      top_p=1.0,
      top_k=0,
      eos_id=None,
    )
    run = lambda f=sampler: jax.block_until_ready(f(params, prompts, lengths, jax.random.key(0)))
    ours.append(_time(run, args.repeats))

  # Decode rate excludes the prefill: (N - 1) * B tokens in t(N new) - t(1 new).
  rows = [("offpolicy_jax make_sampler (jit, KV cache)", *ours)]
  rows += [
    (f"transformers generate (torch {torch.__version__}, {k} threads)", *v)
    for k, v in hf_times.items()
  ]
  best_total = min(v[0] for v in hf_times.values())
  best_decode = min(v[0] - v[1] for v in hf_times.values())
  print(
    f"preset={args.preset} params={config.num_params() / 1e6:.1f}M batch={b} "
    f"prompt_len={p} new_tokens={n} device={jax.devices()[0].platform}; "
    "speed-ups are vs the fastest transformers setting"
  )
  print("| sampler | total s | new tokens/s (incl. prefill) | decode tokens/s | decode speed-up |")
  print("|---|---|---|---|---|")
  for name, total, one in rows:
    decode = total - one
    print(
      f"| {name} | {total:.3f} | {b * n / total:,.0f} | {b * (n - 1) / decode:,.0f} | "
      f"{best_decode / decode:.2f}x |"
    )
  print(f"end-to-end speed-up: {best_total / ours[0]:.2f}x")
  f32 = config.kv_bytes_per_token()
  bf16 = models.get_config(args.preset, dtype="bfloat16").kv_bytes_per_token()
  print(
    f"KV cache per token: {f32:,} bytes (float32), {bf16:,} bytes (bfloat16); "
    f"this run's cache [B={b}, S={p + n}]: {b * (p + n) * f32 / 2**20:.1f} MiB"
  )


if __name__ == "__main__":
  main()
