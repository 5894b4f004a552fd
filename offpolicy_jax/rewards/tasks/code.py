"""Code tasks: the reward runs the model's Python program against unit tests.

| kind      | examples                            | prompt                                     |
|-----------|-------------------------------------|--------------------------------------------|
| code      | procedural, nothing to download     | `f(2,3)=5 f(4,1)=5 f(0,7)=7` + newline     |
| mbpp      | local MBPP .jsonl / .parquet        | task text, its first test, `instruction`   |
| humaneval | local HumanEval .jsonl / .parquet   | signature and docstring, `instruction`     |

"code" is programming by example for small character-level models: the prompt
shows `num_shown` calls of a hidden function of two integers in
`[0, max_value]`, drawn from the templates below (the calls are redrawn until
no other template fits them), and the reference answer is the one-line program
`def f(a,b):return a+b` (at most 28 characters; prompts at most 33 with the
defaults). The tests are `num_hidden` further calls, never shown. As in
`synthetic`, a problem is held out for evaluation iff `crc32(prompt) % 10 == 0`,
so eval prompts never occur in training.

Examples (plain picklable dicts). "code": `{"prompt", "answer", "entry_point",
"io": [[[a, b], y], ...]}`. MBPP / HumanEval: read from files by `code_data`
(`load_examples`, which describes the rows and examples).

Every kind is scored by `program_reward` (in `code_reward`, which describes
the grading and where the program runs): the fraction of tests passed, or
all-or-nothing, and 0 if the program does not compile or raises.
`program_reward`, `extract_program` and `load_examples` are re-exported here.
"""

import functools
import operator
import re
from collections.abc import Callable

import numpy as np

from offpolicy_jax.rewards.tasks import code_data, synthetic
from offpolicy_jax.rewards.tasks.base import Example, Task, local_splits
from offpolicy_jax.rewards.tasks.code_data import load_examples
from offpolicy_jax.rewards.tasks.code_reward import extract_program, program_reward

CODE_INSTRUCTION = "\n\nWrite the complete solution in a single ```python fenced code block."

KINDS = ("code", "mbpp", "humaneval")
_PROGRAM = "def f(a,b):return {}"
# The hidden functions of "code": the answer's expression and an independent twin.
_TEMPLATES: tuple[tuple[str, Callable[[int, int], int]], ...] = (
  ("a", lambda a, b: a),
  ("b", lambda a, b: b),
  ("a+b", lambda a, b: a + b),
  ("a-b", lambda a, b: a - b),
  ("b-a", lambda a, b: b - a),
  ("a*b", lambda a, b: a * b),
  ("max(a,b)", lambda a, b: a if a > b else b),
  ("min(a,b)", lambda a, b: b if a > b else a),
  ("abs(a-b)", lambda a, b: a - b if a > b else b - a),
  ("a+b+1", lambda a, b: a + b + 1),
  ("a*2+b", lambda a, b: 2 * a + b),
  ("a+b*2", lambda a, b: a + 2 * b),
  ("(a+b)*2", lambda a, b: 2 * a + 2 * b),
  ("a*a", lambda a, b: a**2),
  ("b*b", lambda a, b: b**2),
  ("a*a+b", lambda a, b: a**2 + b),
  ("a*b+a", lambda a, b: a * (b + 1)),
  ("a*10+b", lambda a, b: int(f"{a}{b}") if a else b),
  ("(a+b)//2", lambda a, b: int((a + b) / 2)),  # arguments are >= 0: truncation is floor
  ("a//(b+1)", lambda a, b: int(a / (b + 1))),
  ("max(a-b,0)", lambda a, b: max(a - b, 0)),
  ("a-b*2", lambda a, b: a - 2 * b),
)


_CALL = re.compile(r"f\((\d+),(\d+)\)=(-?\d+)")


def _distractor_program(example: Example) -> str:
  """A plausible wrong program (`Task.distractor`): of the templates other than the answer's,
  the one that fits the most shown calls (the first such in `_TEMPLATES`)."""
  calls = [(int(a), int(b), int(y)) for a, b, y in _CALL.findall(example["prompt"])]
  fits = [
    (sum(fn(a, b) == y for a, b, y in calls), -i, expr)
    for i, (expr, fn) in enumerate(_TEMPLATES)
    if _PROGRAM.format(expr) != example["answer"]
  ]
  return _PROGRAM.format(max(fits)[2])


