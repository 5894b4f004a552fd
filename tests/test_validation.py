"""Tests for offpolicy_jax.validation: every config field and every data check names the field."""

import json
import math
import os
import sys

import ml_collections
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import code, default, lag_study  # noqa: E402
from offpolicy_jax import models  # noqa: E402
from offpolicy_jax.models.tokenizers import CharTokenizer  # noqa: E402
from offpolicy_jax.rewards import tasks  # noqa: E402
from offpolicy_jax.rewards.tasks import ListSource, Task  # noqa: E402
from offpolicy_jax.rollout import data  # noqa: E402
from offpolicy_jax.run import data_checks, validation  # noqa: E402

TOK = CharTokenizer()
INF, NAN = math.inf, math.nan
FLOAT_OVERRIDES = [k for k in validation.LOSS_OVERRIDES if k != "agg"]

# Every field of configs/default.py's base_config, with values its check rejects:
# (field set, bad value, field the error must name). `test_every_field_is_covered`
# fails when a field is added to base_config without a row here.
BAD = [
  ("seed", -1, "seed"),
  ("seed", 2**31, "seed"),
  ("seed", 1.5, "seed"),
  ("total_steps", 0, "total_steps"),
  ("log_every", 0, "log_every"),
  ("profile_steps", -1, "profile_steps"),
  ("model_scan_layers", "yes", "model_scan_layers"),
  ("model_scan_decode", None, "model_scan_decode"),
  ("model_remat", 1, "model_remat"),
  ("model_attention", "flash", "model_attention"),
  ("model_router_aux_coef", -0.1, "model_router_aux_coef"),
  ("rollout.routing_replay", "r3", "rollout.routing_replay"),
  ("model", "no-such-preset", "model"),
  ("model", "/no/such/dir", "model"),
  ("model_dtype", "float64", "model_dtype"),
  ("tokenizer", "/no/such/tokenizer", "tokenizer"),
  ("task", "no_such_task", "task"),
  ("task_kwargs", {"train_path": "/no/such/file.jsonl"}, "task_kwargs.train_path"),
  ("task_kwargs", {"format_coef": INF}, "task_kwargs.format_coef"),
  ("max_prompt_len", 0, "max_prompt_len"),
  ("max_new_tokens", 0, "max_new_tokens"),
  ("data.truncate_prompts", "yes", "data.truncate_prompts"),
  ("temperature", 0.0, "temperature"),
  ("temperature", -1.0, "temperature"),
  ("temperature", INF, "temperature"),
  ("temperature", NAN, "temperature"),
  ("top_p", 0.0, "top_p"),
  ("top_p", 1.5, "top_p"),
  ("top_p", NAN, "top_p"),
  ("top_k", -1, "top_k"),
  ("group_size", 1, "group_size"),
  ("prompts_per_step", 0, "prompts_per_step"),
  ("rollout.partial_budget", -1, "rollout.partial_budget"),
  ("rollout.behavior_logp", "truncated", "rollout.behavior_logp"),
  ("rollout.sampler_dtype", "float16", "rollout.sampler_dtype"),
  ("rollout.score_old", "yes", "rollout.score_old"),
  ("rollout.decode_block", -1, "rollout.decode_block"),
  ("rollout.continuous_slots", -1, "rollout.continuous_slots"),
  ("rollout.continuous_auto_steps", -1, "rollout.continuous_auto_steps"),
  ("rollout.continuous_auto_steps", 2, "rollout.continuous_auto_steps"),  # without slots
  ("rollout.continuous_waste_threshold", 0.0, "rollout.continuous_waste_threshold"),
  ("rollout.continuous_waste_threshold", 1.0, "rollout.continuous_waste_threshold"),
  ("rollout.continuous_waste_threshold", NAN, "rollout.continuous_waste_threshold"),
  ("lora.rank", -1, "lora.rank"),
  ("lora.alpha", 0.0, "lora.alpha"),
  ("lora.targets", "q_proj,embed", "lora.targets"),
  ("lora.dropout", 1.0, "lora.dropout"),
  ("lora.dropout", -0.1, "lora.dropout"),
  ("lora.dropout", 0.1, "lora.dropout"),  # without lora.rank > 0
  ("multiturn.max_turns", -1, "multiturn.max_turns"),
  ("multiturn.turn_tokens", -1, "multiturn.turn_tokens"),
  ("multiturn.observation_tokens", 0, "multiturn.observation_tokens"),
  ("multiturn.credit", "token", "multiturn.credit"),
  ("multiturn.credit", "turn", "multiturn.credit"),  # single-turn run: no turns to credit
  ("multiturn.gamma", 1.5, "multiturn.gamma"),
  ("reward_timeout", 0.0, "reward_timeout"),
  ("reward_timeout", INF, "reward_timeout"),
  ("reward_batch_timeout", -1.0, "reward_batch_timeout"),
  ("reward_workers", -1, "reward_workers"),
  ("reward_memory_mb", 100, "reward_memory_mb"),
  ("reward_sandbox", "off", "reward_sandbox"),
  ("loss.name", "no_such_loss", "loss.name"),
  *[(f"loss.{k}", -0.1, f"loss.{k}") for k in FLOAT_OVERRIDES],
  *[(f"loss.{k}", INF, f"loss.{k}") for k in FLOAT_OVERRIDES],
  ("loss.agg", "sum", "loss.agg"),
  ("advantage.name", "nope", "advantage.name"),
  ("lag.mode", "sometimes", "lag.mode"),
  ("lag.sync_interval", 0, "lag.sync_interval"),
  ("lag.sync_offset", -1, "lag.sync_offset"),
  ("lag.max_staleness", -1, "lag.max_staleness"),
  ("eval_ope", "dr", "eval_ope"),  # needs a critic
  ("eval_ope", "is,is", "eval_ope"),
  ("lag.sampler_threads", 0, "lag.sampler_threads"),
  ("lag.sampler_threads", 2, "lag.sampler_threads"),  # sync mode
  ("replay.capacity_batches", 0, "replay.capacity_batches"),
  ("replay.policy", "lifo", "replay.policy"),
  ("replay.max_reuse", -1, "replay.max_reuse"),
  ("replay.temperature", 0.0, "replay.temperature"),
  ("replay.temperature", INF, "replay.temperature"),
  ("train.num_minibatches", 0, "train.num_minibatches"),
  ("train.num_minibatches", 3, "train.num_minibatches"),
  ("train.num_epochs", 0, "train.num_epochs"),
  ("train.micro_batch_size", -1, "train.micro_batch_size"),
  ("train.micro_batch_size", 3, "train.micro_batch_size"),
  ("train.shared_prefix", "yes", "train.shared_prefix"),
  ("train.skip_zero_advantage", 1, "train.skip_zero_advantage"),
  ("optimizer.learning_rate", -1e-3, "optimizer.learning_rate"),
  ("optimizer.learning_rate", INF, "optimizer.learning_rate"),
  ("optimizer.learning_rate", NAN, "optimizer.learning_rate"),
  ("optimizer.warmup_steps", -1, "optimizer.warmup_steps"),
  ("optimizer.b1", 1.0, "optimizer.b1"),
  ("optimizer.b1", 1.5, "optimizer.b1"),
  ("optimizer.b2", -0.1, "optimizer.b2"),
  ("optimizer.b2", 1.0, "optimizer.b2"),
  ("optimizer.weight_decay", -0.01, "optimizer.weight_decay"),
  ("optimizer.grad_clip", -1.0, "optimizer.grad_clip"),
  ("optimizer.moment_dtype", "float16", "optimizer.moment_dtype"),
  ("optimizer.grad_clip", INF, "optimizer.grad_clip"),
  ("mesh.data", 0, "mesh.data"),
  ("mesh.data", -2, "mesh.data"),
  ("mesh.fsdp", 3, "prompts_per_step"),  # 64 rows do not split over 3 devices
  ("mesh.tensor", 16, "mesh"),  # more devices than the 8 fake CPUs
  ("mesh.sampler_devices", -1, "mesh.sampler_devices"),
  ("sft.enabled", "yes", "sft.enabled"),
  ("sft.on_loaded_model", 1, "sft.on_loaded_model"),
  ("sft.steps", 0, "sft.steps"),
  ("sft.batch_size", 0, "sft.batch_size"),
  ("sft.learning_rate", -1e-3, "sft.learning_rate"),
  ("sft.learning_rate", INF, "sft.learning_rate"),
  ("sft.distractor", 1.0, "sft.distractor"),
  ("sft.distractor", -0.1, "sft.distractor"),
  ("eval_every", -1, "eval_every"),
  ("eval_prompts", -1, "eval_prompts"),
  ("eval_samples", 0, "eval_samples"),
  ("checkpoint_every", -1, "checkpoint_every"),
  ("keep_checkpoints", 0, "keep_checkpoints"),
  ("async_checkpoint", "no", "async_checkpoint"),
  ("tensorboard", 1, "tensorboard"),
  ("wandb_project", 3, "wandb_project"),
  ("progress", None, "progress"),
  ("critic.estimator", "td", "critic.estimator"),
  ("critic.gamma", 1.5, "critic.gamma"),
  ("critic.lam", -0.1, "critic.lam"),
  ("critic.value_coef", 0.0, "critic.value_coef"),
  ("critic.value_clip", -1.0, "critic.value_clip"),
  ("critic.rho_bar", 0.0, "critic.rho_bar"),
  ("critic.c_bar", 0.0, "critic.c_bar"),
  ("critic.whiten", "yes", "critic.whiten"),
  ("critic.lr_scale", 0.0, "critic.lr_scale"),
  ("critic.kl_coef", -0.1, "critic.kl_coef"),
  ("critic.prompt_pool", 0, "critic.prompt_pool"),
  ("critic.prompt_wrong", float("nan"), "critic.prompt_wrong"),
  ("critic.prompt_right", float("inf"), "critic.prompt_right"),
  ("critic.model", "policy", "critic.model"),  # needs a critic
  ("critic.reward_norm", True, "critic.reward_norm"),  # needs a critic
  ("critic.reward_clip", 0.0, "critic.reward_clip"),
  ("critic.warmup_steps", 5, "critic.warmup_steps"),  # needs a critic
]


