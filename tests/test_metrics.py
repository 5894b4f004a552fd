"""Tests for offpolicy_jax.metrics: JSONL append/flush, resume truncation, plots, summaries.

The run-cannot-be-corrupted tests: a bad line keeps the rows around it, a deleted
or replaced file is re-created, `sync` fsyncs, a fresh start moves old files aside.
TensorBoard tags carry their group; docs/metrics.md documents every key of a real
run's rows under that group.
"""

import json
import os
import re
import struct
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax.store import metrics, metrics_files
from offpolicy_jax.study import reports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
METRICS_PAGE = os.path.join(ROOT, "docs", "metrics.md")


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
  rows = metrics_files.read_metrics(str(tmp_path))
  assert rows == [{"step": 1, "reward_mean": 0.5}]
  w.close()


def test_a_workdir_created_while_read_is_read_as_a_workdir(tmp_path, monkeypatch):
  """A reader polling a starting run: the workdir appears between the directory check and
  the open (CI saw IsADirectoryError there)."""
  writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False, progress=False)
  writer.write(3, {"loss": 1.0})
  writer.close()
  assert metrics_files.read_metrics(str(tmp_path / "absent")) == []
  monkeypatch.setattr(metrics_files.os.path, "isdir", lambda _: False)  # checked too early
  assert [r["step"] for r in metrics_files.read_metrics(str(tmp_path))] == [3]


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
  (row,) = metrics_files.read_metrics(str(tmp_path))
  assert row == {"step": 3, "reward_mean": pytest.approx(0.3), "loss": -3.0, "n": 3}
  assert isinstance(row["n"], int) and isinstance(row["loss"], float)


def test_resume_drops_rows_beyond_checkpoint_and_torn_line(tmp_path):
  d = str(tmp_path)
  _write_steps(d, range(1, 8))
  with open(os.path.join(d, metrics_files.METRICS_FILE), "a") as f:
    f.write('{"step": 8, "rew')  # a kill in the middle of a write
  with pytest.warns(UserWarning, match=r"dropped 1 unreadable line\(s\) \(line 8\)"):
    _write_steps(d, range(5, 9), resume_step=4)
  steps = [r["step"] for r in metrics_files.read_metrics(d)]
  assert steps == list(range(1, 9))


def _steps(path):
  return [r["step"] for r in metrics_files.read_metrics(str(path))]


def _rows_text(steps):
  return "".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in steps)


def test_torn_middle_line_keeps_later_rows_through_resume(tmp_path):
  path = tmp_path / metrics_files.METRICS_FILE
  torn = b'{"step": 4, "rew'
  garbage = b"\x00\x00\xff\xfe"  # zeroed / non-UTF-8 bytes left by a power cut
  path.write_bytes(
    _rows_text(range(1, 4)).encode()
    + torn
    + b"\n"
    + _rows_text(range(4, 31)).encode()
    + garbage
    + b"\n"
    + _rows_text([31, 32]).encode()
  )
  with pytest.warns(
    UserWarning, match=r"metrics\.jsonl: skipped 2 unreadable line\(s\) \(line 4, 32\)"
  ):
    assert _steps(path) == [*range(1, 31), 31, 32]
  with pytest.warns(UserWarning, match=r"dropped 2 unreadable line\(s\) \(line 4, 32\).*\.bad"):
    _write_steps(str(tmp_path), range(21, 25), resume_step=20)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # The rewritten file reads without a warning.
    assert _steps(path) == list(range(1, 25))
  assert (
    tmp_path / (metrics_files.METRICS_FILE + ".bad")
  ).read_bytes() == torn + b"\n" + garbage + b"\n"


def test_replacing_file_with_torn_last_line_does_not_swallow_next_row(tmp_path):
  path = tmp_path / metrics_files.METRICS_FILE
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False, progress=False) as w:
    w.write(1, {"reward_mean": 0.0})
    other = tmp_path / "other.jsonl"
    other.write_text(path.read_text() + '{"step": 2, "rew')  # ends mid-line
    os.replace(other, path)
    with pytest.warns(UserWarning, match="replaced"):
      w.write(2, {"reward_mean": 0.2})
  with pytest.warns(UserWarning, match=r"\(line 2\)"):
    assert _steps(path) == [1, 2]


def test_deleted_file_is_recreated_and_written_on(tmp_path):
  path = tmp_path / metrics_files.METRICS_FILE
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False, progress=False) as w:
    w.write(1, {"reward_mean": 0.1})
    os.remove(path)
    with pytest.warns(UserWarning, match=rf"{path} was deleted; re-creating it .* step 2 on"):
      w.write(2, {"reward_mean": 0.2})
    w.write(3, {"reward_mean": 0.3})
  assert _steps(path) == [2, 3]


