"""Throughput of the engine: train step, MFU, loop overhead, replay cost.

Prints one table:

- train-step tokens/s (prompt + response tokens through forward and backward),
- model-FLOPs utilisation against a matmul peak measured on the same machine
  (``2 n^3`` FLOPs of a jitted ``jnp.dot``),
- the share of wall time spent outside jitted work in a simple
  sample -> replay -> train loop driven from Python,
- the cost of ``replay.add`` and ``replay.sample``,
- the main job's loop (``loop.train_and_evaluate`` on configs/default.py, no
  evaluation or checkpoints): wall time per step against the jitted work per
  step (from the rows' ``time/device_s``), and the XLA compilations counted at
  half way and at the end (equal: nothing recompiles after warm-up).

Model FLOPs per token (PaLM appendix B, Chowdhery et al., arXiv:2204.02311):
``6 * N_matmul + 12 * L * n_heads * head_dim * T`` for the forward and
backward pass, with ``N_matmul`` the matmul parameters (including the output
projection, excluding the embedding lookup) and ``T`` the sequence length.

Usage: ``python benchmarks/loop.py [--preset tiny|small] [--steps 5] [--loop_steps 200]``.
"""

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from offpolicy_jax import models, types  # noqa: E402
from offpolicy_jax.learn import replay, train_state, train_step  # noqa: E402
from offpolicy_jax.run import loop  # noqa: E402
from offpolicy_jax.sampling import sampler as sampling  # noqa: E402
from offpolicy_jax.types import TrainBatch  # noqa: E402

SHAPES = {  # preset: (groups G, group size K, prompt length P, response length N)
  "tiny": (8, 4, 16, 32),
  "small": (4, 4, 32, 64),
}


def matmul_peak(n: int = 1024, repeats: int = 5) -> float:
  """Measured float32 matmul FLOP/s of the default device."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / min(times)


def flops_per_token(config: models.ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward), PaLM's approximation."""
  d, f, n, kv, h = (
    config.hidden_size,
    config.intermediate_size,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
  )
  per_layer = d * n * h * 2 + d * kv * h * 2 + 3 * d * f
  matmul = config.num_layers * per_layer + config.vocab_size * d
  return 6 * matmul + 12 * config.num_layers * n * h * seq_len


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def _batch(out: sampling.SampleOutput, prompts, lengths, k, version, rewards) -> TrainBatch:
  r = rewards.reshape(-1, k)
  adv = (r - r.mean(1, keepdims=True)).reshape(-1)
  versions = jnp.full(out.tokens.shape, version, jnp.int32)
  return types.pack_groups(
    prompts, lengths, out.tokens, out.mask, out.logprobs, versions, rewards, adv, out.kept
  )


