"""What asynchrony buys on a latency-bound agentic task: sync against async, over seeds.

  python -m experiments.sweep --config=configs/what_lag_buys.py --workdir=DIR
  python -m experiments.compare --workdir=DIR --baseline=sync --margin=0.1

The calculator task with tool latency (`configs/calculator.py:latency`: every
tool call answers after a log-normal delay, median 200 ms, at most 2 s),
100 REC-OneSide-NoIS steps after the 220-step warm start, evaluated every
25 steps on 64 held-out problems (greedy), in three settings per seed:

  sync      on-policy synchronous steps (lag.sync_interval 1): each step
            waits for its episodes' slowest tool calls, then learns
  async     lag.mode=async, one sampler thread, batches at most 4 steps old
  async_t4  four sampler threads (`lag.sampler_threads`), each with a batch
            of episodes in flight and verifier workers of its own

`experiments.compare` pairs each setting's runs with sync's by seed: final
accuracy (equivalence at the margin), training seconds and sampled tokens to
the warm start + 0.10, and their ratios to sync (docs/what_lag_buys.md).
"""

import ml_collections

from configs import calculator

SEEDS = tuple(range(8))
SETTINGS = {
  "sync": {"lag.mode": "sync", "lag.sync_interval": 1},
  "async": {"lag.mode": "async", "lag.max_staleness": 4},
  "async_t4": {"lag.mode": "async", "lag.max_staleness": 4, "lag.sampler_threads": 4},
}


def get_config() -> ml_collections.ConfigDict:
  """The shared base of every run: the latency task, 100 steps, evaluated every 25."""
  c = calculator.get_config("latency")
  c.unlock()
  c.total_steps = 100
  c.eval_every = 25
  c.eval_samples = 1  # greedy accuracy only: the comparison needs no pass@k
  c.checkpoint_every = 100
  c.progress = False
  c.tensorboard = False
  c.lock()
  return c


def get_sweep() -> list[dict]:
  """One entry per run, seeds interleaved (a slow spell of the machine hits every setting)."""
  return [
    {"name": f"{name}-s{seed}", "seed": seed, **overrides}
    for seed in SEEDS
    for name, overrides in SETTINGS.items()
  ]
