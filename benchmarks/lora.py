"""Full fine-tuning vs LoRA: train-step time, memory, snapshot bytes, sampler with/without merging.

On one device (CPU here), for the `small` preset by default: for full
fine-tuning and each adapter rank, the median time of the jitted train step on
a G x K batch, the bytes of the trainer's state (base + trained params +
optimizer state), XLA's temporaries of the compiled train step, and the bytes
of one behaviour snapshot (what a lag slot, the reference or a sampler sync
holds). For each rank it also times the sampler two ways: adapters applied in
every projection (`x W + s x A B`, no merged copy) and merging once per
version (`models.lora.merged`, timed separately) then sampling the plain model.

  python benchmarks/lora.py [--preset small] [--ranks 1,8,32] [--prompts 8] [--group 4]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offpolicy_jax import losses, models, types
from offpolicy_jax.learn import step_options, train_state, train_step
from offpolicy_jax.sampling import sampler as sampling


def _time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compilation
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _batch(model, args, key):
  """A scored G x K batch sampled from `model` (random advantages)."""
  graphdef, params = nnx.split(model)
  g, k, p = args.prompts, args.group, args.prompt_len
  vocab = model.config.vocab_size
  prompts = jax.random.randint(key, (g, p), 1, vocab)
  lengths = jnp.full((g,), p, jnp.int32)
  fn = sampling.make_sampler(graphdef, max_new_tokens=args.new_tokens, group_size=k)
  out = fn(params, prompts, lengths, key)
  adv = jax.random.normal(key, (g * k,))
  zeros_bn = jnp.zeros(out.tokens.shape, jnp.int32)
  return types.pack_groups(
    prompts, lengths, out.tokens, out.mask, out.logprobs, zeros_bn, adv, adv, out.kept
  )


def _train_row(model, rank: int, batch, group: int, repeats: int) -> dict:
  if rank:
    graphdef, params, base = nnx.split(model, nnx.LoRAParam, ...)
  else:
    (graphdef, params), base = nnx.split(model), None
  opt = train_state.make_optimizer(1e-4)
  options = step_options.StepOptions(losses.get_spec("grpo"), group_size=group)
  step = train_step.make_train_step(graphdef, opt, "grpo", group_size=group)
  state = train_state.init_train_state(params, opt)
  holder = {"state": state}

  def run():
    holder["state"], metrics = step(holder["state"], batch, jax.random.key(0), base=base)
    return metrics["loss"]

  seconds = _time(run, repeats)
  fn = lambda st, b, key, base: train_step.train_step(graphdef, opt, options, st, b, key, base=base)
  compiled = jax.jit(fn).lower(holder["state"], batch, jax.random.key(0), base).compile()
  stats = compiled.memory_analysis()
  return {
    "step_s": seconds,
    "state_bytes": _bytes((base, holder["state"].params, holder["state"].opt_state)),
    "temp_bytes": int(stats.temp_size_in_bytes) if stats else -1,
    "snapshot_bytes": _bytes(params),
  }


def _sampler_row(model, args, repeats: int) -> dict:
  """Sampler seconds with adapters in every projection vs merged once (merge time apart)."""
  key = jax.random.key(1)
  g, p = args.prompts, args.prompt_len
  prompts = jax.random.randint(key, (g, p), 1, model.config.vocab_size)
  lengths = jnp.full((g,), p, jnp.int32)
  kw = dict(max_new_tokens=args.new_tokens, group_size=args.group)
  graphdef, params = nnx.split(model)
  adapted = sampling.make_sampler(graphdef, **kw)
  row = {"sample_s": _time(lambda: adapted(params, prompts, lengths, key).tokens, repeats)}
  if model.config.lora is not None:
    plain_def, _ = nnx.split(models.lora.without_adapters(model))
    merge = jax.jit(lambda p: models.lora.merged(p, model.config))
    row["merge_s"] = _time(lambda: merge(params), repeats)
    merged_params = merge(params)
    merged = sampling.make_sampler(plain_def, **kw)
    row["merged_sample_s"] = _time(
      lambda: merged(merged_params, prompts, lengths, key).tokens, repeats
    )
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--ranks", default="1,8,32")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  ranks = [0] + [int(r) for r in args.ranks.split(",")]
  plain = models.Decoder(models.get_config(args.preset, dtype="float32"), rngs=nnx.Rngs(0))
  batch = _batch(plain, args, jax.random.key(0))
  print(
    f"{args.preset}: {plain.config.num_params() / 1e6:.1f}M parameters, batch {args.prompts}"
    f" x {args.group}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
    f"{jax.devices()[0].platform}"
  )
  header = (
    "mode",
    "train step s",
    "state MB",
    "step temps MB",
    "snapshot MB",
    "sample s",
    "merge s",
    "merged sample s",
  )
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  mb = lambda b: f"{b / 2**20:.2f}"
  for rank in ranks:
    lc = models.LoraConfig(rank=rank) if rank else None
    model = models.Decoder(models.get_config(args.preset, lora=lc), rngs=nnx.Rngs(0))
    t = _train_row(model, rank, batch, args.group, args.repeats)
    s = _sampler_row(model, args, args.repeats)
    cells = [
      f"LoRA r={rank}" if rank else "full",
      f"{t['step_s']:.3f}",
      mb(t["state_bytes"]),
      mb(t["temp_bytes"]),
      mb(t["snapshot_bytes"]),
      f"{s['sample_s']:.3f}",
      f"{s['merge_s']:.4f}" if "merge_s" in s else "-",
      f"{s['merged_sample_s']:.3f}" if "merged_sample_s" in s else "-",
    ]
    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
