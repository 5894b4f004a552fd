"""Tests for offpolicy_jax.launchers and `experiments.sweep --launcher`.

The generated scripts are parsed, checked by `bash -n`, and run with stub
`python`, `srun` and `scontrol` programs that only record their arguments, so
each process's train flags are checked exactly as a cluster would expand them.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configs import lag_study  # noqa: E402
from offpolicy_jax.study import launchers  # noqa: E402

HOSTS = 4
PORT = 9123
SWEEP = [
  {"name": "grpo-onpolicy", "loss.name": "grpo", "lag.sync_interval": 1},
  {"name": "grpo-offline", "loss.name": "grpo", "lag.sync_interval": 1_000_000},
  # A value the shell must not expand or split.
  {"name": "Odd_Name.2", "task.prompt": 'it\'s $HOME; `ls` "x"'},
]
CLI = ["--config.total_steps=5"]
CLUSTER = launchers.Cluster(
  hosts=HOSTS,
  coordinator_port=PORT,
  image="registry.example/opj:1",
  tpu_type="tpu-v5-lite-podslice",
  tpu_topology="4x4",
  chips_per_host=4,
  slurm_partition="batch",
  slurm_gres="gpu:8",
)
_SEP = "\x1f"


def _runs(workdir="/shared/sweep"):
  return launchers.make_runs(SWEEP, "configs/lag_study.py", workdir, CLI)


def _stubs(tmp_path):
  """A directory of stub programs; the stub python prints its arguments on one line."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  stubs = {
    "python": f"#!/bin/bash\nprintf '%s{_SEP}' \"$@\"\nprintf '\\n'\n",
    "scontrol": "#!/bin/bash\nprintf 'node-7\\nnode-8\\nnode-9\\nnode-10\\n'\n",
    # Runs the command once per task with SLURM_PROCID set, as srun does on each node.
    "srun": (
      "#!/bin/bash\nn=1\nwhile [[ $1 == --* ]]; do\n"
      "  case $1 in --ntasks=*) n=${1#--ntasks=} ;; esac\n  shift\ndone\n"
      'for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@"; done\n'
    ),
  }
  for name, text in stubs.items():
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  return bin_dir


def _run_bash(args, bin_dir, **env):
  """Runs bash with the stubs first on PATH; returns the recorded argv of each process."""
  full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
  out = subprocess.run(
    ["bash", *args], env=full_env, capture_output=True, text=True, check=True, timeout=30
  ).stdout
  return [line.split(_SEP)[:-1] for line in out.splitlines()]


def _multihost_argv(run, coordinator, process_id):
  return [
    "-m",
    "experiments.train",
    *run.flags,
    "--multihost",
    f"--coordinator_address={coordinator}:{PORT}",
    f"--num_processes={HOSTS}",
    f"--process_id={process_id}",
  ]


def _bash_n(path):
  subprocess.run(["bash", "-n", str(path)], check=True, capture_output=True, timeout=30)


def test_runs_have_distinct_workdirs_and_their_own_flags():
  runs = _runs()
  assert [r.name for r in runs] == ["grpo-onpolicy", "grpo-offline", "Odd_Name.2"]
  assert len({r.workdir for r in runs}) == len(runs)
  for run, overrides in zip(runs, SWEEP, strict=True):
    assert run.workdir == f"/shared/sweep/{run.name}"
    own = [f"--config.{k}={v}" for k, v in overrides.items() if k != "name"]
    assert list(run.flags) == [
      "--config=configs/lag_study.py",
      f"--workdir={run.workdir}",
      *CLI,
      *own,
    ]


def test_unnamed_runs_take_their_names_from_the_overrides():
  runs = launchers.make_runs([{"loss.name": "grpo"}, {"loss.name": "ppo"}], "c.py", "w")
  assert [r.workdir for r in runs] == ["w/name=grpo", "w/name=ppo"]


def test_local_commands_round_trip_through_shlex():
  runs = _runs()
  lines = launchers.local_commands(runs, CLUSTER).splitlines()
  assert [shlex.split(line) for line in lines] == [
    ["python", "-m", "experiments.train", *r.flags] for r in runs
  ]


@pytest.mark.parametrize(
  "launcher,suffix", [("local", ".sh"), ("hosts", ".sh"), ("slurm", ".sbatch"), ("jobset", ".yaml")]
)
def test_one_file_per_run(launcher, suffix):
  files = launchers.render(launcher, _runs(), CLUSTER)
  assert list(files) == [r.name + suffix for r in _runs()]


