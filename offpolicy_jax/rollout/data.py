"""Grain prompt pipelines: deterministic, shardable, checkpointable.

  it = data.prompt_iterator(task, tokenizer, batch_size=G, max_prompt_len=P, seed=0)
  batch = next(it)            # dict of numpy arrays, static shapes
  state = it.get_state()      # JSON-serialisable; it.set_state(state) resumes exactly

Pipeline: `MapDataset.range(len(source))` -> shard (`[shard_index::shard_count]`)
-> shuffle (train; reshuffled every epoch) -> repeat -> tokenize, left-pad ->
batch. Elements are source indices until the map step, so every batch carries
`index`, the position in the task's source, for host rewards
(`examples(task, split, batch["index"])`).

Batch fields (G = batch_size, P = max_prompt_len, A = answer length):
  prompt_tokens  int32 [G, P]  left-padded with `tokenizer.pad_id`
  prompt_lengths int32 [G]     number of real prompt tokens
  answer_tokens  int32 [G, A]  answer ids then EOS, padded with -1 (device rewards)
  index          int64 [G]     index into the split's source
  valid          bool  [G]     False on filler rows of a final partial batch
  truncated      bool  [G]     prompt was cut to its last P tokens (`truncate=True`);
                               False on filler rows

`scan_prompts` tokenizes a split the same way, once, for the start-up checks of
`data_checks.validate_data` (prompt lengths, token ids, answer lengths).
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import grain
import numpy as np

from offpolicy_jax.models.tokenizers import Tokenizer
from offpolicy_jax.rewards.tasks import Task

_ANSWER_PAD = -1


def _source(task: Task, split: str):
  if split == "train":
    return task.train_source
  if split == "eval":
    return task.eval_source
  raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")


def examples(task: Task, split: str, indices: Sequence[int]) -> list[dict[str, Any]]:
  """The source examples behind a batch's `index` field (for host rewards)."""
  source = _source(task, split)
  return [source[int(i)] for i in indices]


def encode_prompt(task: Task, tokenizer: Tokenizer, example: dict[str, Any]) -> list[int]:
  """Prompt ids: the chat template for text tasks, BOS + raw prompt for synthetic ones."""
  text = task.prompt(example)
  if task.use_chat_template:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)
  return tokenizer.encode(text, add_bos=True)


class _Encode(grain.transforms.Map):
  """Source index -> one padded, tokenized element."""

  def __init__(self, task, tokenizer, split, max_prompt_len, answer_len, truncate):
    self._task = task
    self._tok = tokenizer
    self._split = split
    self._source = _source(task, split)
    self._p = max_prompt_len
    self._a = answer_len
    self._truncate = truncate

  def map(self, index):
    index = int(index)
    ex = self._source[index]
    ids = encode_prompt(self._task, self._tok, ex)
    if not ids:
      raise ValueError(
        f"{self._split} example {index} of task {self._task.name!r}: the prompt has 0 tokens "
        "(the sampler and the trainer need at least one prompt token)."
      )
    truncated = len(ids) > self._p
    if truncated:
      if not self._truncate:
        raise ValueError(
          f"{self._split} example {index} of task {self._task.name!r}: prompt has {len(ids)} "
          f"tokens > max_prompt_len={self._p} (raise max_prompt_len or pass truncate=True)."
        )
      ids = ids[-self._p :]  # keep the end: the generation prompt must survive
    prompt = np.full((self._p,), self._tok.pad_id, np.int32)
    prompt[-len(ids) :] = ids
    answer = np.full((self._a,), _ANSWER_PAD, np.int32)
    if self._task.answer is not None:
      ans = [*self._tok.encode(self._task.answer(ex)), self._tok.eos_id]
      if len(ans) > self._a:
        raise ValueError(
          f"{self._split} example {index}: answer has {len(ans)} tokens (with EOS) > "
          f"answer length {self._a}."
        )
      answer[: len(ans)] = ans
    return {
      "prompt_tokens": prompt,
      "prompt_lengths": np.int32(len(ids)),
      "answer_tokens": answer,
      "index": np.int64(index),
      "valid": np.bool_(True),
      "truncated": np.bool_(truncated),
    }


def _stack_and_pad(batch_size: int):
  def batch_fn(elements):
    out = {k: np.stack([e[k] for e in elements]) for k in elements[0]}
    missing = batch_size - len(elements)
    if missing:  # final partial batch of a finite split: repeat row 0, mark invalid
      out = {k: np.concatenate([v, np.repeat(v[:1], missing, 0)]) for k, v in out.items()}
      out["valid"][-missing:] = False
      out["truncated"][-missing:] = False
    return out

  return batch_fn


