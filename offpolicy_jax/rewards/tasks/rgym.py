"""Any reasoning-gym dataset as a task, scored with the dataset's own verifier.

Some verifiers evaluate the answer (`eval`, `sympy.parse_expr`). For those
datasets, listed in `EVALUATING_DATASETS` with the grammar their true answers
need, the answer passes `answer_gate.gate` first and the verifier sees only its
re-serialised, safe form; an answer outside the grammar scores 0. The verifier
itself runs in a sandboxed worker (`rewards.score_batch`) all the same.
`tests/test_rgym_gate.py` fails when a reasoning-gym release adds an
evaluating call that this table has not reviewed.

With `max_attempts > 1` the task is multi-turn (`Retry`): after a wrong
answer the environment says so and the policy answers again, up to
`max_attempts` times; the episode's reward is the score of its last answer
times `1 - attempt_penalty * (t - 1)` for an episode that ends at attempt t.
"""

import functools
import json
from typing import Any

from offpolicy_jax.rewards import answer_gate, isolation_wire
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards.environments import Environment, EnvResult
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


# The observation after a wrong answer.
RETRY_FEEDBACK = "That is not correct. Try again."


def _no_handle(value: Any) -> Any:
  raise TypeError(f"a {type(value).__name__} in an example is not data")


class Retry(Environment):
  """Answer a reasoning-gym question; after a wrong answer, hear so and try again.

  State: `{"entry": the example (isolation_wire.encode: tuples and sets keep their
  type), "attempt": int}`; info: `attempts`, `solved`, `score` (of the last
  answer). A step scores its answer with the dataset's verifier (`score`); an
  answer scoring 1 ends the episode, and so does attempt `max_attempts`, with
  reward `score * (1 - attempt_penalty * (attempt - 1))`.
  """

  def __init__(self, score_fn, max_attempts: int, attempt_penalty: float):
    self.score_fn, self.max_attempts, self.attempt_penalty = score_fn, max_attempts, attempt_penalty

  def reset(self, example: Example) -> EnvResult:
    state = {"entry": isolation_wire.encode(example, {}, _no_handle), "attempt": 0}
    return EnvResult("", 0.0, False, state, info={"attempts": 0, "solved": 0, "score": 0.0})

  def step(self, state: Any, action_text: str) -> EnvResult:
    entry = isolation_wire.decode(state["entry"], {}, _no_handle)
    attempt = int(state["attempt"]) + 1
    score_t = float(self.score_fn(entry, action_text))
    solved = score_t >= 1.0
    state = {"entry": state["entry"], "attempt": attempt}
    info = {"attempts": attempt, "solved": int(solved), "score": score_t}
    if solved or attempt >= self.max_attempts:
      reward = score_t * (1.0 - self.attempt_penalty * (attempt - 1))
      return EnvResult("", reward, True, state, info=info)
    return EnvResult(RETRY_FEEDBACK, 0.0, False, state, info=info)


def make_task(
  dataset_name: str,
  *,
  seed: int = 0,
  train_size: int = 10000,
  eval_size: int = 200,
  instruction: str = INSTRUCTION,
  max_attempts: int = 1,
  attempt_penalty: float = 0.1,
  prompt_format: str = "{question}",
  chat: bool = True,
  distractor_format: str = "",
  lowercase: bool = False,
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
    max_attempts: answers per episode; > 1 makes the task multi-turn (`Retry`).
    attempt_penalty: reward lost per attempt after the first, in
      [0, 1 / (max_attempts - 1)).
    prompt_format: the prompt before `instruction`, a `str.format` template over
      the example's fields (`"{metadata[word]}"`: spell_backward's word alone,
      a prompt a character tokenizer can read).
    chat: wrap the prompt in the tokenizer's chat template (False: raw text
      after BOS, as the synthetic tasks).
    distractor_format: a plausible wrong answer, a template like
      `prompt_format` (`"{metadata[word]}"`: the word not reversed), which a
      warm start with `sft.distractor` > 0 imitates; "" for none.
    lowercase: prompts, answers and distractors in lower case (for the character
      tokenizer, whose alphabet has no capitals; only for a dataset whose
      verifier ignores case, as spell_backward's).
    **dataset_kwargs: the dataset's own config fields.

  Returns:
    The Task (host reward only; `answer` is the dataset's answer, for a
    supervised warm start; with `max_attempts > 1` an `environment` and a
    one-turn `demonstration` with the true answer).
  """
  import reasoning_gym

  if max_attempts < 1:
    raise ValueError(f"reasoning_gym: max_attempts must be >= 1, got {max_attempts}.")
  if not (attempt_penalty >= 0 and 1.0 - attempt_penalty * (max_attempts - 1) > 0):
    raise ValueError(
      "reasoning_gym: attempt_penalty must be in [0, 1 / (max_attempts - 1)), got "
      f"{attempt_penalty}."
    )
  try:
    train = reasoning_gym.create_dataset(dataset_name, seed=seed, size=train_size, **dataset_kwargs)
    evals = reasoning_gym.create_dataset(
      dataset_name, seed=seed + 1, size=eval_size, **dataset_kwargs
    )
  except (KeyError, ValueError, TypeError, AssertionError) as e:  # its configs' checks assert
    raise ValueError(f"reasoning_gym dataset {dataset_name!r}: {e}") from e
  examples = [train[i] for i in range(len(train))], [evals[i] for i in range(len(evals))]
  templates = {"prompt_format": prompt_format, "distractor_format": distractor_format}
  for name, template in templates.items():
    if template:
      _fill(template, examples[0][0], f"reasoning_gym:{dataset_name}: {name}")  # fails here

  reward = functools.partial(
    score,
    dataset_name=dataset_name,
    seed=seed,
    size=train_size,
    kwargs_json=json.dumps(dataset_kwargs, sort_keys=True),
  )
  multi = max_attempts > 1
  case = str.lower if lowercase else str

  def answer(ex: Example) -> str:
    return case(str(ex["answer"]))  # what the verifier scores 1

  return Task(
    name=f"reasoning_gym:{dataset_name}",
    train_source=ListSource(examples[0]),
    eval_source=ListSource(examples[1]),
    prompt=lambda ex: case(_fill(prompt_format, ex) + instruction),
    reward=reward,
    use_chat_template=chat,
    answer=None if multi else answer,
    # In bytes: no more tokens than that with a byte-level tokenizer or characters.
    max_answer_len=0 if multi else max(len(answer(ex).encode()) for xs in examples for ex in xs),
    environment=Retry(reward, max_attempts, float(attempt_penalty)) if multi else None,
    demonstration=_demonstration if multi else None,
    distractor=(lambda ex: case(_fill(distractor_format, ex))) if distractor_format else None,
    max_turns=max_attempts if multi else 0,
  )


def _fill(template: str, example: Example, where: str = "reasoning_gym") -> str:
  """`template.format(**example)`; a field the example lacks is a ValueError naming it."""
  try:
    return template.format(**example)
  except (KeyError, IndexError, AttributeError, ValueError) as e:
    raise ValueError(f"{where}: {template!r} does not fit the examples ({e!r})") from e


def _demonstration(example: Example) -> list[tuple[str, str]]:
  """One turn: the dataset's answer in the think/answer format."""
  return [("policy", f"<think></think><answer>{example['answer']}</answer>")]