def test_local_script_runs_the_train_command(tmp_path):
  bin_dir = _stubs(tmp_path)
  for run in _runs():
    path = tmp_path / f"{run.name}.sh"
    path.write_text(launchers.local_script(run, CLUSTER))
    _bash_n(path)
    assert _run_bash([str(path)], bin_dir) == [["-m", "experiments.train", *run.flags]]


def test_hosts_script_lists_one_command_per_host(tmp_path):
  bin_dir = _stubs(tmp_path)
  for run in _runs():
    path = tmp_path / f"{run.name}.sh"
    text = launchers.hosts_script(run, CLUSTER)
    path.write_text(text)
    _bash_n(path)
    cases = re.findall(r"^  (\d+)\) exec (.*) ;;$", text, flags=re.M)
    assert [int(i) for i, _ in cases] == list(range(HOSTS))
    for i, command in cases:
      assert shlex.split(command) == ["python", *_multihost_argv(run, "${COORD}", i)]
      got = _run_bash([str(path), i], bin_dir, COORD="10.0.0.2")
      assert got == [_multihost_argv(run, "10.0.0.2", i)]


@pytest.mark.parametrize(
  "args,coord,message",
  [(["0"], None, "set COORD"), ([], "h", "usage"), ([str(HOSTS)], "h", "process id must be")],
)
def test_hosts_script_refuses_a_missing_coordinator_or_a_bad_process_id(
  tmp_path, args, coord, message
):
  path = tmp_path / "run.sh"
  path.write_text(launchers.hosts_script(_runs()[0], CLUSTER))
  env = {k: v for k, v in os.environ.items() if k != "COORD"}
  env["PATH"] = f"{_stubs(tmp_path)}:{env['PATH']}"
  if coord:
    env["COORD"] = coord
  result = subprocess.run(["bash", str(path), *args], env=env, capture_output=True, text=True)
  assert result.returncode != 0 and result.stdout == ""
  assert message in result.stderr