def prompt_iterator(
  task: Task,
  tokenizer: Tokenizer,
  *,
  batch_size: int,
  max_prompt_len: int,
  seed: int,
  split: str = "train",
  shard_index: int = 0,
  shard_count: int = 1,
  num_epochs: int | None = None,
  shuffle: bool | None = None,
  truncate: bool = False,
  answer_len: int | None = None,
  read_threads: int = 0,
) -> grain.DatasetIterator:
  """Batches of tokenized prompts as a checkpointable grain iterator.

  Args:
    task: the Task (`tasks.get_task`).
    tokenizer: `tokenizers.CharTokenizer` or `tokenizers.HFTokenizer`.
    batch_size: prompts per batch (G).
    max_prompt_len: padded prompt length (P).
    seed: shuffle seed in [0, 2**32).
    split: "train" or "eval".
    shard_index: this process's shard (e.g. `jax.process_index()`).
    shard_count: number of shards (e.g. `jax.process_count()`).
    num_epochs: passes over the split; None = forever. Default: None for
      train, 1 for eval.
    shuffle: default True for train, False for eval.
    truncate: keep the last `max_prompt_len` tokens of over-long prompts (the
      question and the generation prompt) instead of raising; such rows have
      `truncated=True`.
    answer_len: A; default `task.max_answer_len + 1` (room for EOS).
    read_threads: grain prefetch threads (0 = read synchronously).

  Returns:
    A grain DatasetIterator over dict batches (see module docstring), with
    `get_state()` / `set_state(state)`. Finite iterators pad the last batch
    with `valid=False` rows; infinite ones never produce a partial batch.
  """
  source = _source(task, split)
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  if max_prompt_len < 1:
    raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}.")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}.")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}.")
  if num_epochs is None and split == "eval":
    num_epochs = 1
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}.")
  if shuffle is None:
    shuffle = split == "train"
  if answer_len is None:
    answer_len = task.max_answer_len + 1
  if len(source) < shard_count:
    raise ValueError(f"{split} split of {task.name!r} has {len(source)} examples < shard_count.")

  ds = grain.MapDataset.range(len(source))[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  ds = ds.map(_Encode(task, tokenizer, split, max_prompt_len, answer_len, truncate))
  ds = ds.batch(batch_size, drop_remainder=False, batch_fn=_stack_and_pad(batch_size))
  options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * read_threads)
  return iter(ds.to_iter_dataset(options))


class PromptStats(NamedTuple):
  """Token statistics of one split's prompts, as `prompt_iterator` encodes them.

  JSON-friendly (plain ints and dicts), so a scan can be cached on disk.

  Attributes:
    split: "train" or "eval".
    size: examples in the split (`len(source)`).
    scanned: examples tokenized: the first `scanned` of the split.
    counts: prompt length in tokens -> number of scanned prompts of that length.
    first_row: prompt length in tokens -> first example index of that length.
    max_id: (largest token id of any scanned prompt or answer, first example
      index with it); (-1, -1) when nothing was scanned.
    answer_len: (most answer tokens, EOS included, first example index with
      that many); (0, -1) for tasks without answers.
  """

  split: str
  size: int
  scanned: int
  counts: dict[int, int]
  first_row: dict[int, int]
  max_id: tuple[int, int]
  answer_len: tuple[int, int]


def scan_prompts(
  task: Task, tokenizer: Tokenizer, split: str, limit: int | None = None
) -> PromptStats:
  """Tokenizes the first `limit` examples of a split (all when None) like `prompt_iterator`.

  Args:
    task: the Task.
    tokenizer: the tokenizer the run encodes prompts with.
    split: "train" or "eval".
    limit: examples to scan from the start of the split; None for all.

  Returns:
    The split's PromptStats.

  Raises:
    ValueError: naming the split and example index when an example cannot be
      rendered or tokenized (a missing field, a character outside the vocabulary).
  """
  source = _source(task, split)
  size = len(source)
  n = size if limit is None else min(size, limit)
  counts: dict[int, int] = {}
  first_row: dict[int, int] = {}
  max_id, answer_len = (-1, -1), (0, -1)
  for i in range(n):
    try:
      ex = source[i]
      ids = encode_prompt(task, tokenizer, ex)
      ans = [] if task.answer is None else [*tokenizer.encode(task.answer(ex)), tokenizer.eos_id]
    except Exception as e:  # re-raised naming the row: any failure here would recur mid-run
      raise ValueError(f"{split} example {i} of task {task.name!r}: {e!r}") from e
    counts[len(ids)] = counts.get(len(ids), 0) + 1
    first_row.setdefault(len(ids), i)
    top = max(max(ids, default=-1), max(ans, default=-1))
    if top > max_id[0]:
      max_id = (top, i)
    if len(ans) > answer_len[0]:
      answer_len = (len(ans), i)
  return PromptStats(split, size, n, counts, first_row, max_id, answer_len)
