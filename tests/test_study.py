"""Tests for the seeded study: statistics, the grid, a 2 x 2 x 2 miniature, the bandit."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import lag_study  # noqa: E402
from offpolicy_jax.rewards import tasks
from offpolicy_jax.run import components
from offpolicy_jax.store import workdir
from offpolicy_jax.study import bandit, report_aa, report_tables
from offpolicy_jax.study import cell as study_cell
from offpolicy_jax.study import grid as study_grid
from offpolicy_jax.study import report as study_report
from offpolicy_jax.study import runner as study
from offpolicy_jax.study import stats as study_stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bootstrap_interval_contains_the_mean_and_narrows_with_more_data():
  rng = np.random.default_rng(0)
  small = study_stats.bootstrap(rng.normal(0.5, 0.1, 5))
  large = study_stats.bootstrap(rng.normal(0.5, 0.1, 500))
  for iv in (small, large):
    assert iv.low <= iv.mean <= iv.high
  assert large.high - large.low < small.high - small.low
  assert large.contains(0.5)
  with pytest.raises(ValueError, match="non-finite"):
    study_stats.bootstrap([0.1, float("nan")])


def test_paired_verdict_sees_through_seed_spread():
  seeds = np.array([0.2, 0.5, 0.8, 0.35, 0.65])  # a wide spread of warm starts
  worse = seeds - np.array([0.05, 0.04, 0.06, 0.05, 0.05])
  assert study_stats.paired_verdict(worse, seeds)[1] == study_stats.WORSE
  assert study_stats.paired_verdict(seeds + 0.05, seeds)[1] == study_stats.BETTER
  diff, verdict = study_stats.paired_verdict(seeds, seeds)
  assert verdict == study_stats.SAME and diff.mean == diff.low == diff.high == 0
  # Unpaired, the same shift is buried in the spread.
  assert study_stats.bootstrap(worse).contains(study_stats.bootstrap(seeds).mean)
  with pytest.raises(ValueError, match="same seeds"):
    study_stats.paired_verdict(seeds, seeds[:3])


def test_run_summary_flags_collapse_and_skips():
  steps, reward = [0, 10, 20, 30], [0.5] * 30
  ok = study_stats.run_summary(steps, [0.4, 0.5, 0.55, 0.6], reward, last=2)
  assert ok["final_accuracy"] == pytest.approx(0.575) and not ok["collapsed"]
  assert ok["auc"] == pytest.approx(0.5) and ok["start_accuracy"] == 0.4
  assert study_stats.run_summary(steps, [0.4, 0.5, 0.3, 0.2], reward, last=2)["collapsed"]
  assert not study_stats.run_summary(steps, [0.4, 0.1, 0.3, 0.5], reward, last=2)["collapsed"]
  assert study_stats.run_summary(steps, [0.4] * 4, reward, last=2, skipped=1)["collapsed"]
  with pytest.raises(ValueError, match="warm-start"):
    study_stats.run_summary([10, 20], [0.1, 0.2], reward, last=1)


def test_grid_parsing_names_the_bad_field():
  methods = study_grid.parse_methods("grpo,red_drop=reinforce+red_drop")
  assert methods["red_drop"] == {"loss.name": "reinforce", "advantage.name": "red_drop"}
  assert methods["grpo"] == {"loss.name": "grpo"}
  assert study_grid.parse_lags("a=1/0,b=20/0,off=offline", 100) == {
    "a": (1, 0),
    "b": (20, 0),
    "off": (101, 0),
  }
  for spec, match in (("a=1", "config.study.lags"), ("a=0/1", "config.study.lags"), ("", "empty")):
    with pytest.raises(ValueError, match=match):
      study_grid.parse_lags(spec, 10)
  with pytest.raises(ValueError, match="duplicate"):
    study_grid.parse_methods("grpo,grpo")
  c = lag_study.get_config()
  _, grid = study_grid.grid_from_config(c)
  assert len(grid.methods) >= 8 and len(grid.lags) >= 5 and len(grid.seeds) >= 10
  assert len(study_grid.grid_from_config(lag_study.get_config("toy_full"))[1].methods) >= 16
  # The staleness axis to 256 updates, half a run or less; learning rates as methods.
  for scale, methods in (
    ("deep", {"grpo", "reinforce", "rec_oneside_nois", "m2po"}),
    ("deep_full", {"grpo", "reinforce", "rec_oneside_nois", "m2po", "decoupled_ppo", "tis_old"}),
  ):
    base, deep = study_grid.grid_from_config(lag_study.get_config(scale))
    stale = lambda m, n: m - 1 + n if m <= base.total_steps else 0  # the oldest batch's lag
    assert max(stale(m, n) for m, n in deep.lags.values()) in (255, 256)
    assert base.total_steps >= 2 * 256 and base.total_steps // base.eval_every >= 30
    assert methods <= set(deep.methods) and "onpolicy" in deep.lags
  _, lr = study_grid.grid_from_config(lag_study.get_config("lr"))
  rates = {m["optimizer.learning_rate"] for m in lr.methods.values()}
  assert rates == {1e-4, 3e-4, 1e-3} and len(lr.methods) == 9
  c.unlock()
  c.study.baseline = "grpo@nowhere"
  with pytest.raises(ValueError, match="config.study.baseline"):
    study_grid.grid_from_config(c)
  c = lag_study.get_config()
  c.unlock()
  c.mesh.sampler_devices = 2
  with pytest.raises(ValueError, match="config.mesh.sampler_devices"):
    study_grid.grid_from_config(c)


def test_a_lag_the_run_never_reaches_is_refused():
  for spec in ("late=1/10", "late=1/12", "late=11/0"):
    with pytest.raises(ValueError, match="config.study.lags: late=.*total_steps=10.*offline"):
      study_grid.parse_lags(spec, 10)
  assert study_grid.parse_lags("edge=1/9,whole=10/0", 10) == {"edge": (1, 9), "whole": (10, 0)}


def test_a_study_refuses_its_task_and_data_before_it_makes_a_workdir(tmp_path):
  path = str(tmp_path / "study")
  c = lag_study.get_config("bits")
  c.unlock()
  c.task_kwargs.max_n = 0  # reasoning-gym's own check is an assert
  task = "config.task_kwargs: task 'reasoning_gym:count_bits'"
  with pytest.raises(ValueError, match=f"{task}.*min_n must be between 1 and max_n"):
    study.run_study(c, path)
  c.task_kwargs.max_n, c.max_prompt_len = 2**16 - 1, 5  # prompts of up to 18 tokens
  with pytest.raises(ValueError, match="config.max_prompt_len"):
    study.run_study(c, path)
  assert not os.path.exists(path)


def test_lag_entries_carry_engine_mismatch_settings():
  spec = "onpolicy=1/0,bf16=1/0+bf16,stale_topk=1/8+topk5"
  assert study_grid.parse_lags(spec, 10) == {
    "onpolicy": (1, 0),
    "bf16": (1, 0),
    "stale_topk": (1, 8),
  }
  engines = study_grid.parse_engines(spec)
  assert set(engines) == {"bf16", "stale_topk"}
  assert engines["stale_topk"]["rollout.behavior_logp"] == "mismatched"
  with pytest.raises(ValueError, match="config.study.lags: x=.*unknown engine"):
    study_grid.parse_engines("x=1/0+fp8")
  # A method may not set what a lag's engine sets (the engine would overwrite it in the cell).
  c = lag_study.get_config()
  c.unlock()
  c.study.methods = "grpo,own=grpo;rollout.score_old=False"
  c.study.lags = spec
  c.study.aa_lags = ""
  with pytest.raises(ValueError, match=r"own sets rollout.score_old, which the engine of lag"):
    study_grid.grid_from_config(c)


def mini_config(**study_overrides):
  """2 methods (grpo and an identical twin) x 2 lags x 2 seeds, 4 steps each, tiny shapes."""
  c = lag_study.get_config()
  c.unlock()
  c.total_steps = 4
  c.eval_every = 2
  c.prompts_per_step = 2
  c.group_size = 4
  c.max_new_tokens = 6
  c.max_prompt_len = 12
  c.replay.capacity_batches = 1
  c.sft.steps = 3
  c.sft.batch_size = 8
  c.task_kwargs.num_eval = 16
  c.eval_prompts = 16
  c.eval_samples = 2
  c.study.methods = "grpo,twin=grpo"
  c.study.lags = "onpolicy=1/0,offline=offline"
  c.study.seeds = 2
  c.study.eval_last = 1
  c.study.bandit_steps = 20
  for k, v in study_overrides.items():
    c.study[k] = v
  c.lock()
  return c


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("study"))
  config = mini_config()
  cells = study.run_study(config, path, log=lambda s: None, isolation="inline")
  files = study_report.write_report(config, path, cells)
  return config, path, cells, files


def test_miniature_study_writes_tables_csv_and_plots(mini):
  config, path, cells, files = mini
  names = {os.path.basename(f) for f in files}
  assert names == {
    "study.csv",
    "study.md",
    "curves_onpolicy.png",
    "curves_offline.png",
    "final.png",
    "pareto.png",
  }
  assert all(os.path.getsize(f) > 0 for f in files)
  rows = study_report.read_csv(os.path.join(path, "study.csv"))
  finals = [r for r in rows if r["metric"] == "final_accuracy"]
  assert len(finals) == (2 + 1) * 2 * 2  # (methods + the A/A twin) x lags x seeds
  curve = [r for r in rows if r["metric"] == "eval_accuracy" and r["method"] == "grpo"]
  assert sorted({r["step"] for r in curve}) == [0, 2, 4]
  assert {r["metric"] for r in rows} >= {
    "auc",
    "collapsed",
    "start_accuracy",
    "pass@2",
    "accuracy_auc",
    "steps_to_threshold",
    "threshold_reached",
  }
  text = open(os.path.join(path, "study.md")).read()
  # The twin's runs equal grpo's: difference exactly 0, marked `=` (no test, not counted).
  line = next(x for x in text.splitlines() if x.startswith("| twin |"))
  assert line.count(" = ") == 2
  assert "+0.000 [+0.000, +0.000]" in text.split("## Paired difference")[1].split("##")[0]
  assert "## Bandit" in text
  # Tokens to the threshold: per cell with k/n reached, paired with the baseline method.
  tokens = text.split("### Sampled tokens to reach it")[1].split("###")[0]
  assert "(2/2)" in tokens or "(1/2)" in tokens or "(0/2)" in tokens
  assert "Paired difference to grpo in the same lag" in tokens
  for cell in cells.values():
    assert {r["seed"] for r in cell["runs"]} == {0, 1}
    offline = cell["lag"] == "offline"
    stale = [max(r["staleness_mean"]) for r in cell["runs"]]
    assert stale == ([3.0, 3.0] if offline else [0.0, 0.0])
    # What each run spent: tokens are its own, seconds the vmapped program's share.
    for run in cell["runs"]:
      c = run["costs"]
      assert c["sampled_tokens"] > 0 and c["trained_tokens"] > 0
      assert c["train_wall_s"] > 0 and c["seeds_per_program"] == 2
  spent = {(r["method"], r["lag"], r["seed"]) for r in rows if r["metric"] == "sampled_tokens"}
  assert len(spent) == len(finals)
  assert "## Cost per run" in text and "`train_wall_s`" in text
  # Tokens to the threshold: the running total at the step the run reached it (or the end).
  by = {(r["method"], r["lag"], r["seed"], r["metric"]): r["value"] for r in rows if not r["step"]}
  for cell in cells.values():
    for run in cell["runs"]:
      steps, _ = study_stats.steps_to_threshold(run["eval_steps"], run["eval_accuracy"])
      at = run["eval_sampled_tokens"][run["eval_steps"].index(steps)]
      key = (cell["method"], cell["lag"], run["seed"], "tokens_to_threshold")
      assert by[key] == at > 0 and run["eval_sampled_tokens"][-1] == run["costs"]["sampled_tokens"]


def test_interrupted_study_reruns_only_missing_cells_and_gets_the_same_numbers(mini, tmp_path):
  """The rerun's cell runs in a worker process, from the warm starts the first run stored;
  the rerun returns (and reports) the cells in the grid's order, not the order they finished."""
  config, path, cells, _ = mini
  _, grid = study_grid.grid_from_config(config)
  first = grid.cells()[0]
  victim = study.cell_path(path, *first)
  before = {f: os.path.getmtime(study.cell_path(path, *f)) for f in cells if f != first}
  starts = os.path.join(path, study.STARTS_DIR)
  assert sorted(x for x in os.listdir(starts) if x.isdigit()) == ["0", "1"]  # the two seeds
  stored = {x: os.path.getmtime(os.path.join(starts, x)) for x in os.listdir(starts)}
  os.remove(victim)
  logs = []
  again = study.run_study(config, path, log=logs.append)  # isolation="process"
  assert "5/6 cells done, 1 to run" in logs[0]
  assert {f: os.path.getmtime(study.cell_path(path, *f)) for f in before} == before
  assert {x: os.path.getmtime(os.path.join(starts, x)) for x in os.listdir(starts)} == stored
  assert os.path.exists(os.path.join(path, "cells", f"{first[0]}@{first[1]}.log"))
  old, new = cells[first]["runs"], again[first]["runs"]
  for a, b in zip(old, new, strict=True):
    np.testing.assert_allclose(a["eval_accuracy"], b["eval_accuracy"])
    np.testing.assert_allclose(a["train_reward"], b["train_reward"], rtol=1e-5)
  assert list(again) == list(grid.cells())
  assert again[first]["machine"] == study.machine()
  # A cell from another machine is named when the study resumes (nothing left to run here).
  record = json.load(open(victim))
  with open(victim, "w") as f:
    json.dump({**record, "machine": {**record["machine"], "cpu_flags": ["elsewhere"]}}, f)
  logs = []
  study.run_study(config, path, log=logs.append, isolation="inline")
  assert any("1 finished cells ran on another machine" in x and first[0] in x for x in logs), logs
  with open(victim, "w") as f:
    json.dump(record, f)
  shuffled = dict(reversed(list(again.items())))
  study_report.write_report(config, str(tmp_path), shuffled)
  header = next(x for x in open(tmp_path / "study.md") if x.startswith("| method |"))
  assert header == "| method | onpolicy | offline |\n", header


