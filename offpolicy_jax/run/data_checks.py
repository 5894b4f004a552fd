"""Start-up checks of the data against the model: every prompt, once, before compilation.

`validate_data(config, task, tokenizer)` runs once the task and tokenizer are
built, still before compilation: every prompt has 1..max_prompt_len tokens (or
`data.truncate_prompts` is on), every token id and special id fits the model's
vocabulary, answers fit the task's answer length, and the context
`max_prompt_len + max_new_tokens` fits the model's positions. Splits of up to
`SCAN_LIMIT` examples are scanned in full; larger ones (the procedural
synthetic tasks have 2**31 - 1) only their first `SCAN_SAMPLE` examples.
Scans are cached in process and, given `cache_dir`, in a small JSON file there.
Errors are `ValueError("config.<field>: ...")` (`errors.ConfigError` where `errors.need`
checks) naming the split and row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import jax

from offpolicy_jax import errors, files, models
from offpolicy_jax.config_spec import RunSpec
from offpolicy_jax.models import hub
from offpolicy_jax.rewards import tasks
from offpolicy_jax.rollout import data
from offpolicy_jax.run import model_build

# Splits of up to SCAN_LIMIT examples are scanned in full, larger ones their first SCAN_SAMPLE.
SCAN_LIMIT = 1_000_000
SCAN_SAMPLE = 10_000
# Name of the scan cache under `validate_data(..., cache_dir=...)`.
CACHE_FILE = "data_checks.json"
_SCAN_VERSION = 1
_CACHE_ENTRIES = 32
_log = logging.getLogger(__name__)


def check_task(config) -> None:
  """`config`'s task built and its data checked (`validate_data`), without a model.

  What a study checks once before its first cell (`study.runner`): a
  `task_kwargs` the task refuses, or a prompt longer than `max_prompt_len`,
  is one line there instead of the same error from every cell.

  Raises:
    ValueError: `config.task_kwargs: ...` for a task that cannot be built with
      them, else `validate_data`'s errors.
  """
  spec = config if isinstance(config, RunSpec) else RunSpec.from_config(config)
  try:
    task = tasks.get_task(spec.task, **dict(spec.task_kwargs))
  except ValueError as e:
    raise ValueError(f"config.task_kwargs: task {spec.task!r}: {e}") from None
  validate_data(spec, task, model_build.tokenizer(spec))


def get_model_config(config: RunSpec, tokenizer) -> models.ModelConfig:
  """The `ModelConfig` the run builds: the HF directory's config.json, or the preset.

  Presets are sized to the tokenizer's vocabulary, as `build_components` builds them.

  Raises:
    ValueError: `config.model: ...` for an unreadable or unsupported config.json.
  """
  local = hub.model_dir(config.model)
  if local is None:
    return models.get_config(config.model, vocab_size=tokenizer.vocab_size)
  path = os.path.join(local, "config.json")
  try:
    return models.config_from_hf(files.read_json_object(path))
  except (OSError, ValueError, TypeError, KeyError) as e:
    raise ValueError(f"config.model: {path}: {e}") from e


def validate_data(
  config: Any,
  task: tasks.Task,
  tokenizer,
  model_config: models.ModelConfig | None = None,
  *,
  cache_dir: str | None = None,
) -> dict[str, data.PromptStats]:
  """Data-dependent start-up checks: prompts, token ids and context length fit the model.

  Checks, each failing with `ValueError("config.<field>: ...")` naming the
  split, the data file when the task reads one, and the example index:
  the tokenizer's vocabulary and special ids fit the model's `vocab_size`;
  `top_k <= vocab_size`; `max_prompt_len + max_new_tokens <=
  max_position_embeddings`; the warm start has reference answers; the train
  split (and the eval split when `eval_prompts > 0`) is not empty; every
  prompt renders and tokenizes, to at least one token and (unless
  `data.truncate_prompts`) at most `max_prompt_len`; every prompt and answer
  token id is below `vocab_size`; every answer fits `task.max_answer_len`.
  Splits longer than `SCAN_LIMIT` are checked on their first `SCAN_SAMPLE`
  examples only.

  Args:
    config: the experiment config (already through `validate_config`): its
      `RunSpec`, or the ConfigDict, read through `RunSpec.from_config`.
    task: the run's task (`tasks.get_task(config.task, **config.task_kwargs)`).
    tokenizer: the run's tokenizer.
    model_config: the model's config; default `get_model_config(config, tokenizer)`.
    cache_dir: directory for a JSON cache of the scans (e.g. the workdir), so
      a rerun does not rescan unchanged data; None caches in process only.

  Returns:
    `{"train": PromptStats, "eval": PromptStats}`; `stats.scanned < stats.size`
    marks a sampled split.
  """
  c = config if isinstance(config, RunSpec) else RunSpec.from_config(config)
  mcfg = get_model_config(c, tokenizer) if model_config is None else model_config
  _validate_model_fit(c, tokenizer, mcfg)
  errors.need(
    not c.sft.enabled or task.answer is not None,
    "sft.enabled",
    f"task {task.name!r} has no reference answers for the supervised warm start",
  )
  errors.need(
    not (c.sft.enabled and c.sft.distractor) or task.distractor is not None,
    "sft.distractor",
    f"task {task.name!r} has no distractor answers (Task.distractor)",
  )
  stats = {split: _scan(c, task, tokenizer, split, cache_dir) for split in ("train", "eval")}
  for s in stats.values():
    _check_split(c, task, s, mcfg.vocab_size)
  return stats


def _validate_model_fit(c: RunSpec, tokenizer, mcfg: models.ModelConfig) -> None:
  v = mcfg.vocab_size
  tok_field = "tokenizer" if c.tokenizer else "model"
  errors.need(
    tokenizer.vocab_size <= v,
    tok_field,
    f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {v} "
    "(ids past the embedding table give NaN)",
  )
  for name in ("pad_id", "eos_id", "bos_id"):
    i = getattr(tokenizer, name)
    errors.need(
      i is None or 0 <= i < v,
      tok_field,
      f"tokenizer.{name} = {i} is outside the model's vocabulary [0, {v})",
    )
  errors.need(c.top_k <= v, "top_k", f"must be <= the model's vocab_size {v}, got {c.top_k}")
  max_pos = getattr(mcfg, "max_position_embeddings", None)
  context = c.max_prompt_len + c.max_new_tokens
  errors.need(
    not max_pos or context <= max_pos,
    "max_prompt_len + config.max_new_tokens",
    f"a context of {c.max_prompt_len} + {c.max_new_tokens} = {context} tokens exceeds the "
    f"model's max_position_embeddings = {max_pos}",
  )


def _data_file(c: RunSpec, split: str) -> tuple[str, str | None]:
  """(config field, path) of the file a split is read from; ("task", None) for built-in data."""
  kwargs = c.task_kwargs
  for k in (f"{split}_path", "train_path"):  # text tasks evaluate on train_path without eval_path
    if k in kwargs and isinstance(kwargs[k], str):
      return f"task_kwargs.{k}", kwargs[k]
  return "task", None


def _check_split(c: RunSpec, task: tasks.Task, s: data.PromptStats, vocab: int) -> None:
  field, path = _data_file(c, s.split)
  where = f"{s.split} split of task {task.name!r}" + (f" ({path})" if path else "")
  if s.scanned < s.size:
    _log.info("validate_data: %s: checked the first %d of %d examples", where, s.scanned, s.size)
  if s.split == "train":
    errors.need(s.size >= jax.process_count(), field, f"{where} has {s.size} examples")
  else:
    errors.need(s.size > 0 or not c.eval_prompts, "eval_prompts", f"{where} is empty")
  errors.need(
    0 not in s.first_row,
    field,
    f"{where}: example {s.first_row.get(0)} has an empty prompt (0 tokens); the sampler and "
    "the trainer need at least one prompt token",
  )
  p = c.max_prompt_len
  over = {n: i for n, i in s.first_row.items() if n > p}
  if over:
    first, length = min((i, n) for n, i in over.items())
    longest = max(over)
    num_over = sum(s.counts[n] for n in over)
    msg = (
      f"{where}: example {first} has {length} prompt tokens > max_prompt_len={p} "
      f"({num_over} of {s.scanned} checked prompts are longer; the longest, example "
      f"{over[longest]}, has {longest}); raise max_prompt_len or set data.truncate_prompts=True"
    )
    errors.need(c.data.truncate_prompts, "max_prompt_len", msg)
    _log.info(
      "validate_data: %s: %d of %d checked prompts are longer than max_prompt_len=%d and "
      "will be left-truncated (data.truncate_prompts)",
      where,
      num_over,
      s.scanned,
      p,
    )
  top, row = s.max_id
  errors.need(
    top < vocab,
    "tokenizer" if c.tokenizer else "model",
    f"{where}: example {row} has token id {top} >= the model's vocab_size {vocab}",
  )
  n, row = s.answer_len
  errors.need(
    n <= task.max_answer_len + 1,
    "task",
    f"{where}: example {row} has an answer of {n} tokens with EOS > task.max_answer_len + 1 = "
    f"{task.max_answer_len + 1}",
  )


# ----------------------------------------------------------------- scan cache

_SCAN_CACHE: dict[str, data.PromptStats] = {}


def _scan(
  c: RunSpec, task: tasks.Task, tokenizer, split: str, cache_dir: str | None
) -> data.PromptStats:
  """`data.scan_prompts` of a split, through the in-process and on-disk caches."""
  source = task.train_source if split == "train" else task.eval_source
  size = len(source)
  limit = None if size <= SCAN_LIMIT else SCAN_SAMPLE
  key = _scan_key(c, task, tokenizer, split, size, limit)
  if key in _SCAN_CACHE:
    return _SCAN_CACHE[key]
  disk = _read_cache(cache_dir)
  if key in disk:
    stats = _stats_from_json(disk[key])
  else:
    try:
      stats = data.scan_prompts(task, tokenizer, split, limit)
    except ValueError as e:
      field, path = _data_file(c, split)
      raise ValueError(f"config.{field}: {path + ': ' if path else ''}{e}") from e
    if cache_dir is not None and jax.process_index() == 0:
      disk[key] = stats._asdict()
      _write_cache(cache_dir, dict(list(disk.items())[-_CACHE_ENTRIES:]))
  if len(_SCAN_CACHE) >= _CACHE_ENTRIES:
    _SCAN_CACHE.pop(next(iter(_SCAN_CACHE)))
  _SCAN_CACHE[key] = stats
  return stats


def _scan_key(c: RunSpec, task, tokenizer, split: str, size: int, limit: int | None) -> str:
  """Everything a scan depends on: task, data files, tokenizer files, a probe of the data."""
  tok_dir = c.tokenizer or hub.model_dir(c.model) or ""
  files = [v for v in c.task_kwargs.values() if isinstance(v, str) and os.path.isfile(v)]
  if tok_dir:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    files += [os.path.join(tok_dir, f) for f in names]
  stamps = {}
  for f in files:
    if os.path.isfile(f):
      st = os.stat(f)
      stamps[os.path.abspath(f)] = (st.st_size, st.st_mtime_ns)
  source = task.train_source if split == "train" else task.eval_source
  try:  # tells apart hand-built tasks that share a name
    probe = [task.prompt(source[i]) for i in sorted({0, size - 1}) if size]
  except Exception:  # the scan itself reports the row
    probe = None
  parts = [
    _SCAN_VERSION,
    task.name,
    dict(c.task_kwargs),
    split,
    size,
    limit,
    stamps,
    probe,
    task.use_chat_template,
    task.answer is None,
    type(tokenizer).__name__,
    tokenizer.vocab_size,
    [tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id],
    getattr(tokenizer, "chat_template", None),
  ]
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _read_cache(cache_dir: str | None) -> dict[str, Any]:
  if cache_dir is None:
    return {}
  try:
    with open(os.path.join(cache_dir, CACHE_FILE)) as f:
      out = json.load(f)
    return out if isinstance(out, dict) else {}
  except (OSError, ValueError):  # missing or torn: rescan
    return {}


def _write_cache(cache_dir: str, entries: dict[str, Any]) -> None:
  os.makedirs(cache_dir, exist_ok=True)
  path = os.path.join(cache_dir, CACHE_FILE)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(entries, f)
  os.replace(tmp, path)


def _stats_from_json(d: dict[str, Any]) -> data.PromptStats:
  return data.PromptStats(
    split=d["split"],
    size=int(d["size"]),
    scanned=int(d["scanned"]),
    counts={int(k): int(v) for k, v in d["counts"].items()},
    first_row={int(k): int(v) for k, v in d["first_row"].items()},
    max_id=(int(d["max_id"][0]), int(d["max_id"][1])),
    answer_len=(int(d["answer_len"][0]), int(d["answer_len"][1])),
  )
