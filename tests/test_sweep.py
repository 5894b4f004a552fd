"""Tests for experiments.sweep: a failing run is recorded, the others run, the exit code is 1."""

import csv
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configs import default  # noqa: E402
from experiments import sweep  # noqa: E402
from offpolicy_jax.run import loop  # noqa: E402
from offpolicy_jax.store import metrics  # noqa: E402


def _fake_run(workdir, steps=3):
  """The metrics a finished run leaves behind, without training."""
  with metrics.MetricsWriter(workdir, tensorboard=False, progress=False) as writer:
    for step in range(1, steps + 1):
      writer.write(step, {"reward_mean": 0.1 * step, "staleness_mean": 0.0, "clip_frac": 0.0})
  return []


def test_failing_run_is_recorded_and_the_others_run(tmp_path, monkeypatch):
  calls = []

  def train_and_evaluate(config, workdir):
    calls.append(os.path.basename(workdir))
    if config.seed == 7:  # fails at run time (bad values are refused before any run)
      raise FloatingPointError("config.sft: every supervised step was skipped")
    return _fake_run(workdir)

  monkeypatch.setattr(loop, "train_and_evaluate", train_and_evaluate)
  runs = [{"name": "a"}, {"name": "broken", "seed": 7}, {"name": "c"}]
  with pytest.raises(sweep.SweepError, match="1 of 3 sweep runs failed: broken") as info:
    sweep.run_sweep(default.get_config(), runs, str(tmp_path), isolation="inline")
  assert calls == ["a", "broken", "c"]
  error = info.value.failed["broken"]
  assert list(info.value.failed) == ["broken"]
  assert error == "FloatingPointError: config.sft: every supervised step was skipped"
  assert info.value.summary == str(tmp_path / "summary.md")

  with open(tmp_path / "summary.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert [(r["run"], r["steps"], r["status"], r["error"]) for r in rows] == [
    ("a", "3", "ok", ""),
    ("broken", "0", "failed", error),
    ("c", "3", "ok", ""),
  ]
  assert rows[0]["reward_last_fifth"] == "0.3000"
  md = (tmp_path / "summary.md").read_text().splitlines()
  assert len(md) == 5 and md[0].startswith("| run | steps |")
  assert md[0].endswith("| status | error |") and md[1] == "|---" * (len(rows[0])) + "|"
  assert md[2].startswith("| a | 3 |") and md[2].endswith("| ok |  |")
  assert md[3].startswith("| broken | 0 |") and md[3].endswith(f"| failed | {error} |")
  assert len({line.count("|") for line in md}) == 1  # every row has every column
  assert os.path.getsize(tmp_path / "curves.png") > 1000


def test_a_run_directory_with_other_values_names_the_sweeps_remedy(tmp_path, monkeypatch):
  from offpolicy_jax.store import workdir

  def train_and_evaluate(config, run_dir):
    first = default.get_config().to_dict()
    os.makedirs(run_dir, exist_ok=True)
    first["seed"] = 1  # what the directory's first run recorded
    with open(os.path.join(run_dir, metrics.CONFIG_FILE), "w") as f:
      json.dump(first, f)
    workdir.check_config(run_dir, default.get_config(), step=0)

  monkeypatch.setattr(loop, "train_and_evaluate", train_and_evaluate)
  with pytest.raises(sweep.SweepError) as info:
    sweep.run_sweep(default.get_config(), [{"name": "a"}], str(tmp_path), isolation="inline")
  error = info.value.failed["a"]
  assert "seed: 1 -> 0" in error and "Delete that directory" in error, error
  assert "allow_config_change" not in error


def test_all_runs_ok_returns_the_summary(tmp_path, monkeypatch):
  monkeypatch.setattr(loop, "train_and_evaluate", lambda config, workdir: _fake_run(workdir, 2))
  summary = sweep.run_sweep(
    default.get_config(), [{"seed": 1}, {"seed": 2}], str(tmp_path), isolation="inline"
  )
  assert summary == str(tmp_path / "summary.md")
  text = open(summary).read()
  assert "| seed=1 | 2 |" in text and "| ok |  |" in text and "failed" not in text


