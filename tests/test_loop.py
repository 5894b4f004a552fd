"""Tests for offpolicy_jax.loop: end-to-end runs, lag schedule, recompilation, failures."""

import dataclasses
import json
import os
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from offpolicy_jax.rewards import tasks  # noqa: E402
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.run import components, loop, observability, validation  # noqa: E402
from offpolicy_jax.store import checkpointing, metrics, metrics_files  # noqa: E402
from offpolicy_jax.study import reports  # noqa: E402

REQUIRED = (
  "step",
  "reward_mean",
  "loss",
  "staleness_mean",
  "staleness_max",
  "clip_frac",
  "entropy",
  "tokens_per_s",
  "reward_std",
  "accuracy",
  "response_len",
  "kl_k1",
  "kl_k3",
  "ratio_mean",
  "ratio_max",
  "ratio_min",
  "ess",
  "grad_norm",
  "skipped",
  "reward_failures",
  "reward_timeouts",
  "reward_worker_restarts",
  "reward_time_s",
)
# Wall-clock metrics differ between runs; everything else must match exactly.
TIMING = ("tokens_per_s", "step_time_s", "compiles")


def small_config(**overrides):
  """A tiny run: 2 prompts x 4 responses, 6-token responses, a 3-step warm start."""
  c = default.base_config()
  c.task = "reverse"
  c.total_steps = 6
  c.prompts_per_step = 2
  c.group_size = 4
  c.max_new_tokens = 6
  c.max_prompt_len = 12
  c.replay.capacity_batches = 1
  c.sft.steps = 3
  c.sft.batch_size = 8
  c.eval_every = 0
  c.eval_prompts = 4
  c.eval_samples = 2
  c.checkpoint_every = 3
  c.async_checkpoint = False
  c.progress = False
  c.tensorboard = False
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  c.lock()
  return c


