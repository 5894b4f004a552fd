"""Jitted forward+backward time of every loss preset relative to REINFORCE.

Usage: python benchmarks/losses.py [--batch 256] [--length 1024] [--repeats 20] [--stat min]

Every preset computes ``value_and_grad`` of its loss w.r.t. ``logp`` on a
``[batch, length]`` float32 batch with ragged masks, first alone ("loss+grad")
and then also returning its metrics dict as a train step does ("+metrics";
REINFORCE then pays for the ratio statistics too). Times are medians (or, with
``--stat min``, best-of, which is steadier on a loaded machine) over
interleaved repeats, so machine load affects every preset alike.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import losses


def make_batch(batch: int, length: int, seed: int = 0) -> dict[str, jax.Array]:
  """Random log-probs with a spread of ratios, ragged masks, sequence advantages."""
  rng = np.random.default_rng(seed)
  behavior = rng.uniform(-4.0, -0.1, (batch, length)).astype(np.float32)
  logp = behavior + rng.normal(0.0, 0.3, (batch, length)).astype(np.float32)
  lengths = rng.integers(length // 4, length + 1, batch)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
  prox = behavior + rng.normal(0.0, 0.1, (batch, length)).astype(np.float32)
  return dict(
    logp=jnp.asarray(logp),
    behavior_logp=jnp.asarray(behavior),
    proximal_logp=jnp.asarray(prox),
    advantages=jnp.asarray(rng.normal(size=batch).astype(np.float32)),
    mask=jnp.asarray(mask),
  )


def make_step(spec: losses.LossSpec, with_metrics: bool):
  """Jitted ``(inputs) -> ((loss, metrics?), d loss / d logp)`` for one spec."""

  def step(inputs):
    kw = dict(inputs)
    if not spec.needs_proximal:
      kw.pop("proximal_logp")
    logp = kw.pop("logp")

    def loss_fn(lp):
      out = losses.policy_loss(spec, logp=lp, **kw)
      return out.loss, (out.metrics if with_metrics else None)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)

  return jax.jit(step)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--length", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--stat", choices=("median", "min"), default="median")
  args = parser.parse_args()

  inputs = make_batch(args.batch, args.length)
  steps = {
    (name, with_metrics): make_step(losses.get_spec(name), with_metrics)
    for name in losses.names()
    for with_metrics in (False, True)
  }
  for step in steps.values():
    jax.block_until_ready(step(inputs))  # compile
  times = {key: [] for key in steps}
  for _ in range(args.repeats):
    for key, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(inputs))
      times[key].append(time.perf_counter() - start)
  reduce = np.median if args.stat == "median" else np.min
  med = {key: float(reduce(ts)) for key, ts in times.items()}
  base = {m: med[("reinforce", m)] for m in (False, True)}
  print(
    f"backend={jax.default_backend()} batch=[{args.batch}, {args.length}] "
    f"repeats={args.repeats} stat={args.stat}"
  )
  print(
    f"{'preset':<24}{'loss+grad ms':>14}{'x reinforce':>13}{'+metrics ms':>14}{'x reinforce':>13}"
  )
  for name in losses.names():
    row = f"{name:<24}"
    for m in (False, True):
      row += f"{1e3 * med[(name, m)]:>14.2f}{med[(name, m)] / base[m]:>13.2f}"
    print(row + ("" if med[(name, True)] <= 1.5 * base[True] else "  > 1.5x"))


if __name__ == "__main__":
  main()
