"""Launchers: a sweep's runs as local commands, per-host scripts, SLURM scripts or JobSets.

`make_runs` turns `get_sweep()` into runs (one `experiments.train` command each,
in `workdir/<run name>`); `render` returns one file per run for a launcher:
`local` (the command, as `experiments.sweep --print_only` prints it), `hosts`
(host I of N runs `COORD=<host 0> bash <file> I`), `slurm` (sbatch; coordinator
= the job's first node, process id = `$SLURM_PROCID`) or `jobset` (a GKE/xpk
style JobSet for a multi-host TPU slice; coordinator = pod 0's headless-service
DNS name, process id = `$JOB_COMPLETION_INDEX`). Multi-host commands add
`--multihost --coordinator_address=HOST:PORT --num_processes=N --process_id=I`.
Nothing is executed here; every argument is quoted with `shlex`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import re
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from offpolicy_jax.study.sweeps import run_name

LAUNCHERS = ("local", "hosts", "slurm", "jobset")
_SUFFIX = {"local": ".sh", "hosts": ".sh", "slurm": ".sbatch", "jobset": ".yaml"}
_HOW = {"hosts": "COORD=<host 0> bash {} I", "slurm": "sbatch {}", "jobset": "kubectl apply -f {}"}
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.,=+-]+")
_SAFE_DIRECTIVE = re.compile(r"[A-Za-z0-9_.,:=+@%/-]*")
_TOPOLOGY = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*)+")
_JOBSET = """\
# Run {title}: kubectl apply -f <this file>
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: {name}
  annotations:
    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool
    offpolicy-jax/run: {run}
    offpolicy-jax/workdir: {workdir}
spec:
  failurePolicy:
    maxRestarts: 0
  network:
    enableDNSHostnames: true
  replicatedJobs:
  - name: slice
    replicas: 1
    template:
      spec:
        parallelism: {c.hosts}
        completions: {c.hosts}
        completionMode: Indexed
        backoffLimit: 0
        template:
          spec:
            restartPolicy: Never
            nodeSelector:
              cloud.google.com/gke-tpu-accelerator: {tpu_type}
              cloud.google.com/gke-tpu-topology: {topology}
            containers:
            - name: train
              image: {image}{working_dir}
              command: ["bash", "-c", {task}]
              ports:
              - containerPort: {c.coordinator_port}
                name: coordinator
              resources:
                limits:
                  google.com/tpu: {c.chips_per_host}