def test_replaced_file_is_reopened_and_written_on(tmp_path):
  path = tmp_path / metrics_files.METRICS_FILE
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False, progress=False) as w:
    w.write(1, {"reward_mean": 0.1})
    other = tmp_path / "other.jsonl"
    other.write_text(_rows_text([1]))  # e.g. an editor saving the file under a new inode
    os.replace(other, path)
    with pytest.warns(UserWarning, match=rf"{path} was replaced by another file.* step 2 on"):
      w.write(2, {"reward_mean": 0.2})
    w.write(3, {"reward_mean": 0.3})
  assert _steps(path) == [1, 2, 3]
  assert os.stat(path).st_nlink == 1


def test_sync_fsyncs_metrics_file_and_flushes_tensorboard(tmp_path, monkeypatch):
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd)), real_fsync(fd)))
  w = metrics.MetricsWriter(str(tmp_path), progress=False)
  w.write(1, {"reward_mean": 0.1})
  flushed = []
  monkeypatch.setattr(w._tb, "flush", lambda: flushed.append(True))
  synced.clear()
  w.sync()
  assert any(os.path.samestat(st, os.stat(w.path)) for st in synced)
  assert flushed
  w.close()


def test_fresh_start_moves_earlier_run_aside(tmp_path, monkeypatch, capsys):
  import ml_collections

  monkeypatch.setattr(metrics, "_timestamp", lambda: "20261123-104512")  # same second
  d = str(tmp_path)
  for seed, steps in [(1, [1, 2, 3]), (2, [1, 2]), (3, [1])]:
    cfg = ml_collections.ConfigDict({"seed": seed})
    with metrics.MetricsWriter(d, config=cfg, progress=False) as w:
      for s in steps:
        w.write(s, {"reward_mean": 0.0})
  assert _steps(d) == [1]
  prev = tmp_path / metrics.PREVIOUS_DIR
  assert sorted(os.listdir(prev)) == ["20261123-104512", "20261123-104512-1"]
  for name, seed, steps in [("20261123-104512", 1, [1, 2, 3]), ("20261123-104512-1", 2, [1, 2])]:
    assert _steps(prev / name) == steps
    assert json.loads((prev / name / metrics.CONFIG_FILE).read_text()) == {"seed": seed}
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(prev / name / "tb"))
  out = capsys.readouterr().out
  assert f"moved the earlier run's files in {d} to {prev / '20261123-104512-1'}" in out


def test_fresh_start_in_empty_workdir_moves_nothing(tmp_path):
  _write_steps(str(tmp_path), [1])
  assert not os.path.exists(tmp_path / metrics.PREVIOUS_DIR)


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