_make_batch = jax.jit(_batch, static_argnums=(3,))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(SHAPES))
  parser.add_argument("--loop_steps", type=int, default=200, help="main-job steps (0: skip)")
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  g, k, p, n = SHAPES[args.preset]
  config = models.get_config(args.preset, dtype=jnp.float32, param_dtype=jnp.float32)
  graphdef, params = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)))
  optimizer = train_state.make_optimizer(1e-4)
  step_fn = train_step.make_train_step(graphdef, optimizer, "rec_oneside_nois")
  sampler = sampling.make_sampler(graphdef, max_new_tokens=n, group_size=k)
  state = train_state.init_train_state(params, optimizer)

  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, config.vocab_size, (g, p)), jnp.int32)
  lengths = jnp.full((g,), p, jnp.int32)
  key = jax.random.key(0)
  out = sampler(state.params, prompts, lengths, key)
  rewards = jnp.asarray(rng.uniform(size=g * k), jnp.float32)
  batch = _make_batch(out, prompts, lengths, k, 0, rewards)
  buf = replay.init(4 * g, batch, k)
  buf = replay.add(buf, batch)
  buf, batch, _ = replay.sample(buf, key, g, "fifo", max_reuse=1)

  # Train step alone (warm-up compiles).
  (state, _), _ = _timed(step_fn, state, batch, key)
  times = []
  for _ in range(args.steps):
    (state, _), dt = _timed(step_fn, state, batch, key)
    times.append(dt)
  t_step = float(np.median(times))
  tokens = g * k * (p + n)
  peak = matmul_peak()
  model_flops = flops_per_token(config, p + n) * tokens

  # Sample -> replay -> train loop driven from Python.
  jit_time = 0.0
  for t in range(args.steps + 1):  # iteration 0 warms up (compiles) and is not timed
    if t == 1:
      jit_time, t0 = 0.0, time.perf_counter()
    key_t = jax.random.fold_in(key, t)
    out, dt1 = _timed(sampler, state.params, prompts, lengths, key_t)
    rewards = (out.tokens[:, 0] % 2).astype(jnp.float32)  # a synthetic on-device reward
    b, dt2 = _timed(_make_batch, out, prompts, lengths, k, jnp.int32(t), rewards)
    buf, dt3 = _timed(replay.add, buf, b)
    (buf, b, _), dt4 = _timed(replay.sample, buf, key_t, g, "fifo", 1, jnp.int32(t))
    (state, metrics), dt5 = _timed(step_fn, state, b, key_t)
    float(metrics["loss"])  # what a logger would fetch
    jit_time += dt1 + dt2 + dt3 + dt4 + dt5
  wall = time.perf_counter() - t0

  # Replay cost on a larger buffer.
  big = replay.init(256, batch, k)
  big, _ = _timed(replay.add, big, batch)
  (big, _, _), _ = _timed(replay.sample, big, key, g, "uniform", None)
  adds, samples = [], []
  for i in range(20):
    big, dt = _timed(replay.add, big, batch)
    adds.append(dt)
    (big, _, _), dt = _timed(replay.sample, big, jax.random.fold_in(key, i), g, "uniform", None)
    samples.append(dt)

  job = main_job_loop(args.loop_steps) if args.loop_steps else []
  rows = [
    ("preset / params", f"{args.preset} / {config.num_params() / 1e6:.2f}M"),
    ("batch (G*K x (P+N))", f"{g}*{k} x ({p}+{n}) = {tokens} tokens"),
    ("devices", f"{jax.device_count()} x {jax.devices()[0].platform}"),
    ("train step time", f"{t_step * 1e3:.1f} ms"),
    ("train step tokens/s", f"{tokens / t_step:,.0f}"),
    ("matmul peak (f32)", f"{peak / 1e9:.1f} GFLOP/s"),
    ("model FLOPs / step", f"{model_flops / 1e9:.2f} GFLOP"),
    ("MFU", f"{model_flops / t_step / peak:.1%}"),
    ("loop wall time / step", f"{wall / args.steps * 1e3:.1f} ms"),
    ("share outside jitted work", f"{1 - jit_time / wall:.1%}"),
    ("replay.add (256 groups)", f"{np.median(adds) * 1e3:.2f} ms"),
    ("replay.sample (256 groups)", f"{np.median(samples) * 1e3:.2f} ms"),
    *job,
  ]
  width = max(len(r[0]) for r in rows)
  print(f"| {'metric':<{width}} | value |")
  print(f"|{'-' * (width + 2)}|-------|")
  for name, value in rows:
    print(f"| {name:<{width}} | {value} |")


def main_job_loop(steps: int) -> list[tuple[str, str]]:
  """Loop wall time vs jitted work per step, and compile counts, on the main job."""
  c = default.base_config()
  c.total_steps, c.eval_every, c.eval_prompts, c.checkpoint_every = steps, 0, 0, 0
  c.progress = c.tensorboard = False
  c.lock()
  with tempfile.TemporaryDirectory() as workdir:
    rows = [r for r in loop.train_and_evaluate(c, workdir) if "loss" in r]
  warm = [r for r in rows if r["step"] > c.log_every]  # the first chunk compiles
  wall = float(np.mean([r["step_time_s"] for r in warm]))
  device = float(np.mean([r["time/device_s"] for r in warm]))
  half = next(r["compiles"] for r in rows if r["step"] >= steps // 2)
  return [
    (f"main job: loop wall time / step ({steps} steps)", f"{wall * 1e3:.2f} ms"),
    ("main job: jitted work / step", f"{device * 1e3:.2f} ms"),
    ("main job: loop overhead", f"{wall / device - 1:.1%}"),
    ("main job: compiles at half way / end", f"{half} / {rows[-1]['compiles']}"),
  ]


if __name__ == "__main__":
  main()