def strip_timing(rows):
  return [
    {k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")} for r in rows
  ]


def full_and_resumed(tmp_path, **overrides):
  """The rows of a 7-step run and of the same run stopped after step 4 and resumed, timing
  left out: `(uninterrupted, resumed)`."""
  full = loop.train_and_evaluate(small_config(total_steps=7, **overrides), str(tmp_path / "full"))
  part = str(tmp_path / "part")
  loop.train_and_evaluate(small_config(total_steps=4, **overrides), part)
  loop.train_and_evaluate(small_config(total_steps=7, **overrides), part)
  got, _ = metrics_files.split_rows(metrics_files.read_metrics(part))
  want, _ = metrics_files.split_rows(full)
  return strip_timing(want), strip_timing(got)


def reference_version(t, m, n):
  """v(t) of arXiv:2509.24203, written out independently of lag.behavior_version."""
  if t <= n:
    return 0
  return m * ((t - n - 1) // m)


def test_short_run_writes_required_keys(tmp_path, capsys, monkeypatch):
  workdir = str(tmp_path)
  checked = []  # the config is validated once, at the run's edge
  validate = validation.validate_config
  monkeypatch.setattr(validation, "validate_config", lambda c: checked.append(1) or validate(c))
  loop.train_and_evaluate(small_config(total_steps=3), workdir)
  assert len(checked) == 1
  # A 3-step warm start leaves the policy scoring 0 on every group: the run says what to change.
  out = capsys.readouterr().out
  assert "warning: in steps 1-3, 100% of the groups had equal rewards" in out
  assert "raise config.sft.steps (now 3)" in out
  train, evals = metrics_files.split_rows(metrics_files.read_metrics(workdir))
  assert [r["step"] for r in train] == [1, 2, 3]
  for row in train:
    missing = [k for k in REQUIRED if k not in row]
    assert not missing, missing
    assert 0.0 <= row["reward_mean"] <= 1.0
    assert row["tokens_per_s"] > 0
  # Starting accuracy after the warm start (step 0) and a final evaluation.
  assert [r["step"] for r in evals] == [0, 3]
  assert {"eval/accuracy", "eval/pass@2", "eval/reward_mean"} <= set(evals[-1])
  assert os.path.exists(os.path.join(workdir, metrics.CONFIG_FILE))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]


def test_no_signal_warning_names_the_field_to_change():
  def rows(shares, reward):
    return [
      {"step": i + 1, "groups_all_equal": s, "reward_mean": reward} for i, s in enumerate(shares)
    ]

  sft = components.RunSpec.from_config(small_config()).sft
  no_sft = components.RunSpec.from_config(small_config(**{"sft.enabled": False})).sft
  healthy = rows([0.25, 0.38, 0.12, 0.5] * 3, 0.41)
  assert observability.no_signal_warning(healthy, sft) is None
  assert observability.no_signal_warning(rows([0.9, 0.85, 0.9], 0.0), sft) is None  # 88%
  flat = rows([1.0] * 9 + [0.875], 0.002)
  assert "steps 1-10, 99% of the groups" in observability.no_signal_warning(flat, sft)
  assert "config.sft.steps (now 3)" in observability.no_signal_warning(flat, sft)
  assert "config.sft.enabled=True" in observability.no_signal_warning(flat, no_sft)
  solved = observability.no_signal_warning(rows([1.0] * 10, 0.97), sft)
  assert "already solves nearly every prompt" in solved
  assert observability.no_signal_warning([{"step": 1, "reward_mean": 0.0}], sft) is None


@pytest.mark.parametrize("m,n", [(1, 0), (1, 3), (4, 0), (3, 2), (1000, 0)])
def test_recorded_staleness_follows_the_schedule(tmp_path, m, n):
  cfg = small_config(
    **{
      "total_steps": 9,
      "lag.sync_interval": m,
      "lag.sync_offset": n,
      "eval_prompts": 0,
      "checkpoint_every": 0,
      "sft.enabled": False,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  assert [r["step"] for r in rows] == list(range(1, 10))
  for row in rows:
    t = row["step"]
    lag = t - 1 - reference_version(t, m, n)
    assert row["behavior_version"] == reference_version(t, m, n)
    assert row["staleness_mean"] == lag and row["staleness_max"] == lag, (t, row)
  if m == 1 and n == 0:
    # On-policy: the recorded behaviour log-probs are the trainer's (rho == 1).
    assert all(abs(r["ratio_mean"] - 1.0) < 1e-5 for r in rows)


def test_no_recompilation_after_warmup(tmp_path, no_compile_cache):
  compiles = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  counts = {}
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    cfg = small_config(
      **{
        "total_steps": 25,
        "lag.sync_interval": 4,
        "eval_prompts": 0,
        "checkpoint_every": 5,
        "sft.enabled": False,
      }
    )
    loop.train_and_evaluate(
      cfg, str(tmp_path), on_step=lambda t, _: counts.update({t: len(compiles)})
    )
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  # Steps 1-5 cover every code path once (first snapshot at step 4, first checkpoint at 5).
  assert counts[25] == counts[5], {t: c - counts[5] for t, c in counts.items() if t > 5}


def _timed(fn, *args):
  begin = time.perf_counter()
  out = fn(*args)
  return out, time.perf_counter() - begin


def test_resume_reproduces_uninterrupted_run(tmp_path, capsys):
  lag = {"lag.sync_interval": 3, "lag.sync_offset": 1}
  full = loop.train_and_evaluate(small_config(total_steps=8, **lag), str(tmp_path / "full"))
  part = str(tmp_path / "part")
  run = loop.train_and_evaluate
  _, first_s = _timed(run, small_config(total_steps=5, **lag), part)  # stops after step 5
  ckpt = checkpointing.Checkpointer(os.path.join(part, "checkpoints"), create=False)
  counted = ckpt.restore_meta(5)["wall_s"]  # the run's seconds the resume goes on from
  ckpt.close()
  _, second_s = _timed(run, small_config(total_steps=8, **lag), part)  # resumes from step 5
  assert "resumed from step 5 of 8 in" in capsys.readouterr().out
  got_train, got_eval = metrics_files.split_rows(metrics_files.read_metrics(part))
  want_train, want_eval = metrics_files.split_rows(full)
  assert strip_timing(got_train) == strip_timing(want_train)
  assert got_eval[0] == want_eval[0] and got_eval[-1] == want_eval[-1]

  # The run's wall time goes on from the checkpoint's count: no command's seconds lost or
  # counted twice, and a rerun of the finished run changes nothing.
  walls = [r[reports.RUN_WALL_KEY] for r in got_train]
  assert walls == sorted(walls) and walls[0] > 0
  assert walls[-1] >= sum(r["step_time_s"] for r in got_train)
  assert walls[4] <= counted < walls[5] and counted < first_s and walls[-1] < first_s + second_s
  summary = reports.summarize_run(part)
  assert summary["run_wall_s"] == walls[-1]
  assert summary["start_accuracy"] == got_eval[0]["eval/accuracy"]
  assert run(small_config(total_steps=8, **lag), part) == []
  assert "resumed from step 8 of 8" in capsys.readouterr().out
  text = reports.format_run_summary(part, wall_s=1.0)
  assert f"{walls[-1]:.0f} s to the last step, every command counted (this command: 1 s)" in text

  # Cost totals go on from the checkpoint's: the token totals are the sums of the steps'
  # counts (the rows above equal the uninterrupted run's, totals included), and each side's
  # seconds are busy or idle.
  last = got_train[-1]
  assert last["cost/sampled_tokens"] == sum(r["sampled_tokens"] for r in got_train) > 0
  assert last["cost/trained_tokens"] == sum(r["tokens"] for r in got_train) > 0
  assert last["cost/sampled_prompt_tokens"] == sum(r["sampled_prompt_tokens"] for r in got_train)
  fused = [r["time/run_device_busy_s"] for r in got_train]
  assert fused == sorted(fused) and fused[-1] <= walls[-1]
  assert last["time/run_sampler_idle_s"] == pytest.approx(walls[-1] - fused[-1])
  assert summary["sampled_tokens"] == last["cost/sampled_tokens"]
  assert f"{last['cost/sampled_tokens']:.0f} sampled" in text


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"loss.name": "no_such_loss"}, "loss.name"),
    ({"loss.eps_low": -0.1}, "loss.eps_low"),
    ({"group_size": 1}, "group_size"),
    ({"lag.sync_interval": 0}, "lag.sync_interval"),
    ({"lag.mode": "sometimes"}, "lag.mode"),
    ({"advantage.name": "nope"}, "advantage.name"),
    ({"model": "no-such-preset"}, "model"),
    ({"task": "no_such_task"}, "task"),
    ({"train.num_minibatches": 3}, "train.num_minibatches"),
    ({"train.num_epochs": 0}, "train.num_epochs"),
    ({"train.micro_batch_size": 3}, "train.micro_batch_size"),
    ({"replay.policy": "lifo"}, "replay.policy"),
    ({"replay.max_reuse": -1}, "replay.max_reuse"),
  ],
)
def test_bad_config_fails_naming_the_field(tmp_path, overrides, field):
  with pytest.raises(ValueError, match=f"config.{field}"):
    loop.train_and_evaluate(small_config(**overrides), str(tmp_path))
  assert not os.path.exists(tmp_path / metrics_files.METRICS_FILE)