def _event_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of the scalars in the event files of a TensorBoard directory.

  An event file is a sequence of records: the data's length (little-endian
  uint64), its masked CRC32C, the serialised `Event`, the data's masked CRC32C.
  They are read with tensorboardX's protos (a dependency), so no TensorBoard
  install is needed.
  """
  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c

  scalars: dict[str, list[tuple[int, float]]] = {}
  for name in sorted(os.listdir(tb_dir)):
    if not name.startswith("events.out.tfevents"):
      continue
    data, pos = (tb_dir / name).read_bytes(), 0
    while pos < len(data):
      header = data[pos : pos + 8]
      (length,) = struct.unpack("<Q", header)
      assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
      record = data[pos + 12 : pos + 12 + length]
      (crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
      assert crc == masked_crc32c(record)
      pos += 16 + length
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_tensorboard_tags_are_grouped_and_jsonl_keys_are_not(tmp_path):
  row = {
    "reward_mean": 0.5,
    "loss": -1.5,
    "entropy": 2.0,
    "staleness_mean": 1.0,
    "clip_frac_pos": 0.25,
    "mismatch_kl_k3": 0.0,
    "kl_k1": 0.125,
    "ess": 0.75,
    "step_time_s": 0.5,
    "compiles": 3,
    "reward_failures": 0,
    "time/sample_s": 0.25,
    "sampler/decode_waste": 0.5,
    "brand_new_metric": 7.0,
  }
  with metrics.MetricsWriter(str(tmp_path), progress=False) as w:
    w.write(2, row)
    w.write(2, {"eval/accuracy": 0.5})
  scalars = _event_scalars(tmp_path / metrics.TB_DIR)
  assert scalars == {
    "train/reward_mean": [(2, 0.5)],
    "train/loss": [(2, -1.5)],
    "train/entropy": [(2, 2.0)],
    "offpolicy/staleness_mean": [(2, 1.0)],
    "offpolicy/clip_frac_pos": [(2, 0.25)],
    "offpolicy/mismatch_kl_k3": [(2, 0.0)],
    "offpolicy/kl_k1": [(2, 0.125)],
    "offpolicy/ess": [(2, 0.75)],
    "speed/step_time_s": [(2, 0.5)],
    "speed/compiles": [(2, 3.0)],
    "health/reward_failures": [(2, 0.0)],
    "time/sample_s": [(2, 0.25)],
    "sampler/decode_waste": [(2, 0.5)],
    "train/brand_new_metric": [(2, 7.0)],  # a key no group names: the default group
    "eval/accuracy": [(2, 0.5)],
  }
  rows = metrics_files.read_metrics(str(tmp_path))
  assert rows == [{"step": 2, **row}, {"step": 2, "eval/accuracy": 0.5}]


def test_summary_and_plot(tmp_path, monkeypatch):
  runs = {}
  for name, slope in [("a", 1.0), ("b", -1.0)]:
    d = str(tmp_path / name)
    with metrics.MetricsWriter(d, tensorboard=False, progress=False) as w:
      for s in range(1, 11):
        w.write(
          s,
          {
            "reward_mean": slope * s,
            "staleness_mean": float(s % 4),  # the sawtooth of sync_interval 4
            "clip_frac": 0.0,
            "entropy": 1.0,
            "kl_k3": 0.0,
          },
        )
      w.write(10, {"eval/accuracy": 0.5})
    runs[name] = d
  s = reports.summarize_run(runs["a"])
  # First fifth = steps 1-2, last fifth = steps 9-10 (eval row excluded).
  assert s["steps"] == 10
  assert s["reward_first_fifth"] == pytest.approx(1.5)
  assert s["reward_last_fifth"] == pytest.approx(9.5)
  assert s["eval/accuracy"] == 0.5
  md = reports.write_summary_table(runs, str(tmp_path))
  text = open(md).read()
  assert "| a | 10 | 1.5000 | 9.5000" in text and "| b |" in text
  import matplotlib.pyplot as plt

  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  png = reports.plot_runs(runs, str(tmp_path / "c.png"))
  assert os.path.getsize(png) > 1000
  # Staleness 1, 2, 3, 0, 1, ...: a mean over whole 4-step cycles (the 5-step window
  # rounded up to 8), flat at 1.5, not a band between 0 and 3; the legend says so.
  (ax,) = [ax for ax in figures[0].axes if ax.get_title() == "staleness"]
  assert [len(line.get_ydata()) for line in ax.get_lines()] == [3, 3]
  for line in ax.get_lines():
    np.testing.assert_allclose(line.get_ydata(), 1.5)
  assert ax.get_legend().get_texts()[0].get_text() == "a (8-step mean)"
  steps, mean, lo, hi, width = reports.rolling_staleness(
    list(range(1, 11)), [1, 2, 3, 0] * 2 + [1, 2], 5
  )
  assert width == 8 and list(steps) == [8, 9, 10]
  np.testing.assert_array_equal(np.stack([mean, lo, hi]), [[1.5] * 3, [0] * 3, [3] * 3])
  monkeypatch.undo()
  plt.close(figures[0])


@pytest.fixture(scope="module")
def real_rows(tmp_path_factory):
  """The rows of a one-step run of the default config at test sizes (eval rows included).

  Without the warm start: the same keys in half the time.
  """
  from offpolicy_jax.run import loop
  from tests.test_loop import small_config

  return loop.train_and_evaluate(
    small_config(total_steps=1, **{"sft.enabled": False}), str(tmp_path_factory.mktemp("run"))
  )


def _documented_keys() -> dict[str, tuple[str, str]]:
  """{key: (group, the "in" column)} of the key tables of docs/metrics.md.

  A key's group is the one named, in backquotes, at the start of its section's heading.
  """
  keys: dict[str, tuple[str, str]] = {}
  group, fenced = None, False
  with open(METRICS_PAGE) as f:
    for line in f:
      if line.startswith("```"):
        fenced = not fenced
      if fenced:
        continue
      heading = re.match(r"#+ (?:`(\w+)/`)?", line)
      if heading:
        group = heading.group(1)
        continue
      row = re.match(r"\| `([^`]+)` \| ([^|]+) \|", line)
      if row and group:
        keys[row.group(1)] = (group, row.group(2).strip())
  return keys


def test_metrics_page_documents_every_key_of_a_real_row(real_rows):
  _, evals = metrics_files.split_rows(real_rows)
  assert evals, "the run wrote no eval row"
  # pass@K is named after eval_samples.
  keys = {re.sub(r"^eval/pass@\d+$", "eval/pass@K", k) for r in real_rows for k in r} - {"step"}
  documented = _documented_keys()
  default = {k for k, (_, rows) in documented.items() if rows == "default"}
  wrong_group = {
    k: metrics.tb_tag(k)
    for k, (group, _) in documented.items()
    if not metrics.tb_tag(k).startswith(group + "/")
  }
  problems = [
    f"not documented: {sorted(keys - documented.keys())}",
    f"documented, not marked 'default': {sorted(keys & documented.keys() - default)}",
    f"marked 'default' but not in the rows (renamed or removed?): {sorted(default - keys)}",
    f"in a section that is not their TensorBoard group (key: tag): {wrong_group}",
  ]
  assert keys == default and not wrong_group, "docs/metrics.md against a real run's rows:\n" + (
    "\n".join(p for p in problems if not p.endswith(("[]", "{}")))
  )
