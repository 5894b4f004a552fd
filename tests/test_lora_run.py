"""LoRA runs end to end: adapters only in the state, exact resume, base checks, other paths."""

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import config_schema, models  # noqa: E402
from offpolicy_jax.run import components, loop, start  # noqa: E402
from offpolicy_jax.store import metrics_files  # noqa: E402
from tests.test_loop import small_config, strip_timing  # noqa: E402

_LORA = {"lora.rank": 2, "lora.alpha": 4.0, "optimizer.learning_rate": 3e-3}


def _size(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def test_state_holds_adapters_only():
  cfg = small_config(**_LORA, **{"lag.sync_interval": 3, "loss.kl_coef": 0.01})
  comps = components.build_components(cfg)
  base, params = start.initial_weights(comps, warm_start=False)
  state = start.fresh_state(comps, params, base)
  mcfg = nnx.merge(comps.fns.model.graphdef, loop.weights(state)).config
  adapter = mcfg.num_adapter_params()
  assert adapter and _size(state.train.params) == adapter
  assert _size(base) == mcfg.num_params()
  assert _size(state.ref_params) == adapter  # the reference is the fresh adapter (B = 0)
  assert _size(state.snapshots.params) == adapter * state.snapshots.versions.shape[0]
  assert _size(state.train.opt_state) <= 2 * adapter + 8  # Adam moments and counts
  assert all(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(params, is_leaf=_is_var))
  assert config_schema.get(cfg, "lora.targets").split(",") == list(models.LORA_TARGETS)


def _is_var(x):
  return isinstance(x, nnx.Variable)


def test_lora_run_resumes_exactly_and_keeps_its_base(tmp_path):
  lag = {"lag.sync_interval": 3, "lag.sync_offset": 1, "task_kwargs.partial_credit": True, **_LORA}
  full = loop.train_and_evaluate(small_config(total_steps=8, **lag), str(tmp_path / "full"))
  part = str(tmp_path / "part")
  loop.train_and_evaluate(small_config(total_steps=5, **lag), part)
  loop.train_and_evaluate(small_config(total_steps=8, **lag), part)
  got_train, got_eval = metrics_files.split_rows(metrics_files.read_metrics(part))
  want_train, want_eval = metrics_files.split_rows(full)
  assert strip_timing(got_train) == strip_timing(want_train)
  assert got_eval[-1] == want_eval[-1]
  assert any(r["grad_norm"] > 0 for r in want_train)


def test_resume_on_another_base_is_refused(tmp_path):
  """Even where a config change is allowed, adapters never resume on another base."""
  work = str(tmp_path / "run")
  common = {"eval_prompts": 0, **_LORA}
  loop.train_and_evaluate(small_config(total_steps=3, **common), work)
  other = small_config(total_steps=6, **{"sft.steps": 4, **common})  # another warm-started base
  with pytest.raises(ValueError, match="refusing to resume on another base"):
    loop.train_and_evaluate(other, work, allow_config_change=True)
  # A warm start rebuilt with its blocks stacked differs from the per-layer one in the last
  # bits (scanned arithmetic): another base, refused naming the layout as the reason.
  stacked = small_config(total_steps=4, model_scan_layers=True, **common)
  with pytest.raises(ValueError, match="stores its blocks per layer.*model_scan_layers changed"):
    loop.train_and_evaluate(stacked, work, allow_config_change=True)


@pytest.mark.parametrize(
  "overrides",
  [
    {"lag.mode": "async", "lag.max_staleness": 2},
    {"rollout.partial_budget": 3, "lag.sync_interval": 2},
    {"loss.name": "decoupled_ppo", "train.num_minibatches": 2, "lag.sync_interval": 2},
  ],
  ids=["async", "partial", "decoupled_ppo"],
)
def test_other_paths_train_adapters(tmp_path, overrides):
  cfg = small_config(
    **{
      "total_steps": 4,
      "eval_prompts": 0,
      "sft.enabled": False,
      "task_kwargs.partial_credit": True,
      **_LORA,
      **overrides,
    }
  )
  rows = loop.train_and_evaluate(cfg, str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert any(r["grad_norm"] > 0 for r in rows)


@pytest.mark.slow  # about 80 s (two study cells); run with -m slow
def test_study_vmaps_adapters_over_a_shared_base():
  """Seeds vmapped together (one base, stacked adapters) equal seeds run one at a time."""
  from offpolicy_jax.study import cell as study_cell
  from offpolicy_jax.study import grid as study_grid
  from offpolicy_jax.study import sweeps
  from tests.test_study import mini_config

  base, grid = study_grid.grid_from_config(mini_config())
  base = sweeps.apply_overrides(base, {"lora.rank": 2})
  together = study_cell.run_cell(base, grid, "grpo", "onpolicy")
  apart = study_cell.run_cell(base, dataclasses.replace(grid, vmap_seeds=1), "grpo", "onpolicy")
  for a, b in zip(together["runs"], apart["runs"], strict=True):
    np.testing.assert_allclose(a["eval_accuracy"], b["eval_accuracy"])
    np.testing.assert_allclose(a["train_reward"], b["train_reward"], rtol=1e-5)


def _device_bytes(tree) -> int:
  d0 = jax.devices()[0]
  shards = (s for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == d0)
  return sum(s.data.nbytes for s in shards)


def test_planner_counts_adapters_as_the_run_holds_them():
  from offpolicy_jax.run import planner

  cfg = small_config(
    **{"lag.sync_interval": 4, "loss.kl_coef": 0.01, "sft.enabled": False}, **_LORA
  )
  comps = components.build_components(cfg)
  base, params = start.initial_weights(comps, warm_start=False)
  state = start.fresh_state(comps, params, base)
  got = planner.plan(cfg, devices=1, bytes_per_device=None, activations="analytic")
  assert abs(got.state_bytes - _device_bytes(state)) <= 64
  adapter = _device_bytes(params)
  slots = state.snapshots.versions.shape[0]
  assert got.bytes["lag snapshots"] == _device_bytes(state.snapshots.params) == slots * adapter
  assert got.bytes["reference params"] == adapter
  assert got.bytes["params"] == _device_bytes(base) + adapter
