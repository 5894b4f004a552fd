"""Static vs continuous batching on long-tailed response lengths, at equal response-cache rows.

The workload: W prompt groups of K samples, P random prompt tokens, responses
capped at N tokens, and each response's length drawn from a Pareto tail
(most short, a few at the cap):

  L = min(N, ceil(x_m * u^(-1 / alpha))),  u ~ U(0, 1]

imposed through the samplers' per-row `max_lengths` (the tokens are real
samples of a random model; only where a response ends is set, so both
samplers do the same work per response and the measured difference is the
batching). Both hold R = S * K rows of response cache: the static sampler
(`make_sampler`) decodes the W groups in W / S batches of S groups, each
until its longest row ends; the continuous sampler
(`make_continuous_sampler`, S slots) takes all W groups in one call and
refills a row slot as soon as its row has ended (its prompt cache holds up
to Q prompts, printed with the static one's). One warm-up, then `--rounds`
interleaved rounds; medians of the wall time and of the process's CPU time
(all threads: on a machine shared with other jobs, the work done rather than
the share of the cores it got).

  python benchmarks/longtail.py [--preset small] [--groups 128] [--group 1] [--slots 32] \
      [--prompt_len 32] [--new_tokens 128] [--x_m 8] [--alpha 1.0] \
      [--prefill_batch 0] [--prompt_slots 0]
"""

import argparse
import time

import jax
import numpy as np
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.sampling import continuous
from offpolicy_jax.sampling import sampler as sampling


def pareto_lengths(rng, rows: int, cap: int, x_m: float, alpha: float) -> np.ndarray:
  """int32 [rows] lengths min(cap, ceil(x_m * u^(-1/alpha))), u ~ U(0, 1]."""
  u = 1.0 - rng.random(rows)
  return np.minimum(cap, np.ceil(x_m * u ** (-1.0 / alpha))).astype(np.int32)


