"""Multi-turn rollout throughput: KV-cache extension against re-prefilling the history each turn.

G prompts of P random tokens, K trajectories each, float32, this machine's
default JAX device. Every trajectory takes `--turns` policy turns of exactly
`--turn_tokens` tokens (no EOS, no turn-end sequence) and receives an
observation of `--obs_tokens` random tokens after each turn but the last, so
both systems do the same decoding work and differ only in how an
observation enters the cache:

  extend     `Decoder.extend_shared`: the observation's tokens, attending to the
             cached prompt and history (`MultiTurnSampler(history="extend")`);
  reprefill  the prompts and each row's whole history (prompt + every past turn
             and observation) encoded again, as a system that re-prefills the
             conversation every turn does (`history="reprefill"`).

Both draw with the same per-row keys: the script asserts the trajectories are
the same tokens, then prints the medians of `--rounds` interleaved rounds
after a warm-up (compilation excluded) and their ratio.

  python benchmarks/multiturn.py [--preset tiny|small] [--rounds 3] [--prompts 4] \
      [--group 2] [--prompt_len 64] [--turns 6] [--turn_tokens 16] [--obs_tokens 32]
"""

import argparse
import time

import jax
import numpy as np
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.sampling import multiturn

HISTORIES = ("extend", "reprefill")


def _respond(vocab: int, obs_tokens: int):
  """An environment that answers every row with `obs_tokens` tokens fixed by (row, turn)."""

  def respond(turn, rows, actions, final):
    return [
      (np.random.RandomState(1000 * turn + int(r)).randint(1, vocab, obs_tokens), False)
      for r in rows
    ]

  return respond


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="tiny", choices=("tiny", "small"))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=4, help="G distinct prompts")
  parser.add_argument("--group", type=int, default=2, help="K trajectories per prompt")
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--turns", type=int, default=6)
  parser.add_argument("--turn_tokens", type=int, default=16)
  parser.add_argument("--obs_tokens", type=int, default=32)
  parser.add_argument("--decode_block", type=int, default=32)
  args = parser.parse_args()

  config = models.get_config(args.preset, dtype="float32")
  graphdef, params = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)))
  g, k, p = args.prompts, args.group, args.prompt_len
  turns, turn_tokens, obs = args.turns, args.turn_tokens, args.obs_tokens
  n = turns * turn_tokens + (turns - 1) * obs
  prompts = np.random.RandomState(0).randint(1, config.vocab_size, (g, p)).astype(np.int32)
  lengths = np.full((g,), p, np.int32)
  respond = _respond(config.vocab_size, obs)

  samplers = {
    history: multiturn.MultiTurnSampler(
      graphdef,
      max_new_tokens=n,
      turn_tokens=turn_tokens,
      max_turns=turns,
      observation_tokens=obs,
      group_size=k,
      temperature=1.0,
      decode_block=args.decode_block,
      history=history,
    )
    for history in HISTORIES
  }

  def run(history):
    out, info = samplers[history](params, prompts, lengths, jax.random.key(0), respond)
    return jax.block_until_ready((out, info))

  times = {h: [] for h in HISTORIES}
  outs = {}
  for r in range(args.rounds + 1):
    for history in HISTORIES:
      t0 = time.perf_counter()
      outs[history] = run(history)
      if r:
        times[history].append(time.perf_counter() - t0)
  (a, info), (b, _) = outs["extend"], outs["reprefill"]
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  assert np.all(np.asarray(a.lengths) == n) and np.all(np.asarray(info.turns) == turns)
  policy = int(np.asarray(a.mask).sum())
  filled = int(np.asarray(a.lengths).sum())
  print(
    f"preset={args.preset} params={config.num_params() / 1e6:.1f}M prompts={g} group={k} "
    f"prompt_len={p} turns={turns} turn_tokens={turn_tokens} obs_tokens={obs} (N={n}) "
    f"decode_block={args.decode_block} device={jax.devices()[0].platform}; medians of "
    f"{args.rounds} interleaved rounds after a warm-up; the same {g * k} trajectories "
    f"(tokens equal)"
  )
  print("| history | s / rollout | policy tokens/s | trajectory tokens/s |")
  print("|---|---|---|---|")
  median = {h: float(np.median(times[h])) for h in HISTORIES}
  for history in HISTORIES:
    t = median[history]
    print(f"| {history} | {t:.3f} | {policy / t:,.0f} | {filled / t:,.0f} |")
  print(f"extend / reprefill throughput: {median['reprefill'] / median['extend']:.2f}x")


if __name__ == "__main__":
  main()