def test_changed_config_is_refused_and_corrupt_cell_is_named(mini):
  _, path, _, _ = mini
  with pytest.raises(workdir.ConfigChanged, match="study.seeds"):
    study.run_study(mini_config(seeds=3), path, log=lambda s: None, isolation="inline")
  victim = study.cell_path(path, "grpo", "onpolicy")
  with open(victim, "w") as f:
    f.write("{not json")
  _, grid = study_grid.grid_from_config(mini_config())
  with pytest.raises(ValueError, match="grpo@onpolicy.json"):
    study.load_cells(path, grid)


def test_a_study_takes_more_methods_but_not_a_changed_or_dropped_one(tmp_path):
  path = str(tmp_path)
  study._check_config(path, mini_config())  # methods "grpo,twin=grpo"
  for methods in ("grpo,twin=reinforce", "grpo", "grpo,twin=grpo;optimizer.learning_rate=1.0"):
    with pytest.raises(workdir.ConfigChanged, match="study.methods"):
      study._check_config(path, mini_config(methods=methods))
  study._check_config(path, mini_config(methods="grpo,wide=rec_oneside_nois_wide,twin=grpo"))
  assert study.stored_config(path).study.methods == "grpo,wide=rec_oneside_nois_wide,twin=grpo"
  # Lags likewise: one more is taken, a changed or dropped one is not.
  base = {"methods": "grpo,wide=rec_oneside_nois_wide,twin=grpo"}
  for lags in ("onpolicy=1/0,offline=2/0", "onpolicy=1/0", "onpolicy=2/0,offline=offline"):
    with pytest.raises(workdir.ConfigChanged, match="study.lags"):
      study._check_config(path, mini_config(**base, lags=lags))
  study._check_config(path, mini_config(**base, lags="onpolicy=1/0,interval2=2/0,offline=offline"))
  assert study.stored_config(path).study.lags == "onpolicy=1/0,interval2=2/0,offline=offline"


