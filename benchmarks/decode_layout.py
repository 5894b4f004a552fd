"""Decode speed of the sampler by block layout: per layer, stacked (decoded per layer), scanned.

  python benchmarks/decode_layout.py --preset small [--rounds 2] [--repeats 5]

For each round, each layout in turn: `sampling.make_sampler` over G prompts x
K samples of P + N tokens (random weights, temperature 1), compiled once, then
the median seconds of `--repeats` calls. Layouts: per-layer blocks
(`scan_layers=False`), stacked blocks decoded per layer (`layout.for_decoding`,
the default) and stacked blocks with `scan_decode` (one scan per decode step).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.sampling import sampler

LAYOUTS = (
  ("per-layer blocks", dict(scan_layers=False)),
  ("stacked, per-layer decode", dict(scan_layers=True)),
  ("stacked, scan_decode", dict(scan_layers=True, scan_decode=True)),
)


def seconds(preset: str, g: int, k: int, p: int, n: int, repeats: int, **layout) -> float:
  """Median seconds of one sampler call for `preset` in `layout`."""
  import time

  config = models.get_config(preset, **layout)
  graphdef, params = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)))
  fn = sampler.make_sampler(graphdef, max_new_tokens=n, group_size=k, temperature=1.0)
  prompts = jax.random.randint(jax.random.key(1), (g, p), 1, config.vocab_size)
  lengths = jnp.full((g,), p)
  jax.block_until_ready(fn(params, prompts, lengths, jax.random.key(0)))
  times = []
  for r in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, prompts, lengths, jax.random.key(r + 1)))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args(argv)
  for name in ("prompts", "group", "prompt_len", "new_tokens", "repeats", "rounds"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.preset not in models.preset_names():
    parser.error(f"--preset: unknown preset {args.preset!r}")
  g, k, p, n = args.prompts, args.group, args.prompt_len, args.new_tokens
  print("| round | layout | s per call | tokens/s |\n|---|---|---|---|")
  for r in range(args.rounds):
    for name, layout in LAYOUTS:
      s = seconds(args.preset, g, k, p, n, args.repeats, **layout)
      print(f"| {r + 1} | {name} | {s:.2f} | {g * k * n / s:,.0f} |", flush=True)


if __name__ == "__main__":
  main()
