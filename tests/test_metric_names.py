"""The one declaration of every metric (`metric_names`): docs, TensorBoard, reductions, study."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import metric_names
from offpolicy_jax import reductions as red
from offpolicy_jax.learn import micro_batch_loss
from offpolicy_jax.store import metrics
from offpolicy_jax.study import cell, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- The key tables below are generated from offpolicy_jax/metric_names.py"


def test_the_metrics_page_key_tables_are_generated_from_the_declarations():
  with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
    page = f.read()
  assert MARKER in page
  generated = page[page.index(MARKER) :].split("\n", 2)[2]
  assert generated == metric_names.reference_markdown(), (
    "docs/metrics.md's key tables differ from offpolicy_jax/metric_names.py; regenerate the "
    "part after the marker with `python -m offpolicy_jax.metric_names`"
  )


@pytest.fixture
def registry(monkeypatch):
  """The declarations, restored after the test."""
  monkeypatch.setattr(metric_names, "GROUPS", dict(metric_names.GROUPS))
  monkeypatch.setattr(metric_names, "_BY_NAME", dict(metric_names._BY_NAME))
  return metric_names


def test_a_metric_declared_once_reaches_tensorboard_the_loss_reduction_docs_and_the_study(
  registry,
):
  gap = registry.Metric(
    "test_gap_max", "loss.name=mine", "ratio", "The largest gap.", reduction="max", study="table"
  )
  registry.register("offpolicy", gap)
  # TensorBoard: its group; undeclared keys keep the prefix patterns or `train/`.
  assert metrics.tb_tag("test_gap_max") == "offpolicy/test_gap_max"
  assert metrics.tb_tag("m2po_anything") == "offpolicy/m2po_anything"
  assert metrics.tb_tag("never_declared") == "train/never_declared"
  assert metrics.tb_tag("time/sample_s") == "time/sample_s"
  # A loss's metrics combine by their declared reduction, not by their names.
  typed = micro_batch_loss._typed(
    {"valid_tokens": jnp.float32(4), "test_gap_max": jnp.float32(2.0), "odd_max": jnp.float32(3)}
  )
  assert isinstance(typed["test_gap_max"], red.Max)
  assert isinstance(typed["odd_max"], red.Mean)  # undeclared: a token-weighted mean
  # The docs' key table.
  assert "| `test_gap_max` | loss.name=mine | ratio | The largest gap. |" in (
    registry.reference_markdown()
  )
  # The study: each run's mean over its steps, its study.csv rows and a study.md table.
  out = {"test_gap_max": np.array([[1.0, 3.0], [5.0, 7.0]]), "entropy": np.ones((2, 2))}
  means = cell.study_means(out, 1)
  assert means == {"test_gap_max": 6.0}  # entropy is not declared for the study
  run = {
    "seed": 0,
    "eval_steps": [0, 2],
    "eval_accuracy": [0.5, 0.6],
    "train_reward": [0.1, 0.2],
    "skipped": 0.0,
    "off_policy": means,
  }
  rows = report.cell_rows({"method": "grpo", "lag": "onpolicy", "runs": [run]}, eval_last=1)
  assert {"metric": "test_gap_max", "value": 6.0} in [
    {k: r[k] for k in ("metric", "value")} for r in rows
  ]
  assert "test_gap_max" in registry.study_metrics(tables_only=True)


def test_declarations_are_checked():
  with pytest.raises(ValueError, match="reduction 'median'"):
    metric_names.Metric("x", "default", "u", "d", reduction="median")
  with pytest.raises(ValueError, match="study 'yes'"):
    metric_names.Metric("x", "default", "u", "d", study="yes")


def test_register_refuses_a_conflicting_or_misplaced_declaration(registry):
  with pytest.raises(ValueError, match="loss: declared before"):
    registry.register("train", registry.Metric("loss", "default", "u", "another meaning"))
  with pytest.raises(ValueError, match="belongs to group 'eval'"):
    registry.register("train", registry.Metric("eval/mine", "default", "u", "d"))
  same = registry.get("loss")
  assert registry.register("train", same) is same  # the same declaration again is a no-op


def test_every_declared_key_is_in_the_study_or_tensorboard_group_it_names():
  for group, g in metric_names.GROUPS.items():
    for m in g.metrics:
      assert metrics.tb_tag(m.name).startswith(group + "/"), m.name
      if m.name.endswith("_max"):
        assert m.reduction == metric_names.MAX, m.name
  assert set(metric_names.study_metrics(tables_only=True)) <= set(metric_names.study_metrics())
