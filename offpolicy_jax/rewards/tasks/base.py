"""The `Task` record and a small in-memory data source."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

Example = dict[str, Any]

# Appended to text-task prompts: the think/answer format the format reward checks.
INSTRUCTION = (
  "\n\nThink step by step inside <think> </think>, then give only the final answer "
  "inside <answer> </answer>."
)


class ListSource:
  """A grain `RandomAccessDataSource` over an in-memory list of example dicts."""

  def __init__(self, examples: Sequence[Example]):
    self._examples = list(examples)

  def __len__(self) -> int:
    return len(self._examples)

  def __getitem__(self, index: int) -> Example:
    return self._examples[int(index)]

  def __repr__(self) -> str:
    return f"ListSource(len={len(self)})"


def local_splits(
  kind: str,
  train_path: str | None,
  eval_path: str | None,
  load: Callable[[str, str], list[Example]],
) -> tuple[ListSource, ListSource]:
  """Train and eval sources read by `load(path, kind)`; eval defaults to the train file."""
  if train_path is None:
    raise ValueError(f"task {kind!r} needs train_path (a local .jsonl or .parquet file).")
  train = load(train_path, kind)
  evals = load(eval_path, kind) if eval_path is not None else train
  return ListSource(train), ListSource(evals)


@dataclass(frozen=True)
class Task:
  """A task: prompt sources, a prompt template and a reward.

  Attributes:
    name: the name `get_task` was called with.
    train_source: grain RandomAccessDataSource (`__len__`, `__getitem__` -> dict).
    eval_source: held-out RandomAccessDataSource, disjoint from training where
      the task can guarantee it (synthetic tasks).
    prompt: `prompt(example) -> str`, the user message / raw prompt text.
    reward: host reward `reward(example, response_text) -> float`. Run it
      through `rewards.score_batch` to get timeouts and failure counting.
    use_chat_template: True for text tasks (wrap `prompt` as a user message with
      the tokenizer's chat template), False for raw synthetic prompts (the data
      pipeline prepends BOS instead).
    answer: `answer(example) -> str` whose tokens (+ EOS) `device_reward`
      compares against, or None.
    max_answer_len: characters/tokens of the longest answer (EOS excluded);
      `data.prompt_iterator` pads `answer_tokens` to `max_answer_len + 1`.
    device_reward: optional jittable
      `device_reward(answer_tokens[B, A], tokens[B, N], mask[B, N]) -> [B] f32`;
      `answer_tokens` rows are the answer ids then EOS, padded with -1, repeated
      K times per group to align with the group-major response rows.
    environment: for a multi-turn task, its environment (`environments`): an
      instance from the task's factory, a `environments.RebuildEnv` after
      `get_task`; run it with `environments.EnvRunner`, never in this process.
      None for single-turn tasks.
    demonstration: for a multi-turn task, `demonstration(example)` -> a solved
      episode as `[(role, text), ...]`, role "policy" or "env" (observations
      as `EnvRunner` returns them); the roles say which tokens are the
      policy's. Where the task has `answer`, it is "".join of the texts, so a
      supervised warm start on `answer` learns the format.
    distractor: `distractor(example) -> str`, a plausible wrong answer (reverse:
      the digits as given) that a warm start on imperfect demonstrations
      imitates for a fraction `sft.distractor` of its examples; or None.
    max_turns: policy turns an episode may take (0: single-turn task).
    max_turn_len: characters of the longest policy turn of a demonstration,
      `TURN_END` included (a budget for one turn's tokens).
  """

  name: str
  train_source: Any
  eval_source: Any
  prompt: Callable[[Example], str]
  reward: Callable[[Example, str], float]
  use_chat_template: bool = False
  answer: Callable[[Example], str] | None = None
  max_answer_len: int = 0
  device_reward: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None
  environment: Any = None
  demonstration: Callable[[Example], list[tuple[str, str]]] | None = None
  distractor: Callable[[Example], str] | None = None
  max_turns: int = 0
  max_turn_len: int = 0
