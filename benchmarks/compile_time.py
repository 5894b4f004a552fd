"""Compile seconds of the sampler, the scorer and the train step, lowered from abstract shapes.

Nothing is allocated: the parameters, the optimizer state and the batch are
`jax.ShapeDtypeStruct`s (`jax.eval_shape`), so a 24-layer preset's programs
compile on a laptop CPU as they would before a run on an accelerator. Each
program is built as the run builds it (`sampling.make_sampler`,
`scorer.make_scorer`, `train_step.train_step`), lowered, and compiled; the
table gives the seconds of each part.

  python benchmarks/compile_time.py --preset qwen2.5-0.5b [--scan_layers 0,1] \
      [--scan_decode 1] [--num_layers 2] [--programs sampler,scorer,train] [--json out.json]

Shapes (the defaults are those of the first GPU measurement, docs/speed.md):
the sampler draws K samples of N new tokens (no EOS) for G prompts of P tokens; the
scorer and the train step take the G * K rows of P + N tokens of one batch,
GRPO, micro-batches of `--micro_batch` rows, shared prefix.
"""

import argparse
import functools
import json
import time
from typing import Any, NamedTuple

import flags
import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax import losses, models
from offpolicy_jax.learn import scorer, train_state, train_step
from offpolicy_jax.learn.step_options import StepOptions
from offpolicy_jax.sampling import sampler as sampling
from offpolicy_jax.step import run_state

PROGRAMS = ("sampler", "scorer", "train")


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class Program(NamedTuple):
  """A compiled program (callable on concrete arrays of the abstract shapes) and its seconds."""

  compiled: Any
  seconds: dict[str, float]


def _timed_compile(fn, *args) -> Program:
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return Program(compiled, {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0})


