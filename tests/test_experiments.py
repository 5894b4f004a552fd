"""Tests for the binaries and configs: SIGKILL + resume, sweep, eval, config files."""

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.append(os.path.join(REPO, "benchmarks"))  # gsm8k_path: a tiny HF checkpoint

import gsm8k_path  # noqa: E402
from test_loop import small_config, strip_timing  # noqa: E402

from experiments import sweep  # noqa: E402
from offpolicy_jax import errors  # noqa: E402
from offpolicy_jax.run import loop, start  # noqa: E402
from offpolicy_jax.store import metrics_files  # noqa: E402
from offpolicy_jax.store import workdir as workdir_lib  # noqa: E402
from offpolicy_jax.study import reports, sweeps  # noqa: E402

# The command-line twin of test_loop.small_config(total_steps=40, checkpoint_every=4, ...):
# no warm start and no evaluation, so the subprocesses compile only the RL step.
SMALL_FLAGS = {
  "task": "reverse",
  "total_steps": 40,
  "prompts_per_step": 2,
  "group_size": 4,
  "max_new_tokens": 6,
  "max_prompt_len": 12,
  "replay.capacity_batches": 1,
  "sft.enabled": False,
  "eval_prompts": 0,
  "eval_every": 0,
  "checkpoint_every": 4,
  "progress": False,
  "tensorboard": False,
}


def _train_cmd(workdir):
  flags = [f"--config.{k}={v}" for k, v in SMALL_FLAGS.items()]
  return [
    sys.executable,
    "-m",
    "experiments.train",
    "--config=configs/default.py",
    f"--workdir={workdir}",
    *flags,
  ]


def _last_step(workdir):
  train, _ = metrics_files.split_rows(metrics_files.read_metrics(workdir))
  return train[-1]["step"] if train else 0


def _run_until(cmd, env, workdir, step, sig):
  """Starts `cmd`, sends `sig` once metrics reach `step`; returns (exit code, stderr)."""
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 240
  try:
    while _last_step(workdir) < step:
      assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
      assert time.time() < deadline, "training subprocess made no progress"
      time.sleep(0.02)
  except BaseException:
    proc.kill()  # a failed wait leaves no run training beside the rest of the suite
    proc.wait()
    raise
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=240)
  return proc.returncode, err.decode()


def _checkpoint_steps(workdir):
  return sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())


def test_signals_and_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
  """SIGTERM saves and exits 143, SIGKILL loses at most the steps since a checkpoint,
  SIGINT saves and exits 130; the run resumed after each equals the uninterrupted one."""
  workdir = str(tmp_path / "killed")
  # The subprocesses share the session's compilation cache (conftest.py): each restart
  # loads the programs the first one (or an earlier test) compiled.
  env = dict(os.environ)
  cmd = _train_cmd(workdir)
  # Checkpoints fall every 4 steps; a signal's checkpoint lands where the run stops.
  for sig, at in ((signal.SIGTERM, 5), (signal.SIGKILL, 14), (signal.SIGINT, 25)):
    code, err = _run_until(cmd, env, workdir, at, sig)
    stopped_at = _last_step(workdir)
    if sig == signal.SIGKILL:
      assert code == -signal.SIGKILL
      assert 14 <= stopped_at < 40
      continue
    assert code == 128 + sig, err[-3000:]
    name = signal.Signals(sig).name
    lines = [x for x in err.splitlines() if x.strip() and "%|" not in x]
    assert lines == [
      f"{name}: finishing the steps in flight (up to 2 steps run as one program), then saving"
      " (a second signal stops at once)",
      f"stopped at step {stopped_at}; the same command resumes",
    ], err[-3000:]
    assert at <= stopped_at < 40
    assert _checkpoint_steps(workdir)[-1] == stopped_at  # saved at the signal, not before

  # While the restarted subprocess compiles, compute the uninterrupted reference here.
  resumed = subprocess.Popen(
    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
  )
  cfg = small_config(
    **{
      "total_steps": 40,
      "checkpoint_every": 4,
      "async_checkpoint": True,
      "sft.enabled": False,
      "eval_prompts": 0,
    }
  )
  reference = loop.train_and_evaluate(cfg, str(tmp_path / "reference"))
  out, _ = resumed.communicate(timeout=240)
  assert resumed.returncode == 0, out.decode()[-3000:]
  assert f"resumed from step {stopped_at} of 40 in {workdir}" in out.decode()

  got_train, got_eval = metrics_files.split_rows(metrics_files.read_metrics(workdir))
  want_train, want_eval = metrics_files.split_rows(reference)
  assert [r["step"] for r in got_train] == list(range(1, 41))  # no duplicates, no gaps
  assert strip_timing(got_train) == strip_timing(want_train)
  assert got_eval == want_eval


