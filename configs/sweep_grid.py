"""A sweep of many single runs: 9 methods x 4 lags x 3 seeds of the default task.

  python -m experiments.sweep --config=configs/sweep_grid.py --workdir=/tmp/sweep_grid

108 runs of the main job's task (configs/default.py: reverse, tiny decoder,
150-step warm start), 200 steps each, every run in a worker process of its
own (`experiments.sweep`). It is the grid a researcher launches to compare
losses under lag before a study; its time on a 2-core CPU is in
docs/results/sweeps.md. `workdir/summary.md` lists every run with its final
reward and greedy accuracy; killed and rerun, it skips the finished runs.
"""

import ml_collections

from configs import default
from offpolicy_jax.study import grid as study_grid

METHODS = (
  "reinforce",
  "grpo",
  "rec_oneside_nois",
  "rec_oneside_nois_wide",
  "opmd",
  "asymre",
  "cispo",
  "m2po",
  "decoupled_ppo",
)
LAGS = "onpolicy=1/0,interval4=4/0,interval20=20/0,offset10=1/10"
SEEDS = (0, 1, 2)


def get_config() -> ml_collections.ConfigDict:
  """The shared base of every run: the main job's, 200 steps, evaluation every 50."""
  c = default.base_config()
  c.total_steps = 200
  c.eval_every = 50
  c.checkpoint_every = 100
  c.progress = False
  c.tensorboard = False
  c.lock()
  return c


def get_sweep() -> list[dict]:
  """One entry per run; `name` names its subdirectory."""
  lags = study_grid.parse_lags(LAGS, get_config().total_steps)
  return [
    {
      "name": f"{method}-{lag}-s{seed}",
      "loss.name": method,
      "lag.sync_interval": m,
      "lag.sync_offset": n,
      "seed": seed,
    }
    for method in METHODS
    for lag, (m, n) in lags.items()
    for seed in SEEDS
  ]