def compile_programs(
  config: models.ModelConfig,
  *,
  prompts: int,
  group: int,
  prompt_len: int,
  new_tokens: int,
  micro_batch: int,
  programs: tuple[str, ...] = PROGRAMS,
  decode_block: int = sampling.DECODE_BLOCK,
) -> dict[str, Program]:
  """{name: Program} of `programs` for `config`, compiled from abstract shapes (nothing allocated).

  Arguments of the compiled programs: sampler `(params, prompt_tokens [G, P], lengths [G], key)`,
  scorer `(params, prompt_tokens, lengths, SampleOutput)`, train `(TrainState, TrainBatch, key)`
  (GRPO, the state donated).
  """
  graphdef, params = nnx.split(nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0))))
  g, k, p, n = prompts, group, prompt_len, new_tokens
  out_shapes = sampling.SampleOutput(
    jax.ShapeDtypeStruct((g * k, n), jnp.int32),
    jax.ShapeDtypeStruct((g * k, n), jnp.float32),
    jax.ShapeDtypeStruct((g * k, n), jnp.float32),
    jax.ShapeDtypeStruct((g * k,), jnp.int32),
    jax.ShapeDtypeStruct((g * k, n), jnp.int32),
  )
  prompt_tokens = jax.ShapeDtypeStruct((g, p), jnp.int32)
  lengths = jax.ShapeDtypeStruct((g,), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  options = StepOptions(
    losses.get_spec("grpo"),
    micro_batch_size=micro_batch,
    group_size=k,
    shared_prefix=micro_batch % k == 0,
  )
  built = {}
  for name in programs:
    if name == "sampler":
      fn = sampling.make_sampler(
        graphdef, max_new_tokens=n, group_size=k, eos_id=None, decode_block=decode_block
      )
      built[name] = _timed_compile(fn, params, prompt_tokens, lengths, key)
    elif name == "scorer":
      fn = scorer.make_scorer(graphdef, options)
      built[name] = _timed_compile(fn, params, prompt_tokens, lengths, out_shapes)
    elif name == "train":
      optimizer = train_state.make_optimizer(1e-6)
      scalar = jax.ShapeDtypeStruct((), jnp.int32)
      opt_state = jax.eval_shape(optimizer.init, params)
      state = train_state.TrainState(params, opt_state, scalar, scalar, scalar)
      batch = _abstract(run_state.empty_batch(run_state.Sizes(g, k, p, n)))
      step = functools.partial(train_step.train_step, graphdef, optimizer, options)
      fn = jax.jit(step, donate_argnums=0)
      built[name] = _timed_compile(fn, state, batch, key)
    else:
      raise ValueError(f"--programs: unknown program {name!r}; choose from {PROGRAMS}")
  return built


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen2.5-0.5b")
  parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--scan_layers", default="1", help="comma-separated 0/1 variants")
  parser.add_argument(
    "--scan_decode", type=int, default=0, choices=(0, 1), help="the sampler's steps scanned too"
  )
  parser.add_argument("--remat", type=int, default=1, choices=(0, 1))
  parser.add_argument("--num_layers", type=int, default=0, help="0: the preset's depth")
  parser.add_argument("--programs", default=",".join(PROGRAMS))
  parser.add_argument("--prompts", type=int, default=16, help="G")
  parser.add_argument("--group", type=int, default=8, help="K")
  parser.add_argument("--prompt_len", type=int, default=256, help="P")
  parser.add_argument("--new_tokens", type=int, default=512, help="N")
  parser.add_argument("--train_prompts", type=int, default=8, help="G of the scorer and train step")
  parser.add_argument("--train_prompt_len", type=int, default=128)
  parser.add_argument("--train_new_tokens", type=int, default=256)
  parser.add_argument("--micro_batch", type=int, default=32)
  parser.add_argument("--decode_block", type=int, default=sampling.DECODE_BLOCK)
  parser.add_argument("--json", default="", help="also write the results here")
  args = parser.parse_args()
  programs = tuple(args.programs.split(","))
  if unknown := set(programs) - set(PROGRAMS):
    parser.error(f"--programs: unknown {sorted(unknown)}; choose from {PROGRAMS}")
  if not set(args.scan_layers.split(",")) <= {"0", "1"}:
    parser.error(f"--scan_layers: comma-separated 0 and 1, got {args.scan_layers!r}")
  shapes = ("prompts", "group", "prompt_len", "new_tokens", "train_prompts", "train_prompt_len")
  positive = (*shapes, "train_new_tokens", "micro_batch", "decode_block")
  if args.num_layers < 0:
    parser.error(f"--num_layers: >= 0 (0: the preset's), got {args.num_layers}")
  depth = {"num_layers": args.num_layers} if args.num_layers else {}
  rows = ("train_prompts", "group")
  flags.check(parser, args, presets=(args.preset,), positive=positive, rows=rows)
  rows = []
  for scan in (bool(int(s)) for s in args.scan_layers.split(",")):
    config = models.get_config(
      args.preset,
      dtype=args.dtype,
      scan_layers=scan,
      scan_decode=bool(args.scan_decode),
      remat=bool(args.remat),
      **depth,
    )
    # The sampler at its own shapes, the scorer and the train step at one batch's.
    parts = (
      ((p for p in programs if p == "sampler"), args.prompts, args.prompt_len, args.new_tokens),
      (
        (p for p in programs if p != "sampler"),
        args.train_prompts,
        args.train_prompt_len,
        args.train_new_tokens,
      ),
    )
    built: dict[str, Program] = {}
    for names, g, p, n in parts:
      if names := tuple(names):
        built |= compile_programs(
          config,
          prompts=g,
          group=args.group,
          prompt_len=p,
          new_tokens=n,
          micro_batch=args.micro_batch,
          programs=names,
          decode_block=args.decode_block,
        )
    for name, t in ((name, prog.seconds) for name, prog in built.items()):
      rows.append(
        dict(
          preset=args.preset,
          layers=config.num_layers,
          scan_layers=scan,
          scan_decode=config.scan_decode,
          program=name,
          **t,
        )
      )
      print(
        f"{args.preset:14s} layers={config.num_layers} scan_layers={int(scan)} "
        f"scan_decode={int(config.scan_decode)} {name:8s} "
        f"lower {t['lower_s']:7.1f} s"
        f"  compile {t['compile_s']:7.1f} s  total {t['total_s']:7.1f} s",
        flush=True,
      )
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