def _config(**overrides):
  """base_config with `overrides` ("a.b": value), rebuilt without type-safety so bad types pass."""
  d = default.base_config().to_dict()
  for key, value in overrides.items():
    node = d
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return ml_collections.ConfigDict(d)


def _leaves(c, prefix=""):
  for k, v in c.items():
    if isinstance(v, ml_collections.ConfigDict) and len(v):
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}"


def test_every_field_is_covered():
  fields = set(_leaves(default.base_config()))
  assert fields == {f for f, _, _ in BAD}


@pytest.mark.parametrize("field,value,named", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_fails_naming_the_field(field, value, named):
  with pytest.raises(ValueError, match=f"^config.{named}:"):
    validation.validate_config(_config(**{field: value}))


def test_continuous_auto_needs_sync_mode():
  auto = {"rollout.continuous_slots": 1, "rollout.continuous_auto_steps": 3}
  validation.validate_config(_config(**auto))
  with pytest.raises(ValueError, match="^config.rollout.continuous_auto_steps:.*'sync' only"):
    validation.validate_config(_config(**auto, **{"lag.mode": "async"}))


def test_sampler_threads_need_async_and_a_rollout_without_carried_state():
  validation.validate_config(_config(**{"lag.mode": "async", "lag.sampler_threads": 3}))
  with pytest.raises(ValueError, match="^config.lag.sampler_threads: 2 sampler threads need"):
    validation.validate_config(_config(**{"lag.sampler_threads": 2}))
  partial = {"lag.mode": "async", "lag.sampler_threads": 2, "rollout.partial_budget": 4}
  with pytest.raises(ValueError, match="^config.lag.sampler_threads: partial rollouts"):
    validation.validate_config(_config(**partial))


def test_a_study_refuses_the_automatic_sampler_choice():
  from offpolicy_jax.study import grid as study_grid

  c = lag_study.get_config()
  study_grid.grid_from_config(c)
  c.rollout.continuous_slots, c.rollout.continuous_auto_steps = 1, 2
  with pytest.raises(ValueError, match="^config.rollout.continuous_auto_steps: a study"):
    study_grid.grid_from_config(c)


# Fields of `config.study` (configs/lag_study.py), with values the study refuses.
STUDY_BAD = [
  ("study.alpha", 0.0, "study.alpha"),
  ("study.alpha", 1.0, "study.alpha"),
  ("study.alpha", NAN, "study.alpha"),
  ("study.alpha", "0.05", "study.alpha"),
  ("study.aa_lags", 3, "study.aa_lags"),
  ("study.aa_lags", "nowhere", "study.aa_lags"),
  ("study.aa_lags", "onpolicy,onpolicy", "study.aa_lags"),
  ("study.equivalence_margin", -0.01, "study.equivalence_margin"),
  ("study.equivalence_margin", NAN, "study.equivalence_margin"),
]


@pytest.mark.parametrize(
  "field,value,named", STUDY_BAD, ids=[f"{f}={v!r}" for f, v, _ in STUDY_BAD]
)
def test_bad_study_value_fails_naming_the_field(field, value, named):
  from offpolicy_jax.study import grid as study_grid

  d = lag_study.get_config().to_dict()
  d["study"][field.split(".")[1]] = value
  with pytest.raises(ValueError, match=f"^config.{named}:"):
    study_grid.grid_from_config(ml_collections.ConfigDict(d))


@pytest.mark.parametrize("module", [default, code, lag_study], ids=lambda m: m.__name__)
def test_shipped_configs_pass(module):
  validation.validate_config(module.get_config())


def test_advantage_name_defaults_to_the_presets_estimator():
  cases = {"grpo": "grpo", "dapo": "grpo", "rec_oneside_nois": "group_mean", "oapl": "opmd"}
  for loss, want in cases.items():
    assert validation.advantage_name(_config(**{"loss.name": loss})) == want
    assert validation.advantage_name(_config(**{"loss.name": loss, "advantage.name": "rloo"})) == (
      "rloo"
    )


def test_mesh_shape_resolves_fill_and_rejects_misfits():
  assert validation.mesh_shape(_config(**{"mesh.data": -1}), 8) == (8, 1, 1)
  assert validation.mesh_shape(_config(**{"mesh.fsdp": -1, "mesh.tensor": 2}), 8) == (1, 4, 2)
  assert validation.mesh_shape(_config(**{"mesh.data": 2}), 8) == (2, 1, 1)  # a subset
  with pytest.raises(ValueError, match="^config.mesh:.*only one"):
    validation.mesh_shape(_config(**{"mesh.data": -1, "mesh.fsdp": -1}), 8)
  with pytest.raises(ValueError, match="^config.mesh.data:.*-1 fills"):
    validation.mesh_shape(_config(**{"mesh.data": -1, "mesh.tensor": 3}), 8)


def test_batch_must_split_over_data_and_fsdp():
  ok = {"prompts_per_step": 2, "group_size": 4, "mesh.data": 2, "mesh.fsdp": 2}
  validation.validate_config(_config(**ok))  # 8 rows over 4 devices; 2 prompts replicated
  with pytest.raises(ValueError, match="^config.prompts_per_step:.* 6 rows .* 4 devices"):
    validation.validate_config(_config(**{**ok, "prompts_per_step": 3, "group_size": 2}))
  # Tensor parallelism does not split the batch.
  validation.validate_config(_config(**{**ok, "mesh.fsdp": 1, "mesh.tensor": 4}))


# ----------------------------------------------------------------- data checks


def _task(prompts, answers=None, name="hand_built", chat=False, max_answer_len=3):
  answers = answers or ["1"] * len(prompts)
  exs = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers, strict=True)]
  return Task(
    name=name,
    train_source=ListSource(exs),
    eval_source=ListSource(exs[:2]),
    prompt=lambda ex: ex["prompt"],
    reward=lambda ex, text: 0.0,
    use_chat_template=chat,
    answer=lambda ex: ex["answer"],
    max_answer_len=max_answer_len,
  )


