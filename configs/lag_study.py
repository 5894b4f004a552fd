"""Lag study at toy scale: loss presets x {on-policy, sawtooth 20, constant lag 10, offline}.

  python -m experiments.sweep --config=configs/lag_study.py --workdir=/tmp/lag_study

Every run starts from the same supervised warm start (same seed, computed once)
and differs only in the loss and the lag schedule v(t) of arXiv:2509.24203 (see
offpolicy_jax.lag). Compare the `eval/` columns: with stale data the training
reward measures the behaviour policy (offline: always version 0), not the
policy being trained. About 1.5-3 minutes on a 2-core CPU; REINFORCE degrades
under lag while REC-OneSide-NoIS and GRPO stay close to on-policy.
"""

import ml_collections

from configs import default

# Loss presets compared.
PRESETS = ("rec_oneside_nois", "grpo", "reinforce")

# Lag settings: name -> (sync_interval m, sync_offset n).
LAGS = {
  "onpolicy": (1, 0),
  "interval20": (20, 0),
  "offset10": (1, 10),
  "offline": (1_000_000, 0),
}


def get_config() -> ml_collections.ConfigDict:
  """The shared base of every run: the default job, shortened."""
  c = default.base_config()
  c.total_steps = 200
  c.eval_every = 100
  c.eval_prompts = 64
  c.checkpoint_every = 0
  c.progress = False
  c.tensorboard = False
  c.lock()
  return c


def get_sweep() -> list[dict]:
  """One dict of dotted overrides per run (`name` names its subdirectory)."""
  runs = []
  for preset in PRESETS:
    for lag, (m, n) in LAGS.items():
      runs.append(
        {
          "name": f"{preset}-{lag}",
          "loss.name": preset,
          "lag.sync_interval": m,
          "lag.sync_offset": n,
        }
      )
  return runs
