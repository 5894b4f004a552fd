r"""Trains with off-policy RL; resumes from the latest checkpoint in --workdir.

A second run in the same --workdir refuses to start while the first holds it;
a resume whose config changes the run's meaning is refused unless
--allow_config_change is given.

  python -m experiments.train --config=configs/default.py --workdir=/tmp/opj \
      [--config.lag.sync_interval=1 --config.loss.name=grpo ...]

Multi-host (TPU pods, GPU clusters): run the same command on every host with
--multihost, which calls `jax.distributed.initialize()` before anything else
touches JAX (on TPU and SLURM the coordinator is discovered automatically;
elsewhere pass --coordinator_address, --num_processes and --process_id, or set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID). Each process
then keeps its own rows of every global prompt batch and the loop assembles
global batches, so the run's numbers do not depend on the number of processes.
On CPU (several processes on one machine, e.g. 2 processes x 4 fake devices
with XLA_FLAGS=--xla_force_host_platform_device_count=4) collectives go
through gloo.
"""

import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from offpolicy_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, cli.config_help(), lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics and checkpoints.")
_MULTIHOST = flags.DEFINE_bool(
  "multihost", False, "Call jax.distributed.initialize() (one process per host)."
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "host:port of process 0 (implies --multihost)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
  "allow_config_change",
  False,
  "Resume even if fields that change the run's meaning (loss, lag, model, task, shapes, seed, "
  "optimizer, ...) differ from the workdir's config.json; the change is recorded in "
  "config_history.jsonl.",
)
flags.mark_flags_as_required(["config", "workdir"])

_COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"


def _distributed_kwargs() -> dict | None:
  """`jax.distributed.initialize` arguments, or None for a single-process run."""
  address = _COORDINATOR.value or os.environ.get(_COORDINATOR_ENV)
  if not (_MULTIHOST.value or address):
    return None
  kw = {
    "coordinator_address": address,
    "num_processes": _NUM_PROCESSES.value,
    "process_id": _PROCESS_ID.value,
  }
  if kw["num_processes"] is None and "JAX_NUM_PROCESSES" in os.environ:
    kw["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
  if kw["process_id"] is None and "JAX_PROCESS_ID" in os.environ:
    kw["process_id"] = int(os.environ["JAX_PROCESS_ID"])
  return {k: v for k, v in kw.items() if v is not None}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cli.early_checks(_CONFIG.value, workdir=_WORKDIR.value)
  import jax

  distributed = _distributed_kwargs()
  if distributed is not None:
    # Cross-process collectives of CPU devices (the default of recent JAX, made explicit).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**distributed)

  from offpolicy_jax.run import loop, validation
  from offpolicy_jax.study import reports

  # Library progress goes to stdout; keep JAX's and orbax's INFO chatter out of the way.
  logging.set_verbosity(logging.WARNING)
  spec = validation.validate_config(_CONFIG.value)  # a refused config: one line, nothing written
  print(
    f"JAX {jax.__version__}, process {jax.process_index()} of {jax.process_count()}, "
    f"devices: {jax.devices()}",
    flush=True,
  )
  begin = time.perf_counter()
  loop.train_and_evaluate(
    _CONFIG.value, _WORKDIR.value, allow_config_change=_ALLOW_CONFIG_CHANGE.value, spec=spec
  )
  if jax.process_index() == 0:
    wall = time.perf_counter() - begin
    lora = bool(_CONFIG.value.lora.rank)
    print(
      "run finished:", reports.format_run_summary(_WORKDIR.value, wall_s=wall, lora=lora), sep="\n"
    )


if __name__ == "__main__":
  cli.run(main)