def _data_config(**overrides):
  return _config(**{"max_prompt_len": 12, "max_new_tokens": 8, **overrides})


@pytest.fixture(autouse=True)
def _fresh_scan_cache():
  data_checks._SCAN_CACHE.clear()
  yield
  data_checks._SCAN_CACHE.clear()


def test_good_data_passes_and_reports_the_scan():
  stats = data_checks.validate_data(_data_config(), _task(["ab=", "abcd="]), TOK)
  assert stats["train"].scanned == stats["train"].size == 2
  assert stats["train"].counts == {4: 1, 6: 1}  # BOS + characters


def test_procedural_task_is_checked_on_a_sample():
  task = tasks.get_task("reverse", num_eval=20)
  stats = data_checks.validate_data(_data_config(), task, TOK)
  assert stats["train"].size == 2**31 - 1 and stats["train"].scanned == data_checks.SCAN_SAMPLE
  assert stats["eval"].scanned == stats["eval"].size == 20


def test_empty_prompt_fails_naming_split_file_and_row(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text("{}\n")
  cfg = _data_config(task_kwargs={"train_path": str(path)})
  task = _task(["ab=", "cd=", "ef=", ""], chat=True)  # no BOS: "" has 0 tokens
  with pytest.raises(
    ValueError,
    match=r"^config.task_kwargs.train_path: train split .*train\.jsonl.*example 3 has an empty",
  ):
    data_checks.validate_data(cfg, task, TOK)


def test_long_prompt_fails_naming_the_row():
  task = _task(["ab="] * 5 + ["a" * 20, "b" * 30])
  with pytest.raises(
    ValueError, match=r"^config.max_prompt_len: train split .*example 5 has 21"
  ) as e:
    data_checks.validate_data(_data_config(), task, TOK)
  assert "2 of 7" in str(e.value) and "example 6, has 31" in str(e.value)
  assert "truncate_prompts" in str(e.value)


def test_long_prompt_in_a_data_file_names_the_file(tmp_path):
  path = tmp_path / "train.jsonl"
  rows = [{"question": "what is 1+1?", "answer": "#### 2"}] * 2
  rows.append({"question": "what is " + "1+" * 40 + "1?", "answer": "#### 41"})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  kwargs = {"train_path": str(path), "instruction": ""}
  cfg = _data_config(**{"task": "gsm8k", "task_kwargs": kwargs, "sft.enabled": False})
  task = tasks.get_task("gsm8k", **kwargs)
  with pytest.raises(
    ValueError, match=r"^config.max_prompt_len: train split .*train\.jsonl.*example 2"
  ):
    data_checks.validate_data(cfg, task, TOK)


def test_truncation_allows_long_prompts():
  task = _task(["ab="] * 5 + ["a" * 20])
  stats = data_checks.validate_data(_data_config(**{"data.truncate_prompts": True}), task, TOK)
  assert max(stats["train"].counts) == 21


def test_untokenizable_row_fails_naming_the_row():
  with pytest.raises(ValueError, match=r"^config.task: train example 1 .*'A'"):
    data_checks.validate_data(_data_config(), _task(["ab=", "Ab="]), TOK)


def test_tokenizer_larger_than_model_vocab_fails():
  mcfg = models.get_config("tiny", vocab_size=32)
  with pytest.raises(
    ValueError, match="^config.model: the tokenizer has 57 ids .* vocab_size is 32"
  ):
    data_checks.validate_data(_data_config(), _task(["ab="]), TOK, mcfg)


def test_token_id_past_model_vocab_fails_naming_the_row():
  tok = CharTokenizer()
  tok.vocab_size = 20  # claims a small vocabulary; ids of letters are larger
  mcfg = models.get_config("tiny", vocab_size=20)
  with pytest.raises(
    ValueError, match=r"^config.model: train split .*example 1 has token id \d+ >= .* 20"
  ):
    data_checks.validate_data(_data_config(), _task(["12", "1z"]), tok, mcfg)


def test_special_id_past_model_vocab_fails():
  tok = CharTokenizer()
  tok.vocab_size, tok.eos_id = 20, 40
  mcfg = models.get_config("tiny", vocab_size=20)
  with pytest.raises(ValueError, match="^config.model: tokenizer.eos_id = 40"):
    data_checks.validate_data(_data_config(), _task(["1="]), tok, mcfg)


def test_context_longer_than_model_positions_fails():
  mcfg = models.get_config("tiny", vocab_size=TOK.vocab_size, max_position_embeddings=16)
  with pytest.raises(
    ValueError, match=r"^config.max_prompt_len \+ config.max_new_tokens: .* 20 tokens .* 16"
  ):
    data_checks.validate_data(_data_config(), _task(["ab="]), TOK, mcfg)


def test_top_k_larger_than_vocab_fails():
  with pytest.raises(ValueError, match="^config.top_k:"):
    data_checks.validate_data(_data_config(top_k=100), _task(["ab="]), TOK)


def test_answer_too_long_fails_naming_the_row():
  task = _task(["a=", "b="], answers=["1", "12345"])
  with pytest.raises(ValueError, match="^config.task: train split .*example 1 has an answer of 6"):
    data_checks.validate_data(_data_config(), task, TOK)


def test_warm_start_without_answers_fails():
  task = _task(["a="])
  task = Task(**{**task.__dict__, "answer": None})
  with pytest.raises(ValueError, match="^config.sft.enabled:"):
    data_checks.validate_data(_data_config(), task, TOK)
  data_checks.validate_data(_data_config(**{"sft.enabled": False}), task, TOK)


def test_empty_eval_split_fails_only_when_evaluating():
  task = Task(**{**_task(["a="]).__dict__, "eval_source": ListSource([])})
  with pytest.raises(ValueError, match="^config.eval_prompts: eval split .* is empty"):
    data_checks.validate_data(_data_config(), task, TOK)
  data_checks.validate_data(_data_config(eval_prompts=0), task, TOK)


def test_unsupported_hf_model_dir_fails(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(ValueError, match="^config.model: .*config.json"):
    data_checks.validate_data(_data_config(model=str(tmp_path)), _task(["a="]), TOK)


def test_scans_are_cached_in_process_and_on_disk(tmp_path, monkeypatch):
  calls = []
  real = data.scan_prompts
  monkeypatch.setattr(data, "scan_prompts", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
  cfg, task = _data_config(), _task(["ab=", "abcd="])
  first = data_checks.validate_data(cfg, task, TOK, cache_dir=str(tmp_path))
  assert calls == ["train", "eval"]
  data_checks.validate_data(cfg, task, TOK)  # in process
  assert len(calls) == 2
  data_checks._SCAN_CACHE.clear()  # a new process: the workdir's file answers
  again = data_checks.validate_data(cfg, task, TOK, cache_dir=str(tmp_path))
  assert len(calls) == 2 and again == first
  assert (tmp_path / data_checks.CACHE_FILE).exists()
  # A smaller max_prompt_len needs no rescan: the stats do not depend on it.
  with pytest.raises(ValueError, match="config.max_prompt_len"):
    data_checks.validate_data(_data_config(max_prompt_len=5), task, TOK, cache_dir=str(tmp_path))
  assert len(calls) == 2
  data_checks.validate_data(cfg, _task(["ab=", "xyz="]), TOK, cache_dir=str(tmp_path))
  assert len(calls) == 4  # other data: rescanned


def test_data_file_change_triggers_a_rescan(tmp_path, monkeypatch):
  calls = []
  real = data.scan_prompts
  monkeypatch.setattr(data, "scan_prompts", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
  path = tmp_path / "rows.txt"
  path.write_text("x\n")
  cfg, task = _data_config(task_kwargs={"train_path": str(path)}), _task(["ab="])
  data_checks.validate_data(cfg, task, TOK, cache_dir=str(tmp_path))
  data_checks._SCAN_CACHE.clear()
  path.write_text("xy\n")
  data_checks.validate_data(cfg, task, TOK, cache_dir=str(tmp_path))
  assert calls == ["train", "eval", "train", "eval"]