"""


class Cluster(NamedTuple):
  """Where the runs go (a launcher ignores the fields it does not use).

  Attributes:
    hosts: processes per run, one per host (node, TPU VM, pod).
    coordinator_port: port of `jax.distributed`'s coordinator on process 0.
    python: the interpreter the commands call.
    repo_dir: directory to `cd` into first (the repository root); empty: stay.
    image: `jobset`: container image holding the repository and its environment.
    tpu_type: `jobset`: the `cloud.google.com/gke-tpu-accelerator` node label.
    tpu_topology: `jobset`: the slice topology, e.g. `4x4` or `2x2x4`.
    chips_per_host: `jobset`: TPU chips per host (the `google.com/tpu` limit).
    slurm_partition: `slurm`: the partition (empty: the cluster's default).
    slurm_gres: `slurm`: generic resources per node, e.g. `gpu:8`.
    slurm_time: `slurm`: the time limit.
  """

  hosts: int = 1
  coordinator_port: int = 8476
  python: str = "python"
  repo_dir: str = ""
  image: str = ""
  tpu_type: str = "tpu-v5-lite-podslice"
  tpu_topology: str = "2x2"
  chips_per_host: int = 4
  slurm_partition: str = ""
  slurm_gres: str = ""
  slurm_time: str = "24:00:00"


class Run(NamedTuple):
  """One run of a sweep: its name, its workdir and its `experiments.train` flags."""

  name: str
  workdir: str
  flags: tuple[str, ...]


def make_runs(
  sweep: Sequence[Mapping], config_path: str, workdir: str, cli_overrides: Sequence[str] = ()
) -> list[Run]:
  """One `Run` per sweep entry, in `workdir/<run name>`.

  Args:
    sweep: dotted overrides per run (`get_sweep()`); the key `name` names the run.
    config_path: the config file the runs read (as passed to `--config`).
    workdir: the parent of the runs' workdirs (a shared path on a cluster).
    cli_overrides: `--config.x=y` flags that apply to every run (before its own).

  Raises:
    ValueError: naming `name`, if a run name is not directory-safe or repeated.
  """
  runs = []
  for overrides in sweep:
    name = run_name(dict(overrides))
    if not _SAFE_NAME.fullmatch(name) or name in (".", "..") or name.startswith("-"):
      raise ValueError(f"name: run name {name!r} is not directory-safe")
    run_dir = posixpath.join(workdir, name)
    own = [f"--config.{k}={v}" for k, v in overrides.items() if k != "name"]
    flags = (f"--config={config_path}", f"--workdir={run_dir}", *cli_overrides, *own)
    runs.append(Run(name, run_dir, flags))
  repeated = sorted(n for n, count in Counter(r.name for r in runs).items() if count > 1)
  if repeated:
    raise ValueError(f"name: sweep runs share names {repeated}; give each a distinct 'name'")
  return runs


def train_command(run: Run, cluster: Cluster) -> list[str]:
  """The single-process `experiments.train` command of `run`."""
  return [cluster.python, "-m", "experiments.train", *run.flags]


def local_commands(runs: Sequence[Run], cluster: Cluster) -> str:
  """One train command per line, run after another on this machine."""
  return "".join(shlex.join(train_command(r, cluster)) + "\n" for r in runs)


def _multihost(run: Run, cluster: Cluster, coordinator: str, process_id: str) -> str:
  """The shell text of one process's command; `coordinator` and `process_id` are shell words."""
  head = shlex.join([*train_command(run, cluster), "--multihost"])
  address = f'"--coordinator_address={coordinator}:{cluster.coordinator_port}"'
  return f"{head} {address} --num_processes={cluster.hosts} --process_id={process_id}"


def _cd(cluster: Cluster) -> str:
  return f"cd {shlex.quote(cluster.repo_dir)}\n" if cluster.repo_dir else ""


def hosts_script(run: Run, cluster: Cluster) -> str:
  """A bash script with one command per host: host I runs `COORD=<host 0> bash script I`."""
  last = cluster.hosts - 1
  cases = "".join(
    f"  {i}) exec {_multihost(run, cluster, '${COORD}', str(i))} ;;\n" for i in range(cluster.hosts)
  )
  return (
    f"#!/usr/bin/env bash\n# Run {run.name} on hosts 0..{last}: on host I run\n"
    "#   COORD=<address of host 0> bash <this file> I\n"
    'set -euo pipefail\n: "${COORD:?set COORD to the address of host 0}"\n'
    + _cd(cluster)
    + f'case "${{1:?usage: COORD=<host 0> bash $0 <process id 0..{last}>}}" in\n'
    + cases
    + f'  *) echo "process id must be 0..{last}" >&2; exit 2 ;;\nesac\n'
  )


def slurm_script(run: Run, cluster: Cluster) -> str:
  """An sbatch script: one task per node, coordinator on the first node, id `$SLURM_PROCID`."""
  c, n = cluster, cluster.hosts
  directives = [f"job-name={run.name}", f"nodes={c.hosts}", "ntasks-per-node=1"]
  directives += [f"partition={c.slurm_partition}"] * bool(c.slurm_partition)
  directives += [f"gres={c.slurm_gres}"] * bool(c.slurm_gres)
  directives += [f"time={c.slurm_time}", f"output={run.name}-%j.out"]
  header = "".join(f"#SBATCH --{d}\n" for d in directives)
  task = "exec " + _multihost(run, cluster, "${COORD}", '"${SLURM_PROCID}"')
  return (
    f"#!/bin/bash\n{header}# Run {run.name} on {n} node(s): sbatch <this file>\nset -euo pipefail\n"
    + _cd(cluster)
    + 'NODES="$(scontrol show hostnames "${SLURM_JOB_NODELIST}")"\n'
    + "export COORD=\"${NODES%%$'\\n'*}\"  # the first node\n"
    f"srun --nodes={n} --ntasks={n} --ntasks-per-node=1 bash -c {shlex.quote(task)}\n"
  )


def k8s_name(name: str) -> str:
  """A DNS-1035 label of <= 40 characters for a run name (hashed unless it is one already)."""
  label = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
  if label and label == name and len(label) <= 40 and label[0].isalpha():
    return label
  digest = hashlib.sha1(name.encode()).hexdigest()[:6]
  return f"r-{label[:31]}-{digest}".replace("--", "-")


def coordinator_dns(run: Run) -> str:
  """The headless-service DNS name of the JobSet's pod 0 (job 0 of the replicated job)."""
  name = k8s_name(run.name)
  return f"{name}-slice-0-0.{name}"  # <jobset>-<replicated job>-<job index>-<pod index>


def jobset_yaml(run: Run, cluster: Cluster) -> str:
  """The JobSet of `run`: one indexed Job of `hosts` pods on one TPU slice, as YAML."""
  task = "exec " + _multihost(run, cluster, coordinator_dns(run), '"${JOB_COMPLETION_INDEX}"')
  q = json.dumps  # a JSON string is a YAML double-quoted scalar
  workdir = f"\n              workingDir: {q(cluster.repo_dir)}" if cluster.repo_dir else ""
  values = dict(run=q(run.name), workdir=q(run.workdir), image=q(cluster.image), task=q(task))
  values.update(tpu_type=q(cluster.tpu_type), topology=q(cluster.tpu_topology))
  name = k8s_name(run.name)
  return _JOBSET.format(c=cluster, name=name, title=run.name, working_dir=workdir, **values)


def check_cluster(launcher: str, cluster: Cluster) -> None:
  """Raises ValueError naming the field of `launcher` or `cluster` that is unusable."""
  if launcher not in LAUNCHERS:
    raise ValueError(f"launcher: unknown {launcher!r}; expected one of {LAUNCHERS}")
  if cluster.hosts < 1:
    raise ValueError(f"hosts: need at least 1 host, got {cluster.hosts}")
  if not 1 <= cluster.coordinator_port <= 65535:
    raise ValueError(f"coordinator_port: {cluster.coordinator_port} is not in 1..65535")
  if launcher == "slurm":
    for field in ("slurm_partition", "slurm_gres", "slurm_time"):
      if not _SAFE_DIRECTIVE.fullmatch(getattr(cluster, field)):
        raise ValueError(f"{field}: {getattr(cluster, field)!r} is not a plain #SBATCH value")
  if launcher == "jobset":
    _check_tpu(cluster)


def _check_tpu(cluster: Cluster) -> None:
  for field in ("image", "tpu_type"):
    if not getattr(cluster, field):
      raise ValueError(f"{field}: the jobset launcher needs one (a container image, a TPU type)")
  if not _TOPOLOGY.fullmatch(cluster.tpu_topology):
    raise ValueError(f"tpu_topology: {cluster.tpu_topology!r} is not like 4x4 or 2x2x4")
  if cluster.chips_per_host < 1:
    raise ValueError(f"chips_per_host: need at least 1, got {cluster.chips_per_host}")
  chips = math.prod(int(d) for d in cluster.tpu_topology.split("x"))
  if cluster.hosts * cluster.chips_per_host != chips:
    raise ValueError(
      f"hosts: {cluster.hosts} hosts x {cluster.chips_per_host} chips != the {chips} chips "
      f"of topology {cluster.tpu_topology}"
    )


def local_script(run: Run, cluster: Cluster) -> str:
  """A bash script running `run` on this machine as one process."""
  head = f"#!/usr/bin/env bash\nset -euo pipefail\n{_cd(cluster)}exec "
  return head + local_commands([run], cluster)


_RENDER = dict(local=local_script, hosts=hosts_script, slurm=slurm_script, jobset=jobset_yaml)


def render(launcher: str, runs: Sequence[Run], cluster: Cluster) -> dict[str, str]:
  """File name -> text, one file per run, for `launcher` (one of `LAUNCHERS`).

  Raises:
    ValueError: naming the field, for an unknown launcher or an unusable cluster.
  """
  check_cluster(launcher, cluster)
  return {r.name + _SUFFIX[launcher]: _RENDER[launcher](r, cluster) for r in runs}


def write(launch_dir: str, launcher: str, runs: Sequence[Run], cluster: Cluster) -> str:
  """Writes `render(...)`'s files and `index.tsv` (run, workdir, file, launch) to `launch_dir`.

  Returns:
    The path of the index.
  """
  files = render(launcher, runs, cluster)
  os.makedirs(launch_dir, exist_ok=True)
  for name, text in files.items():
    path = os.path.join(launch_dir, name)
    with open(path, "w") as f:
      f.write(text)
    os.chmod(path, 0o755 if name.endswith((".sh", ".sbatch")) else 0o644)
  rows = ["run\tworkdir\tfile\tlaunch"]
  for r in runs:
    file = r.name + _SUFFIX[launcher]
    rows.append(f"{r.name}\t{r.workdir}\t{file}\t{_HOW.get(launcher, 'bash {}').format(file)}")
  path = os.path.join(launch_dir, "index.tsv")
  with open(path, "w") as f:
    f.write("\n".join(rows) + "\n")
  return path