def test_bad_override_fails_before_any_run(tmp_path, monkeypatch):
  calls, workdir = [], str(tmp_path)
  monkeypatch.setattr(loop, "train_and_evaluate", lambda config, workdir: calls.append(workdir))
  with pytest.raises(ValueError, match="'optimizer.no_such_field'"):
    sweep.run_sweep(
      default.get_config(),
      [{"seed": 1}, {"optimizer.no_such_field": 1}],
      workdir,
      isolation="inline",
    )
  assert calls == [] and not os.listdir(tmp_path)
  bad_values = [{"name": "ok"}, {"name": "neg", "total_steps": -5}, {"lr": "x", "name": "t"}]
  with pytest.raises(ValueError, match="sweep run neg: config.total_steps"):
    sweep.run_sweep(default.get_config(), bad_values[:2], workdir, isolation="inline")
  with pytest.raises(ValueError, match=r"override 'lr': no such config field"):
    sweep.run_sweep(default.get_config(), bad_values[2:], workdir, isolation="inline")
  with pytest.raises(ValueError, match=r"override optimizer.learning_rate='abc'"):
    sweep.run_sweep(
      default.get_config(), [{"optimizer.learning_rate": "abc"}], workdir, isolation="inline"
    )
  # Fields that do not fit together (a batch that does not split), also before any run.
  split = [{"name": "ok"}, {"name": "split", "train.num_minibatches": 7}]
  with pytest.raises(ValueError, match="sweep run split: config.train.num_minibatches"):
    sweep.run_sweep(default.get_config(), split, workdir, isolation="inline")
  assert calls == [] and not os.listdir(tmp_path)


DRIVER = """
import os
import signal

from offpolicy_jax.run import loop
from offpolicy_jax.store import metrics


# Stands in for training; the worker processes import this file too, so they run it.
def train_and_evaluate(config, workdir):
  sweep_dir = os.path.dirname(workdir)
  with open(os.path.join(sweep_dir, "calls.txt"), "a") as f:
    f.write(os.path.basename(workdir) + "\\n")
  with metrics.MetricsWriter(workdir, tensorboard=False, progress=False) as writer:
    writer.write(1, {"reward_mean": 0.5})
  if not os.path.exists(os.path.join(sweep_dir, "fixed")):
    if config.seed == 2:
      os.kill(os.getpid(), signal.SIGSEGV)  # what XLA did after ~50 runs in one process
    if config.seed == 3:
      raise FloatingPointError("loss | blew up\\nat step 2")
  return []


loop.train_and_evaluate = train_and_evaluate

if __name__ == "__main__":
  from experiments import sweep
  from offpolicy_jax import cli

  cli.run(sweep.main)
"""

SWEEP_CONFIG = """
from configs import default


def get_config():
  return default.get_config()


def get_sweep():
  return [{"name": "first", "seed": 1}, {"name": "middle", "seed": 2}, {"name": "last", "seed": 3}]
"""


def test_a_crashed_run_costs_that_run_only_and_a_rerun_retries_it(tmp_path):
  """Worker processes: a segfault and an exception fail their runs; the others and a rerun go on."""
  (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
  (tmp_path / "sweep_config.py").write_text(textwrap.dedent(SWEEP_CONFIG))
  workdir = tmp_path / "runs"
  env = {**os.environ, "PYTHONPATH": REPO}
  cmd = [
    sys.executable,
    str(tmp_path / "driver.py"),
    f"--config={tmp_path / 'sweep_config.py'}",
    f"--workdir={workdir}",
  ]
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  summary = str(workdir / "summary.md")
  assert f"2 of 3 sweep runs failed: middle, last (see {summary})" in out.stderr
  assert "  middle: killed by SIGSEGV" in out.stderr
  assert "  last: exit status 1: FloatingPointError: loss | blew up at step 2" in out.stderr
  assert "sweep run first done" in out.stdout
  assert "sweep: 3/3 done (2 failed), 0 to go" in out.stdout
  assert "sweep: 1/3 done, 2 to go, ETA" in out.stdout
  # The summary is printed: every run, the failed ones with their escaped errors.
  assert "| first | 1 |" in out.stdout and "| middle | 1 |" in out.stdout
  assert r"| failed | exit status 1: FloatingPointError: loss \| blew up at step 2 |" in out.stdout
  assert open(summary).read() in out.stdout
  assert "Traceback" in (workdir / "last" / "sweep_run.log").read_text()

  (workdir / "fixed").write_text("")
  again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "sweep run first skipped (done before)" in again.stdout
  calls = (workdir / "calls.txt").read_text().split()
  assert calls == ["first", "middle", "last", "middle", "last"]  # only the failed ones again
  assert "failed" not in (workdir / "summary.md").read_text()
