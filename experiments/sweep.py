r"""Expands a config's `get_sweep()` into runs: runs them here one by one, or writes launchers.

  python -m experiments.sweep --config=configs/lag_study.py --workdir=/tmp/lag_study
  python -m experiments.sweep --config=configs/lag_study.py --workdir=DIR --print_only
  python -m experiments.sweep --config=configs/lag_study.py --workdir=gs://BUCKET/lag \
      --launcher=jobset --launch_dir=/tmp/lag_jobs --image=IMAGE --hosts=4 --tpu_topology=4x4

`--launcher=local|hosts|slurm|jobset` runs nothing: it writes one file per run
(a train command, a per-host script, an sbatch script or a TPU JobSet, see
`offpolicy_jax.launchers`) and `index.tsv` to `--launch_dir`, or prints them
without it. `--print_only` is `--launcher=local` printed. Before writing
anything, each run's config goes through the checks of train's start-up that
read the config alone (`validation.validate_settings`: values, names, how the
fields fit; not this machine's devices or files): a bad run ends the command
in one line naming it and its field.

Each run goes to `workdir/<run name>` (resumable like train.py) and trains in
a worker process of its own (its output in `<run>/sweep_run.log`; `--inline`
trains here instead, for debugging), so a crash, an OOM kill or a segfault
costs that run only. Progress (done, failed, to go, ETA) is printed after each
run; at the end the sweep writes `workdir/summary.md`, `workdir/summary.csv`
and `workdir/curves.png`. A run that fails is recorded (`status` failed and
its `error` in the summary) and the sweep goes on; the process then exits with
status 1, naming the failed runs. Rerunning the command skips the runs that
finished (`sweep_status.json`) and retries the failed ones. SIGINT / SIGTERM
let the current run save at its step, then stop the sweep.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from offpolicy_jax import cli, errors
from offpolicy_jax.study import launchers
from offpolicy_jax.study.sweeps import (
  SweepError,
  check_runs,
  load_sweep,
  run_configs,
  run_sweep,
)

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, cli.config_help("Config file with get_sweep() (overrides here: every run)")
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Parent directory of the runs.")
_PRINT_ONLY = flags.DEFINE_bool("print_only", False, "Print one train command per run and exit.")
_INLINE = flags.DEFINE_bool(
  "inline",
  False,
  "Train every run in this process (debugging) instead of one worker process per run.",
)
_LAUNCHER = flags.DEFINE_enum(
  "launcher", None, launchers.LAUNCHERS, "Write (or print) launch files instead of running."
)
_LAUNCH_DIR = flags.DEFINE_string("launch_dir", None, "Where --launcher writes its files.")
_HOSTS = flags.DEFINE_integer("hosts", 1, "Hosts (processes) per run.")
_COORDINATOR_PORT = flags.DEFINE_integer("coordinator_port", 8476, "Port of process 0.")
_PYTHON = flags.DEFINE_string("python", "python", "Interpreter of the generated commands.")
_REPO_DIR = flags.DEFINE_string("repo_dir", "", "Repository root the commands cd into first.")
_IMAGE = flags.DEFINE_string("image", "", "jobset: container image with the repository.")
_TPU_TYPE = flags.DEFINE_string("tpu_type", "tpu-v5-lite-podslice", "jobset: GKE TPU accelerator.")
_TPU_TOPOLOGY = flags.DEFINE_string("tpu_topology", "2x2", "jobset: TPU slice topology.")
_CHIPS_PER_HOST = flags.DEFINE_integer("chips_per_host", 4, "jobset: TPU chips per host.")
_SLURM_PARTITION = flags.DEFINE_string("slurm_partition", "", "slurm: partition.")
_SLURM_GRES = flags.DEFINE_string("slurm_gres", "", "slurm: generic resources per node (gpu:8).")
_SLURM_TIME = flags.DEFINE_string("slurm_time", "24:00:00", "slurm: time limit.")
flags.mark_flags_as_required(["config", "workdir"])


def _cli_overrides() -> list[str]:
  return [a for a in sys.argv[1:] if a.startswith("--config.")]


def _refuse_swept_overrides(sweep: list[dict]) -> None:
  """A `--config.<field>` that a run of the sweep sets too would be silently replaced: refused."""
  swept = {k for run in sweep for k in run if k != "name"}
  for arg in _cli_overrides():
    field = arg.split("=", 1)[0].removeprefix("--config.")
    if field in swept:
      raise errors.UserError(
        f"--config.{field}: the sweep's runs set {field} themselves, so this flag would be "
        "replaced without a word",
        "drop the flag, or change get_sweep() in the config file",
      )


def _print_file(path: str) -> None:
  with open(path) as f:
    print(f.read())


def _cluster() -> launchers.Cluster:
  return launchers.Cluster(
    hosts=_HOSTS.value,
    coordinator_port=_COORDINATOR_PORT.value,
    python=_PYTHON.value,
    repo_dir=_REPO_DIR.value,
    image=_IMAGE.value,
    tpu_type=_TPU_TYPE.value,
    tpu_topology=_TPU_TOPOLOGY.value,
    chips_per_host=_CHIPS_PER_HOST.value,
    slurm_partition=_SLURM_PARTITION.value,
    slurm_gres=_SLURM_GRES.value,
    slurm_time=_SLURM_TIME.value,
  )


def _launch(launcher: str, config_path: str, sweep: list[dict]) -> None:
  """Checks every run's config, then writes (or prints) the launch files; runs nothing."""
  runs = launchers.make_runs(sweep, config_path, _WORKDIR.value, _cli_overrides())
  cluster = _cluster()
  launchers.check_cluster(launcher, cluster)
  # The checks of train's start-up that read the config alone: the runs may go to machines
  # whose devices and files this one lacks. After the flags: this imports JAX.
  from offpolicy_jax.run import validation

  check_runs(run_configs(_CONFIG.value, sweep), validation.validate_settings)
  if _LAUNCH_DIR.value:
    print(launchers.write(_LAUNCH_DIR.value, launcher, runs, cluster))
  elif launcher == "local":
    print(launchers.local_commands(runs, cluster), end="")
  else:
    for name, text in launchers.render(launcher, runs, cluster).items():
      print(f"# ==> {name} <==\n{text}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  sweep = load_sweep(config_path)
  _refuse_swept_overrides(sweep)
  launcher = "local" if _PRINT_ONLY.value else _LAUNCHER.value
  if launcher:
    try:
      return _launch(launcher, config_path, sweep)
    except errors.UserError:
      raise
    except ValueError as e:  # a launcher's flag or a run name
      raise errors.UserError(str(e)) from e
  try:
    isolation = "inline" if _INLINE.value else "process"
    summary = run_sweep(_CONFIG.value, sweep, _WORKDIR.value, isolation=isolation)
  except SweepError as e:
    _print_file(e.summary)
    print(e, file=sys.stderr, flush=True)
    for name, error in e.failed.items():
      print(f"  {name}: {error}", file=sys.stderr)
    return 1
  _print_file(summary)


if __name__ == "__main__":
  cli.run(main)