def test_a_study_resumes_after_changes_no_cell_depends_on(tmp_path):
  """The cell key is read from the schema roles (no cells run here)."""
  path = str(tmp_path)
  study._check_config(path, mini_config())
  free = mini_config(vmap_seeds=1, eval_batch=4, eval_last=2, baseline="twin@offline")
  free.unlock()
  free.checkpoint_every, free.log_every, free.mesh.data, free.reward_workers = 5, 1, 2, 3
  study._check_config(path, free)
  # The stored config follows the report's fields, so the tables rebuild from it.
  assert study.stored_config(path).study.baseline == "twin@offline"
  for overrides in ({"total_steps": 6}, {"eval_prompts": 8}, {"lag.sync_offset": 1}):
    changed = mini_config()
    changed.update_from_flattened_dict(overrides)
    with pytest.raises(workdir.ConfigChanged, match=next(iter(overrides))):
      study._check_config(path, changed)
    with pytest.raises(workdir.ConfigChanged, match=next(iter(overrides))):
      study.check_report_config(path, changed)  # --report_only
  with pytest.raises(ValueError, match="no study here"):
    study.check_report_config(str(tmp_path / "nothing"), mini_config())
  # The binary refuses a mistyped workdir without creating it.
  missing = tmp_path / "typo"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.study",
      "--config=configs/lag_study.py",
      f"--workdir={missing}",
      "--report_only",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 1 and "no study here" in out.stderr, out.stderr
  assert not missing.exists()