def test_missing_data_file_fails_naming_the_field(tmp_path):
  cfg = default.base_config()
  cfg.task = "gsm8k"
  cfg.task_kwargs = {"train_path": str(tmp_path / "missing.jsonl")}
  with pytest.raises(ValueError, match="config.task_kwargs.train_path.*missing.jsonl"):
    validation.validate_config(cfg)


def test_malformed_data_row_fails_naming_file_and_row(tmp_path):
  path = tmp_path / "train.jsonl"
  rows = [{"question": "1+1?", "answer": "#### 2"}, "not json at all"]
  path.write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in rows) + "\n")
  cfg = default.base_config()
  cfg.task = "gsm8k"
  cfg.task_kwargs = {"train_path": str(path)}
  with pytest.raises(ValueError, match="train.jsonl: row 2"):
    loop.train_and_evaluate(cfg, str(tmp_path / "run"))


def _flaky_reward(example, text):
  """A host reward (run in verifier workers) that hangs, raises or overflows float32."""
  kind = zlib.crc32(text.encode()) % 4
  if kind == 0:
    raise RuntimeError("verifier crashed")
  if kind == 1:
    time.sleep(30.0)  # hangs past the timeout: its worker is killed
  if kind == 2:
    return 1e300  # finite in float64, inf in float32: a failure
  return 1.0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failing_reward_is_scored_zero_counted_and_run_goes_on(tmp_path, monkeypatch, mode):
  real_get_task = tasks.get_task

  def get_task(name, **kw):
    task = real_get_task(name, **kw)
    return dataclasses.replace(task, reward=_flaky_reward, device_reward=None)

  monkeypatch.setattr(tasks, "get_task", get_task)
  components.clear_cache()
  try:
    cfg = small_config(
      **{
        "total_steps": 3,
        "eval_prompts": 0,
        "sft.enabled": False,
        "reward_timeout": 0.3,
        "max_new_tokens": 5,
        "lag.mode": mode,
        "lag.max_staleness": 8,
      }
    )
    start = time.monotonic()
    rows = loop.train_and_evaluate(cfg, str(tmp_path))
    elapsed = time.monotonic() - start
  finally:
    components.clear_cache()
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert elapsed < 60  # hung verifiers were killed, not waited for
  for row in rows:
    # 8 responses per step; every failure scores 0 and every success 1, so the
    # failures counted in a row are exactly those of the batch it trained on.
    assert row["reward_mean"] == pytest.approx(1.0 - row["reward_failures"] / 8)
    assert row["reward_timeouts"] <= row["reward_failures"]
    # A timeout kills a busy worker (calls never started count as timeouts too).
    assert (row["reward_worker_restarts"] > 0) == (row["reward_timeouts"] > 0)
    assert row["reward_time_s"] > 0
  assert sum(r["reward_failures"] for r in rows) > sum(r["reward_timeouts"] for r in rows) > 0


