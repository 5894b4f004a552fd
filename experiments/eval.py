r"""Evaluates a run's checkpoint, or a Hugging Face directory, on a task.

  python -m experiments.eval --workdir=workdirs/default [--step=200]
  python -m experiments.eval --config=configs/gsm8k_qwen25_1p5b.py \
      --config.model=/ckpt/Qwen2.5-1.5B-Instruct --config.eval_samples=8

With --workdir the run's recorded config is used; a --config given beside it
may change how evaluation runs (eval_prompts, eval_samples, mesh) but not
what the run is (task, model, loss, ...): those differences are refused by
field name.

Prints (and with --out writes as JSON) greedy accuracy, mean reward, response
length and pass@k (k = config.eval_samples) on config.eval_prompts held-out prompts.
"""

import json
import os

from absl import app, flags, logging
from ml_collections import config_flags

from offpolicy_jax import cli, errors
from offpolicy_jax.store import workdir

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  cli.config_help(fields=("model", "task", "eval_prompts", "eval_samples", "seed")),
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Run directory (its config.json is used); omit to evaluate config.model."
)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_OUT = flags.DEFINE_string("out", None, "Optional JSON output path.")
flags.register_multi_flags_validator(
  ["config", "workdir"],
  lambda v: v["config"] is not None or v["workdir"] is not None,
  "give --workdir (a run's checkpoint) or --config (a model as configured)",
)


def _require_checkpoint(run: str) -> None:
  """Refuses a run with no checkpoint yet, saying how to make one (before JAX is imported)."""
  directory = os.path.join(run, "checkpoints")
  steps = os.listdir(directory) if os.path.isdir(directory) else []
  if not any(name.isdigit() for name in steps):  # a step's directory is named by its number
    raise errors.WorkdirError(
      f"--workdir {run}: no checkpoint yet under {directory}",
      "train it first, or resume its training: python -m experiments.train "
      f"--config=<its config file> --workdir={run}",
    )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  cli.early_checks(config)
  if _WORKDIR.value:  # the run's record, checked before JAX is imported
    config = workdir.eval_config(config, _WORKDIR.value)
    _require_checkpoint(_WORKDIR.value)
  from offpolicy_jax.run import start

  logging.set_verbosity(logging.WARNING)
  result = start.evaluate_checkpoint(config, _WORKDIR.value, _STEP.value)
  text = json.dumps(result, indent=2)
  print(text)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  cli.run(main)