def test_slurm_script_one_task_per_node_coordinator_from_the_first_node(tmp_path):
  bin_dir = _stubs(tmp_path)
  for run in _runs():
    path = tmp_path / f"{run.name}.sbatch"
    text = launchers.slurm_script(run, CLUSTER)
    path.write_text(text)
    _bash_n(path)
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=(.*)$", text, flags=re.M))
    assert directives["job-name"] == run.name
    assert directives["nodes"] == str(HOSTS) and directives["ntasks-per-node"] == "1"
    assert directives["partition"] == "batch" and directives["gres"] == "gpu:8"
    assert "scontrol show hostnames" in text and "SLURM_JOB_NODELIST" in text
    (srun_line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    srun = shlex.split(srun_line)
    assert f"--ntasks={HOSTS}" in srun and srun[-3:-1] == ["bash", "-c"]
    inner = shlex.split(srun[-1])
    assert inner == ["exec", "python", *_multihost_argv(run, "${COORD}", "${SLURM_PROCID}")]
    got = _run_bash([str(path)], bin_dir, SLURM_JOB_NODELIST="node-[7-10]")
    assert got == [_multihost_argv(run, "node-7", i) for i in range(HOSTS)]


def test_jobset_is_an_indexed_job_on_one_tpu_slice(tmp_path):
  bin_dir = _stubs(tmp_path)
  names = set()
  for run in _runs():
    spec = yaml.safe_load(launchers.jobset_yaml(run, CLUSTER))
    assert spec["apiVersion"].startswith("jobset.x-k8s.io/") and spec["kind"] == "JobSet"
    name = spec["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([a-z0-9-]{0,38}[a-z0-9])?", name)
    names.add(name)
    assert spec["metadata"]["annotations"]["offpolicy-jax/workdir"] == run.workdir
    (rjob,) = spec["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == 1
    assert job["parallelism"] == job["completions"] == HOSTS
    assert job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
      "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
      "cloud.google.com/gke-tpu-topology": "4x4",
    }
    (container,) = pod["containers"]
    assert container["image"] == CLUSTER.image
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert container["ports"][0]["containerPort"] == PORT
    # The coordinator is pod 0 of job 0 of this JobSet, under its headless service.
    coordinator = f"{name}-{rjob['name']}-0-0.{name}"
    assert coordinator == launchers.coordinator_dns(run)
    assert container["command"][:2] == ["bash", "-c"]
    inner = container["command"][2]
    want = _multihost_argv(run, coordinator, "${JOB_COMPLETION_INDEX}")
    assert shlex.split(inner) == ["exec", "python", *want]
    for i in range(HOSTS):
      got = _run_bash(["-c", inner], bin_dir, JOB_COMPLETION_INDEX=str(i))
      assert got == [_multihost_argv(run, coordinator, i)]
  assert len(names) == len(SWEEP)


def test_kubernetes_names_of_similar_runs_differ():
  names = ["a_b", "a.b", "A-B", "a-b", "x" * 80, "x" * 81, "9lives"]
  labels = [launchers.k8s_name(n) for n in names]
  assert len(set(labels)) == len(names)
  assert launchers.k8s_name("grpo-onpolicy") == "grpo-onpolicy"
  assert all(re.fullmatch(r"[a-z]([a-z0-9-]{0,38}[a-z0-9])?", label) for label in labels)


@pytest.mark.parametrize(
  "launcher,changes,field",
  [
    ("hosts", {"hosts": 0}, "hosts"),
    ("slurm", {"coordinator_port": 0}, "coordinator_port"),
    ("hosts", {"coordinator_port": 65536}, "coordinator_port"),
    ("srun", {}, "launcher"),
    ("slurm", {"slurm_partition": "a b"}, "slurm_partition"),
    ("slurm", {"slurm_time": "1:00\n#SBATCH --x"}, "slurm_time"),
    ("jobset", {"image": ""}, "image"),
    ("jobset", {"tpu_topology": "4by4"}, "tpu_topology"),
    ("jobset", {"hosts": 2}, "hosts"),
  ],
)
def test_bad_cluster_raises_naming_the_field(launcher, changes, field):
  with pytest.raises(ValueError, match=f"^{field}:"):
    launchers.render(launcher, _runs(), CLUSTER._replace(**changes))


@pytest.mark.parametrize("name", ["a/b", "..", "-x", "a b", "it's", ""])
def test_unsafe_run_name_raises_naming_the_field(name):
  with pytest.raises(ValueError, match="^name:"):
    launchers.make_runs([{"name": name}], "c.py", "w")


def test_repeated_run_names_raise():
  with pytest.raises(ValueError, match="^name: .*'a'"):
    launchers.make_runs([{"name": "a"}, {"name": "b"}, {"name": "a"}], "c.py", "w")


def test_write_puts_one_file_per_run_and_an_index(tmp_path):
  runs = _runs()
  index = launchers.write(str(tmp_path / "out"), "jobset", runs, CLUSTER)
  rows = [line.split("\t") for line in open(index).read().splitlines()]
  assert rows[0] == ["run", "workdir", "file", "launch"]
  assert [(r[0], r[1], r[2]) for r in rows[1:]] == [
    (r.name, r.workdir, r.name + ".yaml") for r in runs
  ]
  assert sorted(os.listdir(tmp_path / "out")) == sorted(["index.tsv", *(r[2] for r in rows[1:])])


def _sweep_binary(*args):
  return subprocess.run(
    [sys.executable, "-m", "experiments.sweep", "--config=configs/lag_study.py", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )


def test_sweep_binary_writes_slurm_scripts_and_runs_nothing(tmp_path):
  workdir, launch_dir = tmp_path / "runs", tmp_path / "launch"
  out = _sweep_binary(
    f"--workdir={workdir}", "--launcher=slurm", f"--launch_dir={launch_dir}", "--hosts=2"
  )
  assert out.stdout.strip() == str(launch_dir / "index.tsv")
  rows = open(launch_dir / "index.tsv").read().splitlines()[1:]
  files = [row.split("\t")[2] for row in rows]
  runs = len(lag_study.get_sweep())
  assert len(files) == runs and len(set(files)) == runs
  assert sorted(os.listdir(launch_dir)) == sorted(["index.tsv", *files])
  for file in files:
    _bash_n(launch_dir / file)
    text = open(launch_dir / file).read()
    assert "#SBATCH --nodes=2\n" in text and "--num_processes=2" in text
  assert not workdir.exists()


def test_print_only_equals_the_local_launcher():
  local = _sweep_binary("--workdir=/w", "--launcher=local").stdout
  assert _sweep_binary("--workdir=/w", "--print_only").stdout == local
  assert len(local.splitlines()) == len(lag_study.get_sweep())
