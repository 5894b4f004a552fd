"""Any reasoning-gym dataset as a task, scored with the dataset's own verifier.

Some verifiers evaluate the answer (`eval`, `sympy.parse_expr`). For those
datasets, listed in `EVALUATING_DATASETS` with the grammar their true answers
need, the answer passes `answer_gate.gate` first and the verifier sees only its
re-serialised, safe form; an answer outside the grammar scores 0. The verifier
itself runs in a sandboxed worker (`rewards.score_batch`) all the same.
`tests/test_rgym_gate.py` fails when a reasoning-gym release adds an
evaluating call that this table has not reviewed.
"""

import functools
import json

from offpolicy_jax.rewards import answer_gate
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards.tasks.base import INSTRUCTION, Example, ListSource, Task

# Datasets whose `score_answer` evaluates the model's answer, and the gate kind.
EVALUATING_DATASETS = {
  # eval(answer) when the answer is not an exact match.
  "string_insertion": "literal",
  "spiral_matrix": "literal",
  "binary_matrix": "literal",
  "n_queens": "literal",
  # sympy.parse_expr(answer).
  "polynomial_multiplication": "expression",
  "simple_integration": "expression",
  "intermediate_integration": "expression",
  "puzzle24": "expression",
  "countdown": "expression",
}


@functools.lru_cache(maxsize=8)
def _dataset(dataset_name: str, seed: int, size: int, kwargs_json: str):
  import reasoning_gym

  return reasoning_gym.create_dataset(dataset_name, seed=seed, size=size, **json.loads(kwargs_json))


def score(
  example: Example, text: str, *, dataset_name: str, seed: int, size: int, kwargs_json: str
) -> float:
  """`score_answer(gated answer, entry=example)` of the dataset (see module docstring)."""
  answer: str | None = rewards.extract_answer(text)
  source = (example.get("metadata") or {}).get("source_dataset", dataset_name)
  kind = EVALUATING_DATASETS.get(source)
  if kind is not None and answer is not None:
    answer = answer_gate.gate(answer, kind)
    if answer is None:
      return 0.0
  ds = _dataset(dataset_name, seed, size, kwargs_json)
  return float(ds.score_answer(answer, entry=example))


def make_task(
  dataset_name: str,
  *,
  seed: int = 0,
  train_size: int = 10000,
  eval_size: int = 200,
  instruction: str = INSTRUCTION,
  **dataset_kwargs,
) -> Task:
  """`reasoning_gym.create_dataset(dataset_name, seed=, size=, **dataset_kwargs)`.

  Training examples use `seed`, evaluation examples `seed + 1` (procedurally
  generated; reasoning-gym does not guarantee the two are disjoint). The reward
  is `dataset.score_answer(answer, entry=example)` in [0, 1], where `answer` is
  the content of the last `<answer>...</answer>` block of the response, or the
  whole stripped response if there is none, gated for `EVALUATING_DATASETS`.

  Args:
    dataset_name: a reasoning-gym dataset name, e.g. "basic_arithmetic".
    seed: generation seed.
    train_size: number of training examples.
    eval_size: number of evaluation examples.
    instruction: appended to every question.
    **dataset_kwargs: the dataset's own config fields.

  Returns:
    The Task (chat-templated prompts, host reward only).
  """
  import reasoning_gym

  try:
    train = reasoning_gym.create_dataset(dataset_name, seed=seed, size=train_size, **dataset_kwargs)
    evals = reasoning_gym.create_dataset(
      dataset_name, seed=seed + 1, size=eval_size, **dataset_kwargs
    )
  except (KeyError, ValueError, TypeError) as e:
    raise ValueError(f"reasoning_gym dataset {dataset_name!r}: {e}") from e

  return Task(
    name=f"reasoning_gym:{dataset_name}",
    train_source=ListSource([train[i] for i in range(len(train))]),
    eval_source=ListSource([evals[i] for i in range(len(evals))]),
    prompt=lambda ex: ex["question"] + instruction,
    reward=functools.partial(
      score,
      dataset_name=dataset_name,
      seed=seed,
      size=train_size,
      kwargs_json=json.dumps(dataset_kwargs, sort_keys=True),
    ),
    use_chat_template=True,
  )