def _gen_program(rng: np.random.Generator, num_shown: int, num_hidden: int, max_value: int):
  """One "code" example: a template and `num_shown` calls that identify it among all."""
  t = int(rng.integers(len(_TEMPLATES)))
  expr, fn = _TEMPLATES[t]
  side = max_value + 1
  others = [g for i, (_, g) in enumerate(_TEMPLATES) if i != t]
  for _ in range(1000):
    pairs = [divmod(int(x), side) for x in rng.choice(side * side, num_shown + num_hidden, False)]
    shown = pairs[:num_shown]
    if all(any(g(a, b) != fn(a, b) for a, b in shown) for g in others):
      break
  else:
    raise RuntimeError(f"no {num_shown} calls identify {expr!r}; raise num_shown or max_value.")
  return {
    "prompt": " ".join(f"f({a},{b})={fn(a, b)}" for a, b in shown) + "\n",
    "answer": _PROGRAM.format(expr),
    "entry_point": "f",
    "io": [[[a, b], fn(a, b)] for a, b in pairs[num_shown:]],
  }


def _chat_prompt(example: Example, instruction: str) -> str:
  return example["prompt"] + instruction


def make_task(
  kind: str,
  *,
  seed: int = 0,
  num_eval: int = 256,
  partial_credit: bool = True,
  num_shown: int = 3,
  num_hidden: int = 6,
  max_value: int = 9,
  train_path: str | None = None,
  eval_path: str | None = None,
  instruction: str = CODE_INSTRUCTION,
) -> Task:
  """Builds a code task; its reward is `program_reward` (picklable).

  Args:
    kind: "code" (procedural), "mbpp" or "humaneval" (local files).
    seed: data seed of "code" (the same seed gives the same examples).
    num_eval: size of the fixed held-out evaluation set of "code".
    partial_credit: reward the fraction of tests passed instead of all-or-nothing.
    num_shown: calls shown in a "code" prompt.
    num_hidden: hidden test calls of a "code" example.
    max_value: "code" arguments are in `[0, max_value]`.
    train_path: MBPP / HumanEval training file (.jsonl or .parquet; required).
    eval_path: MBPP / HumanEval evaluation file; defaults to `train_path`.
    instruction: appended to MBPP / HumanEval prompts.

  Returns:
    The Task. "code": raw prompts for the character tokenizer, reference
    programs as answers, no device reward; its distractor (`sft.distractor`)
    is the program of the other template that fits the most shown calls.
    MBPP / HumanEval: chat-templated prompts, the fenced reference programs
    as answers (`max_answer_len` in UTF-8 bytes, an upper bound on tokens).

  Raises:
    ValueError: unknown kind, bad arguments, or a missing or malformed data file.
  """
  reward = functools.partial(program_reward, partial_credit=partial_credit)
  if kind == "code":
    if train_path is not None or eval_path is not None:
      raise ValueError("task 'code' is procedural; it takes no train_path or eval_path.")
    return _procedural_task(reward, seed, num_eval, num_shown, num_hidden, max_value)
  if kind not in code_data.FILE_KINDS:
    raise ValueError(f"unknown code task {kind!r}; expected code, mbpp or humaneval.")
  return _file_task(kind, reward, train_path, eval_path, instruction)


def _procedural_task(
  reward: Callable[[Example, str], float],
  seed: int,
  num_eval: int,
  num_shown: int,
  num_hidden: int,
  max_value: int,
) -> Task:
  """The "code" task: generated programs, raw prompts, reference programs as answers."""
  if num_shown < 1 or num_hidden < 1 or num_eval < 1 or max_value < 1:
    raise ValueError("num_shown, num_hidden, num_eval and max_value must be >= 1.")
  if num_shown + num_hidden > (max_value + 1) ** 2:
    raise ValueError(f"num_shown + num_hidden > {(max_value + 1) ** 2} distinct argument pairs.")
  gen = functools.partial(
    _gen_program, num_shown=num_shown, num_hidden=num_hidden, max_value=max_value
  )
  return Task(
    name="code",
    train_source=synthetic.ProceduralSource(gen, seed),
    eval_source=synthetic._eval_source(gen, seed, num_eval),
    prompt=operator.itemgetter("prompt"),
    reward=reward,
    use_chat_template=False,
    answer=operator.itemgetter("answer"),
    max_answer_len=max(len(_PROGRAM.format(expr)) for expr, _ in _TEMPLATES),
    device_reward=None,
    distractor=_distractor_program,
  )


def _file_task(
  kind: str,
  reward: Callable[[Example, str], float],
  train_path: str | None,
  eval_path: str | None,
  instruction: str,
) -> Task:
  """An MBPP or HumanEval task from local files, with chat-templated prompts."""
  train, evals = local_splits(kind, train_path, eval_path, load_examples)
  return Task(
    name=kind,
    train_source=train,
    eval_source=evals,
    prompt=functools.partial(_chat_prompt, instruction=instruction),
    reward=reward,
    use_chat_template=True,
    answer=operator.itemgetter("answer"),
    max_answer_len=max(len(s[i]["answer"].encode()) for s in (train, evals) for i in range(len(s))),
  )


__all__ = [
  "CODE_INSTRUCTION",
  "KINDS",
  "extract_program",
  "load_examples",
  "make_task",
  "program_reward",
]
