"""The main job: a tiny decoder learns a synthetic task on CPU under policy lag.

Run:
  python -m experiments.train --config=configs/default.py --workdir=workdirs/default

Task: reverse a string of 2-5 digits ("rev:1234=" -> "4321"), exact-match
reward computed on device. A 150-step supervised warm start gives a starting
greedy accuracy around 0.4, then REC-OneSide-NoIS trains for 1000 steps with a
sawtooth lag (sync_interval 4: the batch of step t comes from parameters up to
3 updates old). About 1-3 minutes on a 2-core CPU (compilation included); the
mean reward goes from about 0.50 in the first fifth of steps to about 0.73 in
the last fifth.
"""

import ml_collections

from offpolicy_jax import config_schema


def base_config() -> ml_collections.ConfigDict:
  """Every field the loop reads, with CPU-toy values; callers lock it.

  The fields, their defaults (the main job's values), roles, checks and docs
  are declared once in `offpolicy_jax/config_schema.py` (`RUN_FIELDS`).
  """
  return config_schema.config_dict()


def get_config() -> ml_collections.ConfigDict:
  """The main job's config (locked: a misspelt override is an error)."""
  c = base_config()
  c.lock()
  return c
