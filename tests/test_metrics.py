"""Tests for offpolicy_jax.metrics: JSONL append/flush, resume truncation, plots, summaries."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import metrics


def _write_steps(workdir, steps, resume_step=None, **kw):
  with metrics.MetricsWriter(
    workdir, resume_step=resume_step, tensorboard=False, progress=False, **kw
  ) as w:
    for s in steps:
      w.write(s, {"reward_mean": jnp.float32(s / 10), "loss": np.float64(-s), "n": np.int32(s)})


def test_rows_are_flushed_per_write(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), tensorboard=False, progress=False)
  w.write(1, {"reward_mean": jnp.asarray(0.5)})
  # Visible to another reader before close: the row was flushed.
  rows = metrics.read_metrics(str(tmp_path))
  assert rows == [{"step": 1, "reward_mean": 0.5}]
  w.close()


def test_non_primary_process_writes_nothing(tmp_path):
  workdir = str(tmp_path / "run")
  w = metrics.MetricsWriter(workdir, tensorboard=True, progress=True, total_steps=3, primary=False)
  row = w.write(2, {"reward_mean": jnp.float32(0.25)})
  w.log_text("not shown")
  w.close()
  assert row == {"step": 2, "reward_mean": 0.25}
  assert not os.path.exists(workdir)


def test_values_become_python_scalars(tmp_path):
  _write_steps(str(tmp_path), [3])
  (row,) = metrics.read_metrics(str(tmp_path))
  assert row == {"step": 3, "reward_mean": pytest.approx(0.3), "loss": -3.0, "n": 3}
  assert isinstance(row["n"], int) and isinstance(row["loss"], float)


def test_resume_drops_rows_beyond_checkpoint_and_torn_line(tmp_path):
  d = str(tmp_path)
  _write_steps(d, range(1, 8))
  with open(os.path.join(d, metrics.METRICS_FILE), "a") as f:
    f.write('{"step": 8, "rew')  # a kill in the middle of a write
  _write_steps(d, range(5, 9), resume_step=4)
  steps = [r["step"] for r in metrics.read_metrics(d)]
  assert steps == list(range(1, 9))


def test_fresh_run_empties_an_old_file(tmp_path):
  d = str(tmp_path)
  _write_steps(d, range(1, 4))
  _write_steps(d, [1], resume_step=None)
  assert [r["step"] for r in metrics.read_metrics(d)] == [1]


def test_config_saved_beside_metrics(tmp_path):
  import ml_collections

  cfg = ml_collections.ConfigDict({"seed": 3, "loss": {"name": "grpo"}})
  _write_steps(str(tmp_path), [1], config=cfg)
  with open(tmp_path / metrics.CONFIG_FILE) as f:
    assert json.load(f) == {"seed": 3, "loss": {"name": "grpo"}}


def test_tensorboard_events_written(tmp_path):
  with metrics.MetricsWriter(str(tmp_path), progress=False) as w:
    w.write(1, {"reward_mean": 0.25})
  files = os.listdir(tmp_path / "tb")
  assert any(f.startswith("events.out.tfevents") for f in files)


def test_summary_and_plot(tmp_path):
  runs = {}
  for name, slope in [("a", 1.0), ("b", -1.0)]:
    d = str(tmp_path / name)
    with metrics.MetricsWriter(d, tensorboard=False, progress=False) as w:
      for s in range(1, 11):
        w.write(
          s,
          {
            "reward_mean": slope * s,
            "staleness_mean": 1.0,
            "clip_frac": 0.0,
            "entropy": 1.0,
            "kl_k3": 0.0,
          },
        )
      w.write(10, {"eval/accuracy": 0.5})
    runs[name] = d
  s = metrics.summarize_run(runs["a"])
  # First fifth = steps 1-2, last fifth = steps 9-10 (eval row excluded).
  assert s["steps"] == 10
  assert s["reward_first_fifth"] == pytest.approx(1.5)
  assert s["reward_last_fifth"] == pytest.approx(9.5)
  assert s["eval/accuracy"] == 0.5
  md = metrics.write_summary_table(runs, str(tmp_path))
  text = open(md).read()
  assert "| a | 10 | 1.5000 | 9.5000" in text and "| b |" in text
  png = metrics.plot_runs(runs, str(tmp_path / "c.png"))
  assert os.path.getsize(png) > 1000