def test_sweep_runs_and_writes_summary(tmp_path):
  # No warm start: each worker process would build and run its program for nothing checked here.
  base = small_config(total_steps=3, checkpoint_every=0, eval_prompts=4, **{"sft.enabled": False})
  runs = [
    {"name": "onpolicy", "lag.sync_interval": 1},
    {"name": "offline", "lag.sync_interval": 1000},
  ]
  summary = sweep.run_sweep(base, runs, str(tmp_path))
  text = open(summary).read()
  assert "| onpolicy | 3 |" in text and "| offline | 3 |" in text
  assert "eval/accuracy" in text
  assert os.path.getsize(tmp_path / "curves.png") > 1000
  assert os.path.exists(tmp_path / "summary.csv")
  staleness = reports.summarize_run(str(tmp_path / "offline"))["staleness_mean"]
  assert staleness == pytest.approx((0 + 1 + 2) / 3)


def test_sweep_print_only_lists_lag_study_commands():
  out = (
    subprocess.run(
      [
        sys.executable,
        "-m",
        "experiments.sweep",
        "--config=configs/lag_study.py",
        "--workdir=/tmp/unused",
        "--print_only",
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=120,
      check=True,
    )
    .stdout.strip()
    .splitlines()
  )
  methods = len(_load("lag_study").METHODS.split(","))
  assert len(out) == methods * 5  # methods x lags of the study grid, one seed
  assert all("-m experiments.train" in line for line in out)
  assert sum("--config.lag.sync_offset=10" in line for line in out) == methods  # one per method


def test_evaluate_checkpoint(tmp_path):
  cfg = small_config(total_steps=2)
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  final_eval = [r for r in rows if "eval/accuracy" in r][-1]
  result = start.evaluate_checkpoint(cfg, str(tmp_path))
  assert result["step"] == 2
  assert result["eval/accuracy"] == final_eval["eval/accuracy"]
  assert "eval/pass@2" in result
  # Without a config, the run's recorded one; a config that is another run is refused by name.
  assert start.evaluate_checkpoint(None, str(tmp_path)) == result
  other = small_config(total_steps=2, task="sort")
  with pytest.raises(errors.ConfigError, match=f"task: run '{cfg.task}', given '{other.task}'"):
    start.evaluate_checkpoint(other, str(tmp_path))


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
  "name", ["default", "gsm8k_qwen25_1p5b", "math_qwen25", "lag_study", "code"]
)
def test_configs_are_locked_and_complete(name):
  cfg = _load(name).get_config()
  assert isinstance(cfg, ml_collections.ConfigDict)
  with pytest.raises(AttributeError):
    cfg.no_such_field = 1
  for field in (
    "seed",
    "total_steps",
    "loss.name",
    "advantage.name",
    "lag.sync_interval",
    "lag.sync_offset",
    "lag.mode",
    "lag.max_staleness",
    "group_size",
    "prompts_per_step",
    "checkpoint_every",
    "model",
    "task",
    "eval_every",
    "sft.enabled",
    "optimizer.learning_rate",
    "mesh.data",
  ):
    node = cfg
    for part in field.split("."):
      node = node[part]


def test_paper_gsm8k_setting():
  cfg = _load("gsm8k_qwen25_1p5b").get_config()
  assert (cfg.group_size, cfg.prompts_per_step, cfg.max_new_tokens) == (8, 96, 1024)
  assert cfg.optimizer.learning_rate == 1e-6 and cfg.lag.sync_interval == 20
  assert cfg.task == "gsm8k" and "Qwen2.5-1.5B-Instruct" in cfg.model
  assert cfg.model_scan_layers and cfg.model_remat and cfg.model_dtype == "bfloat16"


def test_lag_study_sweep_covers_presets_and_lags():
  module = _load("lag_study")
  runs = module.get_sweep()
  lags = {(r["lag.sync_interval"], r["lag.sync_offset"]) for r in runs}
  base = module.get_config()
  assert lags == {(1, 0), (20, 0), (1, 10), (1, 32), (base.total_steps + 1, 0)}
  assert {r["loss.name"] for r in runs} >= {"reinforce", "grpo", "rec_oneside_nois", "opmd"}
  assert {"reinforce"} == {r["loss.name"] for r in runs if r.get("advantage.name") == "red_drop"}
  for r in runs:  # every override names a real field
    sweeps.apply_overrides(base, r)