def test_reward_that_cannot_reach_a_worker_fails_at_start_up_naming_the_task(tmp_path):
  def notebook_reward(example, text):  # a closure: it cannot be pickled
    return float(text == example["answer"])

  tasks.register(
    "test_notebook_task",
    lambda: dataclasses.replace(
      tasks.get_task("reverse"), reward=notebook_reward, device_reward=None
    ),
  )
  cfg = small_config(**{"task": "test_notebook_task", "sft.enabled": False})
  with pytest.raises(ValueError, match="'test_notebook_task'.*cannot run in a sandboxed"):
    loop.train_and_evaluate(cfg, str(tmp_path))
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_async_mode_runs_with_bounded_staleness(tmp_path):
  cfg = small_config(
    **{
      "total_steps": 8,
      "lag.mode": "async",
      "lag.max_staleness": 2,
      "eval_prompts": 0,
      "sft.enabled": False,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  assert [r["step"] for r in rows] == list(range(1, 9))
  for row in rows:
    assert 0 <= row["staleness_max"] <= 2
    assert row["staleness_mean"] == row["step"] - 1 - row["behavior_version"]
  # The producer's sampling and the trainer's learning overlap: each side is busy or idle
  # within the run's wall clock, and the tokens of dropped batches are counted as sampled.
  last = rows[-1]
  wall = last["time/run_wall_s"]
  for side in ("sampler", "learner"):
    assert 0 < last[f"time/run_{side}_busy_s"] <= wall
    assert last[f"time/run_{side}_busy_s"] + last[f"time/run_{side}_idle_s"] == pytest.approx(wall)
  assert last["time/run_learner_busy_s"] == pytest.approx(sum(r["time/train_s"] for r in rows))
  dropped = sum(r["async_dropped_tokens"] for r in rows)
  assert last["cost/sampled_tokens"] == sum(r["sampled_tokens"] for r in rows) + dropped


def test_sharded_mesh_matches_single_device(tmp_path):
  # Partial-credit rewards give a learning signal without a warm start.
  common = {
    "total_steps": 3,
    "eval_prompts": 0,
    "sft.enabled": False,
    "task_kwargs.partial_credit": True,
  }
  one = loop.train_and_evaluate(small_config(**common), str(tmp_path / "one"))
  mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
  eight = loop.train_and_evaluate(small_config(**common, **mesh), str(tmp_path / "eight"))
  assert jax.device_count() == 8
  assert any(r["grad_norm"] > 0 for r in one)
  for a, b in zip(one, eight, strict=True):
    for k in ("reward_mean", "loss", "grad_norm", "entropy", "kl_k3"):
      assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_nan_reward_skips_the_update_and_the_run_goes_on(tmp_path, monkeypatch):
  cfg = small_config(
    **{
      "total_steps": 4,
      "eval_prompts": 0,
      "sft.enabled": False,
      "task_kwargs.partial_credit": True,
    }
  )
  real_get_task = tasks.get_task

  def get_task(name, **kw):
    task = real_get_task(name, **kw)
    real = task.device_reward

    def poisoned(answers, tokens, mask):
      # NaN for row 0 on some steps (decided on device: the reward is traced once).
      r = real(answers, tokens, mask)
      return r.at[0].set(jnp.where(tokens[0, 0] % 2 == 0, jnp.nan, r[0]))

    return dataclasses.replace(task, device_reward=poisoned)

  monkeypatch.setattr(tasks, "get_task", get_task)
  components.clear_cache()
  try:
    rows = loop.train_and_evaluate(cfg, str(tmp_path))
  finally:
    components.clear_cache()
  poisoned_steps = [r["reward_mean"] != r["reward_mean"] for r in rows]
  assert any(poisoned_steps) and not all(poisoned_steps)
  assert [r["skipped"] for r in rows] == [int(p) for p in poisoned_steps]
  assert rows[-1]["num_skipped"] == sum(poisoned_steps)
  finite = [r["grad_norm"] == r["grad_norm"] for r in rows]
  assert all(f for f, p in zip(finite, poisoned_steps, strict=True) if not p)


def test_several_optimizer_steps_per_batch_keep_versions_consistent(tmp_path):
  # U = 2 optimizer steps per batch (2 minibatches of 4 rows, micro-batches of 2 rows).
  m, u = 2, 2
  cfg = small_config(
    **{
      "total_steps": 5,
      "lag.sync_interval": m,
      "train.num_minibatches": u,
      "train.micro_batch_size": 2,
      "eval_prompts": 0,
      "checkpoint_every": 0,
      "sft.enabled": False,
      "task_kwargs.partial_credit": True,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  assert [r["step"] for r in rows] == list(range(1, 6))
  for row in rows:
    t = row["step"]
    v = reference_version(t, m, 0)
    # Versions count optimizer steps: the trainer holds (t - 1) * U before step t.
    assert row["version"] == t * u
    assert row["behavior_version"] == v * u
    assert row["staleness_mean"] == row["staleness_max"] == (t - 1 - v) * u, (t, row)
    assert row["replay_selected"] == cfg.prompts_per_step
  assert any(r["grad_norm"] > 0 for r in rows)


def test_replay_policy_with_reuse_runs(tmp_path):
  cfg = small_config(
    **{
      "total_steps": 4,
      "lag.sync_interval": 1,
      "replay.policy": "staleness",
      "replay.max_reuse": 2,
      "replay.capacity_batches": 2,
      "eval_prompts": 0,
      "checkpoint_every": 0,
      "sft.enabled": False,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  # On-policy sampling, so a group drawn at step t was sampled at step t or t - 1.
  assert all(r["staleness_max"] <= 1 and r["replay_selected"] == 2 for r in rows)
  assert any(r["staleness_max"] == 1 for r in rows)  # a reused (older) group was drawn


def test_global_prompts_on_one_process_equal_the_local_batch():
  from jax.sharding import AxisType, PartitionSpec

  mesh = jax.make_mesh((4, 2, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  rng = np.random.default_rng(0)
  local = {
    "prompt_tokens": rng.integers(0, 30, (8, 5)).astype(np.int32),
    "prompt_lengths": rng.integers(1, 5, (8,)).astype(np.int32),
    "answer_tokens": rng.integers(-1, 30, (8, 3)).astype(np.int32),
    "index": np.arange(8, dtype=np.int64),
    "valid": np.ones(8, bool),
  }
  out = prompt_rows.assemble_global(mesh, local)
  for k in ("prompt_tokens", "prompt_lengths", "answer_tokens"):
    assert isinstance(out[k], jax.Array)
    np.testing.assert_array_equal(np.asarray(out[k]), local[k])
    assert out[k].sharding.spec[0] == ("data", "fsdp")
    assert len(out[k].addressable_shards) == 8
  assert out["index"] is local["index"] and out["valid"] is local["valid"]
  # Not divisible by data*fsdp on one process: replicated, same values.
  odd = prompt_rows.assemble_global(mesh, {k: v[:3] for k, v in local.items()})
  assert odd["prompt_tokens"].sharding.spec == PartitionSpec()
  np.testing.assert_array_equal(np.asarray(odd["prompt_tokens"]), local["prompt_tokens"][:3])


def test_each_process_reads_its_own_block_of_the_global_batch(monkeypatch):
  fns = components.build_components(small_config(**{"prompts_per_step": 4})).fns
  one = fns.prompts(0, "train")
  whole = [next(one) for _ in range(3)]
  assert whole[0]["prompt_tokens"].shape[0] == 4
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  for shard in (0, 1):
    monkeypatch.setattr(jax, "process_index", lambda shard=shard: shard)
    it = fns.prompts(0, "train")
    for t in range(3):
      batch = next(it)
      assert batch["prompt_tokens"].shape[0] == 2  # prompts_per_step / process_count
      # Rows [2 * shard, 2 * shard + 2) of the one-process batch: the global batch
      # does not depend on the number of processes.
      for k, v in whole[t].items():
        np.testing.assert_array_equal(batch[k], v[2 * shard : 2 * shard + 2])
    assert it.get_state() == one.get_state()  # one checkpointed state resumes every process
  # Evaluation reads the whole split on every process.
  assert next(fns.prompts(0, "eval", batch_size=4))["index"].tolist() == [
    0,
    1,
    2,
    3,
  ]


def test_rows_carry_phase_times_and_compiles_and_profile_writes_a_trace(tmp_path, no_compile_cache):
  cfg = small_config(
    **{
      "total_steps": 6,
      "log_every": 3,
      "profile_steps": 2,
      "eval_prompts": 0,
      "sft.enabled": False,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  for row in rows:
    assert row["time/device_s"] > 0 and row["time/other_s"] >= 0
    assert row["step_time_s"] >= row["time/device_s"]
  # Chunks of gcd(log_every, checkpoint_every) = 3 steps: nothing compiles after the first.
  assert rows[1]["compiles"] > 0 and rows[-1]["compiles"] == rows[1]["compiles"]
  traces = [f for _, _, files in os.walk(tmp_path / "profile") for f in files]
  assert any(f.endswith(".xplane.pb") for f in traces), traces


def _text_reward(example, text):
  """A deterministic host reward: the fraction of the reference answer's characters in the text."""
  answer = str(example["answer"])
  return sum(ch in text for ch in answer) / max(len(answer), 1)


def test_host_reward_rollout_overlapped_with_scoring_changes_nothing(tmp_path, monkeypatch):
  """With sync_interval 4 the next rollout is dispatched before scoring on most steps;
  checkpointing every step forbids that overlap. Both runs write the same rows."""
  real_get_task = tasks.get_task

  def get_task(name, **kw):
    return dataclasses.replace(real_get_task(name, **kw), reward=_text_reward, device_reward=None)

  monkeypatch.setattr(tasks, "get_task", get_task)
  components.clear_cache()
  try:
    base = {"total_steps": 6, "eval_prompts": 0, "sft.enabled": False, "lag.sync_interval": 4}
    overlapped = loop.train_and_evaluate(small_config(**base), str(tmp_path / "a"))
    serial = loop.train_and_evaluate(small_config(**base, checkpoint_every=1), str(tmp_path / "b"))
  finally:
    components.clear_cache()
  drop = lambda rows: [{k: v for k, v in r.items() if k != "reward_time_s"} for r in rows]
  assert len(overlapped) == 6 and drop(strip_timing(overlapped)) == drop(strip_timing(serial))
  assert any(r["reward_mean"] > 0 for r in overlapped)


@pytest.mark.parametrize("slots", [0, 1], ids=["static", "continuous"])
def test_truncated_sampling_on_policy_has_unit_ratios(tmp_path, slots):
  """The log-prob contract through the loop: top-k + top-p, on-policy, ratio 1 on every token.

  Also with continuous batching (2 prompt groups through 1 slot). (`behavior_logp="full"` is
  checked on the sampler and learner in test_logprob_contract.)
  """
  cfg = small_config(
    **{
      "total_steps": 2,
      "rollout.continuous_slots": slots,
      "temperature": 0.7,
      "top_p": 0.8,
      "top_k": 5,
      "eval_prompts": 0,
      "checkpoint_every": 0,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  for row in rows:
    for key in ("ratio_min", "ratio_max", "ratio_mean"):
      assert abs(row[key] - 1.0) < 1e-5, (key, row)


def _auto(**overrides):
  """Automatic continuous batching: 2 static steps, then 1 slot if their mean waste > 0.05."""
  auto = {
    "rollout.continuous_slots": 1,
    "rollout.continuous_auto_steps": 2,
    "rollout.continuous_waste_threshold": 0.05,
    "eval_prompts": 0,
  }
  return small_config(**{**auto, **overrides})


def test_continuous_auto_switches_when_lengths_vary_and_resume_keeps_the_choice(tmp_path):
  """EOS makes lengths vary: steps 1-2 static, then continuous; resumed runs choose the same.

  One run is stopped after step 1 (before the choice: the waste seen so far is
  in its checkpoint) and after step 3 (after it), and resumed each time.
  """
  full = loop.train_and_evaluate(_auto(total_steps=5), str(tmp_path / "full"))
  waste = [r["sampler/decode_waste"] for r in full]
  assert [r["sampler/continuous"] for r in full] == [0, 0, 1, 1, 1]
  assert full[1]["sampler/auto_waste"] == pytest.approx(np.mean(waste[:2]))
  assert full[1]["sampler/auto_waste"] > 0.05
  assert "sampler/auto_waste" not in full[0] and "sampler/auto_waste" not in full[2]
  part = str(tmp_path / "part")
  for total in (1, 3, 5):
    loop.train_and_evaluate(_auto(total_steps=total), part)
  got = metrics_files.split_rows(metrics_files.read_metrics(part))[0]
  assert strip_timing(got) == strip_timing(full)


def test_continuous_auto_stays_static_when_lengths_do_not_vary(tmp_path):
  """One-token responses: no decode waste, the static batch stays."""
  cfg = _auto(total_steps=3, max_new_tokens=1, **{"sft.enabled": False, "checkpoint_every": 0})
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  assert [r["sampler/decode_waste"] for r in rows] == [0.0, 0.0, 0.0]
  assert [r["sampler/continuous"] for r in rows] == [0, 0, 0]
  assert rows[1]["sampler/auto_waste"] == 0.0


def test_bf16_sampler_mismatch_and_staleness_are_reported_apart(tmp_path):
  """`rollout.score_old` with a bf16 sampler under lag: both factors in every row."""
  cfg = small_config(
    **{
      "total_steps": 4,
      "rollout.sampler_dtype": "bfloat16",
      "rollout.score_old": True,
      "lag.sync_interval": 2,
      "optimizer.weight_decay": 0.5,  # the parameters move even where every advantage is 0
      "eval_prompts": 0,
      "checkpoint_every": 0,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  for row in rows:
    assert row["mismatch_kl_k3"] > 1e-8 and row["mismatch_ratio_p50"] > 0.9, row
    assert row["mismatch_ratio_p1"] <= row["mismatch_ratio_p50"] <= row["mismatch_ratio_p99"]
  # Steps 2 and 4 train on data one update old: staleness shows; steps 1 and 3 are on-policy.
  on_policy = [r["staleness_kl_k3"] for r in rows if r["staleness_max"] == 0]
  stale = [r["staleness_kl_k3"] for r in rows if r["staleness_max"] > 0]
  assert len(on_policy) == len(stale) == 2
  assert max(on_policy) < 1e-10 and min(stale) > 1e-9