def continuous_steps(caps: np.ndarray, k: int, rows: int, batch: int, slots: int) -> int:
  """Decode steps of `make_continuous_sampler` on rows of lengths `caps` (its admission rule).

  Each step: free row slots take the next rows in order; when no prefilled row
  is left, the next `batch` prompts are prefilled into free prompt slots (of
  `slots`, a slot freed when its group's K rows have ended); then every live
  row decodes one token.
  """
  g = len(caps) // k
  left = np.zeros(slots, np.int64)  # rows of a prompt slot's group not yet ended
  group_slot = np.zeros(g, np.int64)
  live = np.full(rows, -1)  # output row of each row slot, -1 free
  remaining = np.zeros(rows, np.int64)
  next_row = next_g = steps = 0
  while next_row < len(caps) or (live >= 0).any():
    while (live < 0).any() and next_row < len(caps):
      if next_row == next_g * k:  # nothing prefilled to admit: prefill
        free = np.flatnonzero(left == 0)[: min(batch, g - next_g)]
        if not len(free):
          break
        left[free] = k
        group_slot[next_g : next_g + len(free)] = free
        next_g += len(free)
      for slot in np.flatnonzero(live < 0)[: next_g * k - next_row]:
        live[slot], remaining[slot] = next_row, caps[next_row]
        next_row += 1
    steps += 1
    remaining[live >= 0] -= 1
    for slot in np.flatnonzero((live >= 0) & (remaining == 0)):
      left[group_slot[live[slot] // k]] -= 1
      live[slot] = -1
  return steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--groups", type=int, default=128, help="W prompt groups in all")
  parser.add_argument("--group", type=int, default=1, help="K samples per prompt")
  parser.add_argument("--slots", type=int, default=32, help="S groups in memory at once")
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--x_m", type=float, default=8.0)
  parser.add_argument("--alpha", type=float, default=1.0)
  parser.add_argument("--prefill_batch", type=int, default=0, help="continuous: A (0: S)")
  parser.add_argument("--prompt_slots", type=int, default=0, help="continuous: Q (0: S * K + A)")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()

  config = models.get_config(args.preset, dtype="float32")
  graphdef, params = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)))
  w, k, s, p, n = args.groups, args.group, args.slots, args.prompt_len, args.new_tokens
  if w % s:
    raise ValueError(f"--groups {w} must be a multiple of --slots {s}")
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, config.vocab_size, (w, p)).astype(np.int32)
  lengths = np.full((w,), p, np.int32)
  caps = pareto_lengths(rng, w * k, n, args.x_m, args.alpha)
  group_len = caps.reshape(w, k).max(axis=1)
  tokens = int(caps.sum())

  static = sampling.make_sampler(graphdef, max_new_tokens=n, group_size=k, eos_id=None)
  cont = continuous.make_continuous_sampler(
    graphdef,
    max_new_tokens=n,
    group_size=k,
    slots=s,
    eos_id=None,
    prefill_batch=args.prefill_batch,
    prompt_slots=args.prompt_slots,
  )

  def run_static():
    outs = []
    for lo in range(0, w, s):
      rows = slice(lo * k, (lo + s) * k)
      key = jax.random.key(lo)
      outs.append(static(params, prompts[lo : lo + s], lengths[lo : lo + s], key, caps[rows]))
    return jax.block_until_ready(outs)

  def run_continuous():
    return jax.block_until_ready(cont(params, prompts, lengths, jax.random.key(0), None, caps))

  systems = {"static batch (make_sampler)": run_static, "continuous batching": run_continuous}
  times: dict[str, list[float]] = {name: [] for name in systems}
  cpu: dict[str, list[float]] = {name: [] for name in systems}
  done = {}
  for r in range(args.rounds + 1):
    for name, fn in systems.items():
      t0, c0 = time.perf_counter(), time.process_time()
      done[name] = fn()
      if r:
        times[name].append(time.perf_counter() - t0)
        cpu[name].append(time.process_time() - c0)
  got = int(np.asarray(done["continuous batching"].mask).sum())
  assert got == tokens, (got, tokens)
  assert sum(int(np.asarray(o.mask).sum()) for o in done["static batch (make_sampler)"]) == tokens

  static_steps = sum(int(group_len[lo : lo + s].max()) for lo in range(0, w, s))
  print(
    f"preset={args.preset} params={config.num_params() / 1e6:.1f}M, {w} groups x {k} samples, "
    f"prompt_len={p}, cap N={n}, {s} slots = {s * k} rows of cache for both; lengths "
    f"min(N, ceil({args.x_m:g} u^(-1/{args.alpha:g}))): median {np.median(caps):.0f}, mean "
    f"{caps.mean():.1f}, {np.mean(caps == n):.1%} of rows and {np.mean(group_len == n):.1%} "
    f"of groups at the cap; device={jax.devices()[0].platform}; medians of {args.rounds} "
    "interleaved rounds after a warm-up"
  )
  a = args.prefill_batch or s
  q = args.prompt_slots or s * k + a
  cont_steps = continuous_steps(caps, k, s * k, a, q)
  print(
    f"decode steps: static {static_steps} (each batch runs to its longest row), continuous "
    f"{cont_steps} (>= {int(np.ceil(caps.sum() / (s * k)))}, the sum of row lengths / rows); "
    "cache slots per "
    f"layer: static {s} x {p} prompt + {s * k} x {n} rows = {s * p + s * k * n}, continuous "
    f"{q} x {p} prompt + {s * k} x {n} rows = {q * p + s * k * n} (+ {s * k} x {p} prompts "
    "gathered by row per step)"
  )
  print(
    "| sampler | wall s | response tokens/s | speed-up | CPU s | speed-up in CPU time "
    "| wall ms per decode step |"
  )
  print("|---|---|---|---|---|---|---|")
  steps = {"static batch (make_sampler)": static_steps, "continuous batching": cont_steps}
  base = float(np.median(times["static batch (make_sampler)"]))
  base_cpu = float(np.median(cpu["static batch (make_sampler)"]))
  for name in systems:
    t, c = float(np.median(times[name])), float(np.median(cpu[name]))
    print(
      f"| {name} | {t:.2f} | {tokens / t:,.0f} | {base / t:.2f}x | {c:.1f} | {base_cpu / c:.2f}x "
      f"| {1e3 * t / steps[name]:.1f} |"
    )


if __name__ == "__main__":
  main()