def test_plot_binary_redraws_from_the_csv(mini, tmp_path):
  _, path, _, _ = mini
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.plot",
      f"--study_csv={os.path.join(path, 'study.csv')}",
      f"--out={tmp_path}",
      "--baseline=grpo@onpolicy",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  assert sorted(os.listdir(tmp_path)) == [
    "curves_offline.png",
    "curves_onpolicy.png",
    "final.png",
    "pareto.png",
  ]


def test_study_binary_refuses_bad_grid_in_one_line(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.study",
      "--config=configs/lag_study.py",
      f"--workdir={tmp_path}",
      "--config.study.lags=onpolicy=1/0,broken=7",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 1
  assert out.stderr.strip().splitlines() == [
    next(x for x in out.stderr.splitlines() if x.startswith("error: config.study.lags"))
  ]


def test_bandit_fixed_behaviour_reinforce_takes_the_trap_on_policy_finds_the_best():
  methods = study_grid.parse_methods("reinforce,rec_oneside_nois")
  res = {(r["method"], r["setting"]): r for r in bandit.run_bandit(methods, (0, 1, 2), steps=300)}
  assert res["reinforce", "fixed"]["trap_frac"] == 1.0
  assert res["reinforce", "onpolicy"]["best_frac"] == 1.0
  assert all(r["finite"] for r in res.values())
  # The one-sided mask keeps the policy near the behaviour: the trap gains far less.
  assert (
    res["rec_oneside_nois", "fixed"]["pi_trap"].mean < res["reinforce", "fixed"]["pi_trap"].mean
  )
  lines = bandit.table(list(res.values()), steps=300, group_size=8, seeds=3)
  assert sum(x.startswith("| reinforce |") for x in lines) == 2
  assert json.dumps([str(r["pi_best"]) for r in res.values()])


def test_seeds_one_at_a_time_and_batched_evaluation_give_the_same_cell(mini):
  config, _, cells, _ = mini
  base, grid = study_grid.grid_from_config(config)
  grid = dataclasses.replace(grid, vmap_seeds=1, eval_batch=5)  # 16 prompts: 5+5+5+1
  cell = study_cell.run_cell(base, grid, "grpo", "onpolicy")
  for a, b in zip(cell["runs"], cells["grpo", "onpolicy"]["runs"], strict=True):
    np.testing.assert_allclose(a["eval_accuracy"], b["eval_accuracy"])
    np.testing.assert_allclose(a["train_reward"], b["train_reward"], rtol=1e-5)


def test_a_cell_with_ope_estimates_every_buffer_and_trains_as_without(mini):
  """`study.ope`: each evaluation's estimates and truth per seed, in [0, 1]; training unchanged."""
  config, _, cells, _ = mini
  base, grid = study_grid.grid_from_config(config)
  cell = study_cell.run_cell(base, dataclasses.replace(grid, ope=("is", "wis")), "grpo", "onpolicy")
  for a, b in zip(cell["runs"], cells["grpo", "onpolicy"]["runs"], strict=True):
    np.testing.assert_allclose(a["train_reward"], b["train_reward"], rtol=1e-5)
    ope = a["ope"]
    assert len(ope["truth"]) == len(a["eval_steps"]) - 1  # every evaluation after step 0
    assert all(0.0 <= x <= 1.0 for x in ope["truth"] + ope["ope/is"] + ope["ope/behavior_reward"])
    summary = study_report.ope_summary(ope)
    assert set(summary) == {
      "ope_is_abs_error", "ope_is_coverage", "ope_wis_abs_error", "ope_wis_coverage",
      "ope_behavior_abs_error",
    }  # fmt: skip
    assert 0.0 <= summary["ope_is_coverage"] <= 1.0


def test_the_pareto_fronts_are_the_cells_no_other_beats_on_cost_and_accuracy():
  """study.md's Pareto fronts: one point per grid cell (A/A twins apart), means over seeds."""
  cells = {  # (method, lag): (final accuracy, training seconds, sampled tokens), per seed
    ("grpo", "onpolicy"): [(0.6, 10.0, 100.0), (0.8, 12.0, 120.0)],  # 0.7, 11 s, 110 tokens
    ("grpo", "offline"): [(0.5, 4.0, 300.0), (0.5, 6.0, 300.0)],  # 0.5, 5 s, 300 tokens
    ("rec", "onpolicy"): [(0.6, 20.0, 90.0), (0.6, 20.0, 90.0)],  # 0.6, 20 s, 90 tokens
    ("rec", "offline"): [(0.4, 8.0, 200.0), (0.4, 8.0, 200.0)],  # dominated on both
    (study_grid.AA_PREFIX + "grpo", "onpolicy"): [(1.0, 1.0, 1.0), (1.0, 1.0, 1.0)],
  }
  rows = []
  for (method, lag), runs in cells.items():
    for seed, (acc, wall, tokens) in enumerate(runs):
      for metric, value in (
        ("final_accuracy", acc),
        ("train_wall_s", wall),
        ("sampled_tokens", tokens),
      ):
        rows.append(
          {
            "method": method,
            "lag": lag,
            "seed": seed,
            "metric": metric,
            "step": None,
            "value": value,
          }
        )
  runs = study_report.pareto_runs(rows)
  assert sorted(runs) == ["grpo@offline", "grpo@onpolicy", "rec@offline", "rec@onpolicy"]
  assert runs["grpo@onpolicy"][1] == {
    "final_accuracy": 0.8,
    "wall_s": 12.0,
    "sampled_tokens": 120.0,
  }
  lines = study_report.pareto_lines(runs)
  assert lines[-2] == "- seconds: grpo@offline (5, 0.500), grpo@onpolicy (11, 0.700)"
  assert lines[-1] == "- sampled tokens: rec@onpolicy (90, 0.600), grpo@onpolicy (110, 0.700)"
  # Runs that record no costs (studies before them) get neither the plot nor the section.
  no_costs = [r for r in rows if r["metric"] == "final_accuracy"]
  assert study_report.pareto_runs(no_costs) == {}
  assert study_report.pareto_lines({}) == []


def test_a_metric_whose_aa_rate_exceeds_alpha_reports_no_findings():
  """A/A pairs that differ flag every `better`/`worse` of that metric as not a finding."""
  seeds = range(12)
  rows = []

  def put(method, lag, metric, values):
    rows.extend(
      {"method": method, "lag": lag, "seed": s, "metric": metric, "step": None, "value": v}
      for s, v in zip(seeds, values, strict=True)
    )

  base = [0.3 + 0.01 * s for s in seeds]
  for lag in ("onpolicy", "offline"):
    put("grpo", lag, "final_accuracy", base)
    put("grpo", lag, "start_accuracy", [0.2] * 12)
    put("reinforce", lag, "final_accuracy", [v - 0.2 for v in base])  # worse everywhere
    # The twin at "offline" is ahead on every seed: a false `better` (1/1 > alpha: the
    # on-policy pair is all ties, left out of the rate).
    put("aa-grpo", lag, "final_accuracy", [v + 0.1 * (lag == "offline") for v in base])
  kw = dict(baseline=("grpo", "onpolicy"), title="t", alpha=0.05)
  text = "\n".join(report_tables.tables(rows, **kw))
  assert "worse†" in text and "not reported as a finding" in text
  assert "are not reported as findings († in the tables): final_accuracy" in text
  # With a calibrated twin (equal at both lags: all ties, left out), no flag.
  calibrated = [r for r in rows if r["method"] != "aa-grpo"]
  for lag in ("onpolicy", "offline"):
    calibrated += [
      {**r, "method": "aa-grpo", "lag": lag}
      for r in rows
      if r["method"] == "grpo" and r["lag"] == lag and r["metric"] == "final_accuracy"
    ]
  text = "\n".join(report_tables.tables(calibrated, **kw))
  assert "worse" in text and "†" not in text


def test_plots_need_summaries_and_accept_rows_before_and_after_the_csv(mini, tmp_path):
  config, path, cells, _ = mini
  _, grid = study_grid.grid_from_config(config)
  fresh = [r for c in cells.values() for r in study_report.cell_rows(c, grid.eval_last)]
  read = study_report.read_csv(os.path.join(path, "study.csv"))
  assert report_tables.summary_table(fresh)[2] == report_tables.summary_table(read)[2]
  curves = [r for r in read if r["step"] is not None]
  with pytest.raises(ValueError, match="final_accuracy"):
    study_report.plot_study(curves, str(tmp_path), baseline=grid.baseline)


def test_unknown_loss_and_wrong_shape_cells_are_refused_naming_them(mini, tmp_path):
  with pytest.raises(ValueError, match="config.study.methods: foo: config.loss.name: unknown"):
    study_grid.grid_from_config(mini_config(methods="grpo,foo=nosuchloss"))
  config, path, cells, _ = mini
  _, grid = study_grid.grid_from_config(config)
  for key, cell in cells.items():  # undo what earlier tests did to the files
    with open(study.cell_path(path, *key), "w") as f:
      json.dump(cell, f)
  victim = study.cell_path(path, "twin", "onpolicy")
  with open(victim) as f:
    cell = json.load(f)
  cell["runs"] = cell["runs"][:1]
  with open(victim, "w") as f:
    json.dump(cell, f)
  with pytest.raises(ValueError, match="twin@onpolicy.json"):
    study.load_cells(path, grid)
  with pytest.raises(ValueError, match="not a study CSV"):
    (tmp_path / "x.png").write_bytes(b"\x89PNG\r\n")
    study_report.read_csv(str(tmp_path / "x.png"))


def _host_scored_cell(config, monkeypatch, **task_changes) -> dict:
  """grpo@offline of `config`'s grid with the task's reward scored on the host (the sandboxed
  workers), with `task_changes` to the task."""
  base, grid = study_grid.grid_from_config(config)
  real_get_task = tasks.get_task
  monkeypatch.setattr(
    tasks,
    "get_task",
    lambda name, **kw: dataclasses.replace(
      real_get_task(name, **kw), device_reward=None, **task_changes
    ),
  )
  components.clear_cache()
  try:
    return study_cell.run_cell(base, grid, "grpo", "offline")
  finally:
    components.clear_cache()


def test_host_scored_task_runs_the_same_cell_as_the_device_reward(mini, monkeypatch):
  """The study's host-reward path (vmapped rollout, sandboxed scoring per seed, vmapped
  learning) gives the device-reward path's numbers: the synthetic task's host twin."""
  config, _, cells, _ = mini
  cell = _host_scored_cell(config, monkeypatch)
  for a, b in zip(cell["runs"], cells["grpo", "offline"]["runs"], strict=True):
    np.testing.assert_allclose(a["eval_accuracy"], b["eval_accuracy"])
    np.testing.assert_allclose(a["train_reward"], b["train_reward"], rtol=1e-5)
    np.testing.assert_allclose(a["staleness_mean"], b["staleness_mean"])


def _reward_that_raises(example, text):
  raise RuntimeError("a verifier that fails on every answer")


def test_failed_host_rewards_are_counted_per_run_and_reported(mini, monkeypatch):
  """Every sandboxed reward fails (scored 0): each run counts its evaluation and training
  failures, the CSV keeps them and study.md tabulates them; the device-reward cells have none."""
  config, _, cells, _ = mini
  cell = _host_scored_cell(config, monkeypatch, reward=_reward_that_raises)
  rows_per_step = config.prompts_per_step * config.group_size
  for run in cell["runs"]:
    failed = run["reward_failures"]
    assert failed["train_reward_failures"] == config.total_steps * rows_per_step, failed
    evaluations = len(run["eval_steps"])
    assert failed["eval_reward_failures"] > 0 and failed["eval_reward_failures"] % evaluations == 0
    assert max(run["eval_accuracy"]) == 0.0
  ok = cells["grpo", "onpolicy"]["runs"][0]["reward_failures"]
  assert ok == {"eval_reward_failures": 0.0, "train_reward_failures": 0.0}
  rows = study_report.cell_rows(cell, config.study.eval_last)
  assert {r["metric"] for r in rows} >= {"eval_reward_failures", "train_reward_failures"}
  # The section appears only where something failed.
  quiet = study_report.cell_rows(cells["grpo", "onpolicy"], config.study.eval_last)
  assert "## Reward failures" in "\n".join(study_report.tables(config, quiet + rows))
  assert "## Reward failures" not in "\n".join(study_report.tables(config, quiet))


def test_engine_settings_reach_the_cells_config_and_the_report(mini, monkeypatch, tmp_path):
  """A `+engine` lag builds its cell with the engine's overrides; study.md tabulates diagnostics.

  (End to end: configs/mismatch_study.py, docs/off_policyness.md; the recorded factors
  themselves are tested through the loop in test_loop.)
  """
  config = mini_config(methods="tis_old", lags="topk5=1/0+topk5", baseline="tis_old@topk5")
  base, grid = study_grid.grid_from_config(config)
  built = []

  def capture(cfg):
    built.append(cfg)
    raise KeyboardInterrupt

  monkeypatch.setattr(components, "build_components", capture)
  with pytest.raises(KeyboardInterrupt):
    study_cell.run_cell(base, grid, "tis_old", "topk5")
  cfg = built[0]
  assert (cfg.top_k, cfg.rollout.behavior_logp, cfg.rollout.score_old) == (5, "mismatched", True)
  # The report's diagnostics section, from the miniature study's records.
  mini_cfg, _, cells, _ = mini
  _, mini_grid = study_grid.grid_from_config(mini_cfg)
  rows = []
  for cell in cells.values():
    cell = json.loads(json.dumps(cell))
    for run in cell["runs"]:
      run["off_policy"] = {"mismatch_kl_k3": 0.25, "staleness_kl_k3": 0.5}
    rows += study_report.cell_rows(cell, mini_grid.eval_last)
  md = report_tables.write_tables(
    rows, str(tmp_path / "study.md"), baseline=mini_grid.baseline, title="t"
  )
  section = open(md).read().split("## Off-policy diagnostics")[1]
  assert "`mismatch_kl_k3`" in section and "| grpo | 0.25 | 0.25 |" in section


def test_aa_twin_runs_the_baseline_with_other_streams_and_the_report_counts_it(mini):
  """The A/A path end to end: `aa-grpo` cells at both lags (the default `aa_lags=all`)."""
  config, path, cells, _ = mini
  _, grid = study_grid.grid_from_config(config)
  assert grid.aa_method == "aa-grpo" and grid.aa_lags == ("onpolicy", "offline")
  for lag_name in grid.lags:
    aa, base = cells["aa-grpo", lag_name], cells["grpo", lag_name]
    twin = cells["twin", lag_name]
    assert aa["aa_of"] == "grpo" and aa["stream_offset"] == study_grid.AA_STREAM_OFFSET
    for a, b, t in zip(aa["runs"], base["runs"], twin["runs"], strict=True):
      assert a["seed"] == b["seed"]
      assert a["eval_accuracy"][0] == b["eval_accuracy"][0]  # the same warm start
      # The twin (same streams) samples the same tokens, bit for bit; the A/A twin other
      # tokens (the miniature's rewards are all 0, so its diagnostics tell them apart).
      assert t["off_policy"] == b["off_policy"]
      assert a["off_policy"]["behavior_kl_k3"] != b["off_policy"]["behavior_kl_k3"]
  rows = study_report.read_csv(os.path.join(path, "study.csv"))
  _, lags, values = report_tables.summary_table(rows)
  tests = report_aa.aa_tests(values, ["aa-grpo"], lags, [0, 1], 0.05)
  assert [(t[1], t[2]) for t in tests] == [
    (g, m) for g in ("onpolicy", "offline") for m in report_aa.AA_METRICS
  ]
  text = open(os.path.join(path, "study.md")).read()
  # With 2 seeds a two-sided sign-flip p-value is at least 2/4: no A/A verdict can be false.
  assert all(t[3].p >= 0.5 and t[4] == study_stats.SAME for t in tests)
  # The miniature's 3-step warm start solves nothing: every accuracy is 0, so every pair's
  # differences are 0 and none counts (the counting itself: tests/test_study_stats.py).
  assert all(r["eval_accuracy"] == [0.0] * 3 for c in cells.values() for r in c["runs"])
  headline = "A/A false-verdict rate (final accuracy, permutation test at alpha = 0.05): "
  assert headline + "no informative pair; nominal 0.05." in text
  assert "left out of the rates: 6 comparisons" in text
  section = text.split("## A/A calibration")[1].split("\n## ")[0]
  assert sum(x.startswith("| aa-grpo |") for x in section.splitlines()) == 6
  # The twin is no method of the grid's tables.
  grid_table = text.split("## Final greedy accuracy")[1].split("## Paired")[0]
  # Every difference is 0: each comparison is `=` and none is tested (nor counted by Holm).
  assert "aa-grpo" not in grid_table and "The grid has no comparison to test." in grid_table
  assert "`=` when every per-seed difference is exactly 0 (3 of the 3" in grid_table


def test_aa_lags_and_reserved_names_are_checked():
  _, grid = study_grid.grid_from_config(mini_config(aa_lags="offline"))
  assert grid.aa_lags == ("offline",)
  assert grid.cells()[-1] == ("aa-grpo", "offline") and len(grid.cells()) == 5
  assert study_grid.grid_from_config(mini_config(aa_lags=""))[1].aa_lags == ()
  for spec in ("nowhere", "offline,offline"):
    with pytest.raises(ValueError, match="config.study.aa_lags"):
      study_grid.grid_from_config(mini_config(aa_lags=spec))
  with pytest.raises(ValueError, match="config.study.methods: 'aa-x'"):
    study_grid.grid_from_config(mini_config(methods="grpo,aa-x=grpo"))


STUDY_DRIVER = """
import json
import os
import signal

from offpolicy_jax.study import runner


# Stands in for a cell; the worker processes import this file too, so they run it.
def run_cell(base, grid, method, lag_name, starts=None):
  path = os.environ["STUDY_DIR"]
  with open(os.path.join(path, "calls.txt"), "a") as f:
    f.write(f"{method}@{lag_name}\\n")
  if not os.path.exists(os.path.join(path, "fixed")):
    if (method, lag_name) == ("grpo", "offline"):
      os.kill(os.getpid(), signal.SIGSEGV)  # what XLA did after ~50 cells in one process
    if (method, lag_name) == ("twin", "onpolicy"):
      raise FloatingPointError("cell | blew up")
  runs = [
    {
      "seed": s,
      "eval_steps": [0, 2, 4],
      "eval_accuracy": [0.25, 0.4, 0.5 + 0.1 * s],
      "train_reward": [0.5, 0.5, 0.5, 0.5],
      "staleness_mean": [0.0] * 4,
      "skipped": 0.0,
    }
    for s in grid.seeds
  ]
  return {"method": method, "lag": lag_name, "schedule": list(grid.lags[lag_name]), "runs": runs}


runner.run_cell = run_cell

if __name__ == "__main__":
  from experiments import study
  from offpolicy_jax import cli

  cli.run(study.main)
"""


def test_a_crashed_cell_costs_that_cell_only_and_a_rerun_retries_it(tmp_path):
  """Worker processes: a segfault and an exception fail their cells; the rest and a rerun go on.

  grpo's worker dies in its second cell; twin's first cell raises and its worker runs the next.
  """
  (tmp_path / "driver.py").write_text(STUDY_DRIVER)
  path = tmp_path / "study"
  env = {**os.environ, "PYTHONPATH": REPO, "STUDY_DIR": str(path)}
  cmd = [
    sys.executable,
    str(tmp_path / "driver.py"),
    "--config=configs/lag_study.py",
    f"--workdir={path}",
    "--config.study.methods=grpo,twin=grpo",
    "--config.study.lags=onpolicy=1/0,offline=offline",
    "--config.study.aa_lags=",
    "--config.study.seeds=2",
  ]
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert "2 of 4 study cells failed: grpo@offline, twin@onpolicy" in out.stderr
  assert "  grpo@offline: killed by SIGSEGV" in out.stderr
  assert "  twin@onpolicy: FloatingPointError: cell | blew up" in out.stderr
  assert "[2/4 cells, 2 failed, 4/8 runs] twin@offline" in out.stdout
  assert "Traceback" in (path / "cells" / "twin@onpolicy.log").read_text()
  assert sorted(os.listdir(path / "cells")) == [
    "grpo@offline.log",
    "grpo@onpolicy.json",
    "grpo@onpolicy.log",
    "twin@offline.json",
    "twin@offline.log",
    "twin@onpolicy.error",
    "twin@onpolicy.log",
  ]

  (path / "fixed").write_text("")
  again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert "2/4 cells done, 2 to run" in again.stdout, again.stderr[-3000:]
  assert again.returncode == 0, again.stderr[-3000:]
  assert (path / "study.md").exists()
  calls = (path / "calls.txt").read_text().split()
  assert calls[4:] == ["grpo@offline", "twin@onpolicy"]  # only the failed ones again


def test_stored_warm_starts_are_read_not_trained_and_a_corrupt_one_is_named(
  mini, tmp_path, monkeypatch
):
  config, path, _, _ = mini
  from offpolicy_jax.store import checkpointing
  from offpolicy_jax.study import warm_starts

  base, grid = study_grid.grid_from_config(config)
  comps = components.build_components(base)
  trained = warm_starts.warm_start(comps, 1, base_seed=0)  # the sft cache: no training here
  copy = tmp_path / "warm_starts"
  shutil.copytree(os.path.join(path, study.STARTS_DIR), copy)

  def no_training(*args, **kwargs):
    raise AssertionError("trained again")

  monkeypatch.setattr(warm_starts, "warm_start", no_training)
  starts = warm_starts.Starts(str(copy))
  try:
    got_base, got = starts.get(comps, 1, base_seed=0)
  finally:
    starts.close()
  assert got_base is None
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(trained[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  victim = max((p for p in (copy / "1").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  victim.write_bytes(b"\0" * victim.stat().st_size)
  starts = warm_starts.Starts(str(copy))
  try:
    with pytest.raises(checkpointing.CheckpointError, match=r"warm start of seed 1 is unreadable"):
      starts.get(comps, 1, base_seed=0)
  finally:
    starts.close()


def test_a_method_entry_can_set_how_the_rl_phase_learns_and_nothing_shared():
  methods = study_grid.parse_methods(
    "grpo,red_drop=reinforce+red_drop,"
    "reinforce_lr1e3=reinforce;optimizer.learning_rate=1e-3,"
    "wide=rec_oneside_nois;loss.eps_low=0.6;loss.eps_high=2.0"
  )
  assert methods["reinforce_lr1e3"] == {"loss.name": "reinforce", "optimizer.learning_rate": 1e-3}
  assert methods["wide"] == {
    "loss.name": "rec_oneside_nois",
    "loss.eps_low": 0.6,
    "loss.eps_high": 2.0,
  }
  with pytest.raises(ValueError, match=r"x: sft.steps cannot differ between methods"):
    study_grid.parse_methods("x=grpo;sft.steps=3")  # the warm start is shared by a seed's cells
  with pytest.raises(ValueError, match=r"x: 'foo' is not field=value"):
    study_grid.parse_methods("x=grpo;foo")
  with pytest.raises(ValueError, match=r"name it first"):
    study_grid.parse_methods("grpo;optimizer.learning_rate=1e-3")
  for bad, match in (
    ("optimizer.learning_rate=abc", r"optimizer.learning_rate='abc'"),
    ("optimizer.foo.bar=1", r"'optimizer.foo.bar': no such config field"),
    ("rollout.continuous_auto_steps=2", r"config.rollout.continuous_auto_steps"),
  ):
    with pytest.raises(ValueError, match=rf"config.study.methods: m: .*{match}"):
      study_grid.grid_from_config(mini_config(methods=f"grpo,m=grpo;{bad}"))
  # How the fields fit together is checked per method (a run's validate_config), and a bad
  # shared value is named as itself, not as the first method's.
  with pytest.raises(ValueError, match=r"config.study.methods: m: config.train.num_minibatches"):
    study_grid.grid_from_config(mini_config(methods="grpo,m=grpo;train.num_minibatches=7"))
  shared = mini_config()
  shared.unlock()
  shared.optimizer.b2 = 1.5
  with pytest.raises(ValueError, match=r"^config.optimizer.b2"):
    study_grid.grid_from_config(shared)
  with pytest.raises(ValueError, match=r"config.study.methods: bad: .*no such config field"):
    study_grid.grid_from_config(mini_config(methods="grpo,bad=grpo;optimizer.no_such=1"))
  with pytest.raises(
    ValueError, match=r"config.study.methods: neg: config.optimizer.learning_rate"
  ):
    study_grid.grid_from_config(mini_config(methods="grpo,neg=grpo;optimizer.learning_rate=-1.0"))


RESULTS = os.path.join(REPO, "experiments", "results")
# Studies committed before every study kept its per-run data (none left: the one such
# study not rerun is kept in docs/results/history).
WITHOUT_CSV: set[str] = set()


def test_committed_studies_keep_their_per_run_csv_and_their_tables_rebuild_from_it():
  """A committed study.md is what its study.csv and study_config.json give (bandit aside)."""
  studies = {d for d in os.listdir(RESULTS) if os.path.exists(os.path.join(RESULTS, d, "study.md"))}
  without = {d for d in studies if not os.path.exists(os.path.join(RESULTS, d, "study.csv"))}
  assert without == WITHOUT_CSV, "commit a study's study.csv and study_config.json with it"
  assert studies - without
  for name in sorted(studies - without):
    path = os.path.join(RESULTS, name)
    rows = study_report.read_csv(os.path.join(path, "study.csv"))
    assert {"method", "lag", "seed", "metric", "step", "value"} <= set(rows[0])
    tables = study_report.tables(study.stored_config(path), rows)
    text = open(os.path.join(path, "study.md")).read()
    assert text.startswith("\n".join(tables) + "\n\n## Bandit"), name