def test_what_lag_buys_sweep_pairs_every_setting_over_the_same_seeds():
  from offpolicy_jax.run import validation
  from offpolicy_jax.study import paired_runs

  module = _load("what_lag_buys")
  runs, base = module.get_sweep(), module.get_config()
  groups = {}
  for r in runs:
    m = paired_runs.RUN_NAME.match(r["name"])
    assert m and int(m["seed"]) == r["seed"]
    groups.setdefault(m["group"], set()).add(r["seed"])
    validation.validate_settings(sweeps.apply_overrides(base, r))
  assert (
    set(groups) == {"sync", "async", "async_t4"} and len(set(map(frozenset, groups.values()))) == 1
  )
  assert len(groups["sync"]) >= 8


def test_paper_gsm8k_config_runs_at_toy_scale(tmp_path):
  """The GSM8K config end to end: local HF dir, chat template, host math-verify rewards."""
  import json

  hf = str(tmp_path / "hf")
  # A tiny Qwen2-format checkpoint + BPE tokenizer with a chat template (the benchmark's own).
  texts = ["What is 12 + 7? <think>add</think><answer>19</answer>"] * 5
  gsm8k_path.write_checkpoint(hf, "tiny", texts)
  data = tmp_path / "gsm8k.jsonl"
  rows = [{"question": f"What is {a} + 7?", "answer": f"... #### {a + 7}"} for a in range(8)]
  data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  cfg = _load("gsm8k_qwen25_1p5b").get_config()
  overrides = {
    "model": hf,
    "tokenizer": hf,
    "task_kwargs.train_path": str(data),
    "task_kwargs.eval_path": str(data),
    "total_steps": 2,
    "prompts_per_step": 4,
    "group_size": 2,
    "max_new_tokens": 8,
    "max_prompt_len": 256,
    "train.micro_batch_size": 4,
    "eval_prompts": 4,
    "eval_every": 0,
    "checkpoint_every": 0,
    "progress": False,
    "tensorboard": False,
  }
  cfg = sweeps.apply_overrides(cfg, overrides)
  out = loop.train_and_evaluate(cfg, str(tmp_path / "run"))
  train, evals = metrics_files.split_rows(out)
  assert [r["step"] for r in train] == [1, 2]
  assert all(r["reward_failures"] == 0 for r in train)
  # Untrained: wrong answers without the think/answer format score -0.1.
  assert all(r["reward_mean"] == pytest.approx(-0.1) for r in train)
  assert train[-1]["staleness_max"] == 1  # sync_interval 20: step 2 used version 0
  assert "eval/accuracy" in evals[-1]
  # experiments.eval on the HF directory itself (no workdir): step 0, same metrics keys.
  direct = start.evaluate_checkpoint(cfg)
  assert direct["step"] == 0 and direct["eval/accuracy"] == 0.0


