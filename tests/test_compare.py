"""benchmarks/compare.py on a tiny protocol: our side only, peers skipped."""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "compare.py")
_spec = importlib.util.spec_from_file_location("compare", _PATH)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

_TINY = [
  "--layers", "1", "--hidden", "32", "--vocab", "64", "--prompts", "2", "--group", "2",
  "--prompt_len", "4", "--new_tokens", "4", "--rounds", "1", "--peak_size", "64",
]  # fmt: skip


def test_full_size_checkpoint_has_the_issue_parameter_count():
  config = compare.model_config(compare.Protocol())
  assert round(config.num_params() / 1e6, 1) == 21.1


def test_tiny_run_prints_tables_and_skips_peers(tmp_path, capsys):
  out_json = str(tmp_path / "table.json")
  table = compare.run(compare.parse_args([*_TINY, "--json", out_json]))
  printed = capsys.readouterr().out
  assert "| offpolicy_jax baseline |" in printed
  assert "| tunix GRPOLearner | skipped (no interpreter given) |" in printed
  assert "No peer ran" in printed
  assert "GFLOP/s (" in printed
  ours = table["rows"][0]
  assert ours["status"] is None and len(ours["rounds"]) == 1
  m = ours["median"]
  assert m["step_s"] >= m["generation_s"] > 0 and m["train_s"] > 0
  assert m["sampler_tok_s"] == pytest.approx(2 * 2 * 4 / m["generation_s"])
  with open(out_json) as f:
    assert json.load(f)["rows"][0]["system"] == "offpolicy_jax baseline"


def test_ratios_and_targets():
  ours = {"step_s": 2.0, "generation_s": 1.0, "train_s": 1.0, "sampler_tok_s": 300.0}
  peer = {"step_s": 4.0, "generation_s": 1.5, "train_s": None, "sampler_tok_s": 200.0}
  r = compare.ratios(ours, peer)
  assert r == {"step_s": 2.0, "generation_s": 1.5, "train_s": None, "sampler_tok_s": 1.5}
  assert compare._targets("tunix GRPOLearner", r) == "step >= 1.5x met; sampler >= 1.3x met"
  assert compare._targets("TRL GRPOTrainer", r) == "step >= 2.5x MISSED"

  class _Peer:
    label, system, error = "tunix", "tunix GRPOLearner (x)", None

  results = {"offpolicy_jax baseline": [ours], "tunix": [peer, peer]}
  table = compare.build_table(results, ["offpolicy_jax baseline"], [_Peer()], ["TRL"])
  assert [r["status"] for r in table["rows"]] == [None, None, "skipped (no interpreter given)"]
  (speedup,) = table["ratios"]
  assert speedup["peer"] == "tunix GRPOLearner (x)" and speedup["ratio"]["step_s"] == 2.0
  text = compare.format_tables(table, peak=1e9, flops=compare.model_flops(
    compare.model_config(compare.Protocol()), compare.Protocol()))  # fmt: skip
  assert "| offpolicy_jax baseline | tunix GRPOLearner (x) | 2.00x | 1.50x | - | 1.50x |" in text


def test_variants_and_train_options():
  variants = compare.parse_variants(
    "baseline:;mb:num_micro_batches=2,eps_low=0.1", compare.parse_options("temperature=1.0")
  )
  assert variants == {
    "baseline": {"temperature": 1.0},
    "mb": {"temperature": 1.0, "num_micro_batches": 2, "eps_low": 0.1},
  }
  for name, options in variants.items():
    compare.check_train_options(name, options)
  assert compare.parse_options("schedule=cosine") == {"schedule": "cosine"}
  with pytest.raises(ValueError, match=r"variant 'fast'.*\['not_an_option'\]"):
    compare.check_train_options("fast", {"not_an_option": True})
  with pytest.raises(ValueError, match="not key=value"):
    compare.parse_options("oops")
  with pytest.raises(ValueError, match="unique"):
    compare.parse_variants("a:;a:", {})
