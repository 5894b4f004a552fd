r"""Trains with off-policy RL; resumes from the latest checkpoint in --workdir.

  python -m experiments.train --config=configs/default.py --workdir=/tmp/opj \
      [--config.lag.sync_interval=1 --config.loss.name=grpo ...]
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics and checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  import jax

  from offpolicy_jax import loop, metrics

  logging.info("JAX %s, devices: %s", jax.__version__, jax.devices())
  # Library progress goes to stdout; keep orbax's INFO chatter out of the way.
  logging.set_verbosity(logging.WARNING)
  loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  summary = metrics.summarize_run(_WORKDIR.value)
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  print(" ".join(f"{k}={fmt(v)}" for k, v in summary.items()))


if __name__ == "__main__":
  app.run(main)