@pytest.mark.parametrize(
  "args,env,want",
  [
    ([], {}, None),
    (["--multihost"], {}, {}),
    (
      ["--coordinator_address=10.0.0.1:1234", "--num_processes=4", "--process_id=2"],
      {},
      {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2},
    ),
    (
      [],
      {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
      {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1},
    ),
  ],
)
def test_train_initializes_jax_distributed_only_when_asked(args, env, want):
  code = (
    "import sys; from experiments import train; "
    "train.flags.FLAGS(sys.argv); print(repr(train._distributed_kwargs()))"
  )
  argv = ["--config=configs/default.py", "--workdir=unused", *args]
  clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  out = subprocess.run(
    [sys.executable, "-c", code, *argv],
    cwd=REPO,
    env={**clean, **env},
    capture_output=True,
    text=True,
    check=True,
  )
  assert out.stdout.strip() == repr(want)


def test_code_config_runs_with_sandboxed_program_rewards(tmp_path):
  """The code config end to end at a few steps: its warm start, programs scored in the
  verifier workers, a row per step and an evaluation (that it learns: the slow test below)."""
  cfg = sweeps.apply_overrides(
    _load("code").get_config(),
    {
      "total_steps": 3,
      "sft.steps": 4,
      "eval_prompts": 8,
      "eval_samples": 1,
      "eval_every": 3,
      "checkpoint_every": 0,
      "progress": False,
      "tensorboard": False,
    },
  )
  train, evals = metrics_files.split_rows(loop.train_and_evaluate(cfg, str(tmp_path)))
  assert [r["step"] for r in train] == [1, 2, 3]
  assert all(r["reward_time_s"] > 0 and r["reward_failures"] == 0 for r in train)
  assert [r["step"] for r in evals] == [0, 3] and evals[-1]["eval/reward_failures"] == 0


# About 200 s (a 150-step warm start, 100 steps of 64 programs each in the sandbox); the
# plumbing is the test above, the learning on this task the code lag study
# (docs/results/lag_study.md). Run with -m slow.
@pytest.mark.slow
def test_code_config_learns_with_sandboxed_program_rewards(tmp_path):
  """The code task: programs scored in verifier workers; the reward rises over 100 steps."""
  cfg = _load("code").get_config()
  cfg.total_steps = 100
  cfg.eval_prompts = 0
  cfg.checkpoint_every = 0
  cfg.progress = False
  cfg.tensorboard = False
  train, _ = metrics_files.split_rows(loop.train_and_evaluate(cfg, str(tmp_path)))
  assert [r["step"] for r in train] == list(range(1, 101))
  first = np.mean([r["reward_mean"] for r in train[:25]])
  last = np.mean([r["reward_mean"] for r in train[-25:]])
  assert last > first + 0.03, (first, last)
  assert all(r["reward_time_s"] > 0 and r["reward_failures"] == 0 for r in train)


# ------------------------------------------- what a run survives (one test per case)


def _quick(**overrides):
  base = {"sft.enabled": False, "eval_prompts": 0, "checkpoint_every": 3}
  return small_config(**{**base, **overrides})


def _steps(workdir):
  train, _ = metrics_files.split_rows(metrics_files.read_metrics(str(workdir)))
  return [r["step"] for r in train]


def test_torn_middle_line_keeps_later_rows_through_a_resume(tmp_path):
  loop.train_and_evaluate(_quick(total_steps=6), str(tmp_path))
  path = tmp_path / "metrics.jsonl"
  lines = path.read_text().splitlines()
  lines[1] = lines[1][: len(lines[1]) // 2]  # the row of step 2, torn
  path.write_text("\n".join(lines) + "\n")
  with pytest.warns(UserWarning, match="unreadable line"):
    loop.train_and_evaluate(_quick(total_steps=9), str(tmp_path))
  assert _steps(tmp_path) == [1, 3, 4, 5, 6, 7, 8, 9]  # only the torn row is gone
  assert (tmp_path / "metrics.jsonl.bad").read_text().strip() == lines[1].strip()


def test_second_training_in_a_workdir_is_refused_naming_the_holder(tmp_path):
  workdir = str(tmp_path)
  flags = {**SMALL_FLAGS, "total_steps": 100000}
  cmd = [
    sys.executable,
    "-m",
    "experiments.train",
    "--config=configs/default.py",
    f"--workdir={workdir}",
    *[f"--config.{k}={v}" for k, v in flags.items()],
  ]
  first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    deadline = time.time() + 240
    while _last_step(workdir) < 1:
      assert first.poll() is None, first.stderr.read().decode()[-3000:]
      assert time.time() < deadline
      time.sleep(0.05)
    with pytest.raises(workdir_lib.WorkdirLocked, match=f"{workdir}.*pid {first.pid}"):
      loop.train_and_evaluate(_quick(), workdir)
    assert first.poll() is None  # the first run goes on, untouched
  finally:
    first.kill()
    first.wait()


def test_metrics_file_deleted_mid_run_is_recreated_and_later_rows_land(tmp_path):
  def delete_at_3(step, row):
    if step == 3:
      os.remove(tmp_path / "metrics.jsonl")

  with pytest.warns(UserWarning, match="was deleted"):
    loop.train_and_evaluate(_quick(total_steps=6), str(tmp_path), on_step=delete_at_3)
  assert _steps(tmp_path) == [4, 5, 6]


def test_resume_with_a_changed_config_is_refused_or_recorded(tmp_path):
  loop.train_and_evaluate(_quick(total_steps=3), str(tmp_path))
  record = (tmp_path / "config.json").read_text()
  changed = _quick(total_steps=6, **{"loss.name": "grpo"})
  with pytest.raises(workdir_lib.ConfigChanged, match="loss.name: 'rec_oneside_nois' -> 'grpo'"):
    loop.train_and_evaluate(changed, str(tmp_path))
  assert (tmp_path / "config.json").read_text() == record and _steps(tmp_path) == [1, 2, 3]
  loop.train_and_evaluate(changed, str(tmp_path), allow_config_change=True)
  (entry,) = [json.loads(line) for line in open(tmp_path / "config_history.jsonl")]
  assert entry["step"] == 3 and entry["changes"]["loss.name"] == ["rec_oneside_nois", "grpo"]
  assert _steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def _data_files(step_dir):
  return [
    os.path.join(d, f)
    for d, _, files in os.walk(step_dir)
    for f in files
    if "/params/" in os.path.join(d, f) and os.path.getsize(os.path.join(d, f)) > 64
  ]


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
  full = loop.train_and_evaluate(_quick(total_steps=9), str(tmp_path / "full"))
  loop.train_and_evaluate(_quick(total_steps=6), str(tmp_path / "run"))
  target = max(_data_files(tmp_path / "run" / "checkpoints" / "6"), key=os.path.getsize)
  size = os.path.getsize(target)
  with open(target, "r+b") as f:  # same-size garbage
    f.seek(size // 2)
    f.write(b"\xff" * 16)
  assert os.path.getsize(target) == size
  with caplog.at_level("WARNING"):
    rows = loop.train_and_evaluate(_quick(total_steps=9), str(tmp_path / "run"))
  assert "checkpoint step 6 is corrupt" in caplog.text and "falling back to step 3" in caplog.text
  assert [r["step"] for r in rows] == [4, 5, 6, 7, 8, 9]  # redone from the intact step
  assert strip_timing(metrics_files.read_metrics(str(tmp_path / "run"))) == strip_timing(full)


def test_fresh_start_moves_old_metrics_aside_instead_of_deleting_them(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "config_history.jsonl").write_text('{"step": 6}\n')
  loop.train_and_evaluate(_quick(total_steps=2), str(tmp_path))
  (previous,) = os.listdir(tmp_path / "previous")
  kept = tmp_path / "previous" / previous
  assert (kept / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'
  assert (kept / "config_history.jsonl").exists() and not (
    tmp_path / "config_history.jsonl"
  ).exists()
  assert _steps(tmp_path) == [1, 2]


def test_corrupt_config_record_names_the_file(tmp_path):
  loop.train_and_evaluate(_quick(total_steps=3), str(tmp_path))
  (tmp_path / "config.json").write_text('{"seed": 0,')
  with pytest.raises(ValueError, match=r"config.json: invalid JSON"):
    loop.train_and_evaluate(_quick(total_steps=6), str(tmp_path))


def _long_prompt_task():
  """`reverse`-style rows; from row 47 on, prompts far longer than max_prompt_len."""
  from offpolicy_jax.rewards import tasks
  from offpolicy_jax.rewards.tasks import synthetic

  rows = [{"prompt": f"rev:{i:03d}=", "answer": f"{i:03d}"[::-1]} for i in range(60)]
  for row in rows[47:]:
    row["prompt"] = "rev:" + "9" * 40 + row["prompt"][4:]
  reverse = synthetic.make_task("reverse")
  return dataclasses.replace(
    reverse,
    name="long_prompts",
    train_source=tasks.ListSource(rows),
    eval_source=tasks.ListSource(rows),
  )


def test_prompt_too_long_deep_in_the_data_fails_at_start_up_or_is_truncated(tmp_path):
  from offpolicy_jax.rewards import tasks

  if "test_long_prompts" not in tasks.task_names():
    tasks.register("test_long_prompts", _long_prompt_task)
  common = {"task": "test_long_prompts", "max_prompt_len": 12, "total_steps": 6}
  with pytest.raises(ValueError, match=r"max_prompt_len.*47"):
    loop.train_and_evaluate(_quick(**common), str(tmp_path / "a"))
  assert not os.path.exists(tmp_path / "a" / "metrics.jsonl")
  rows = loop.train_and_evaluate(
    _quick(**common, **{"data.truncate_prompts": True}), str(tmp_path / "b")
  )
  assert [r["step"] for r in rows] == list(range(1, 7))
  assert sum(r["prompts_truncated"] for r in rows) > 0


@pytest.mark.parametrize(
  "field,value",
  [
    ("optimizer.learning_rate", float("inf")),
    ("optimizer.learning_rate", 1e39),  # finite in Python, inf in float32
    ("sft.learning_rate", float("nan")),
    ("optimizer.grad_clip", -1.0),
    ("optimizer.b1", 1.5),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("eval_samples", 0),
    ("reward_timeout", float("inf")),
  ],
)
def test_bad_values_fail_at_start_up_naming_the_field(tmp_path, field, value):
  with pytest.raises(ValueError, match=f"config.{field}"):
    loop.train_and_evaluate(_quick(**{field: value}), str(tmp_path))
  assert not os.path.exists(tmp_path / "metrics.jsonl")
