"""GSM8K and MATH from local JSONL or Parquet files, graded with math-verify.

Reward (DeepSeek-R1-style rule reward): `accuracy + format`, where accuracy is
1 if `math_verify.verify(gold, parse(answer))` else 0, `answer` being the
content of the last `<answer>...</answer>` block (or the whole response), and
format is `+format_coef` (default 0.1) if the response is exactly
`<think>...</think><answer>...</answer>` and `-format_coef` otherwise. So the
reward lies in {-0.1, 0.1, 0.9, 1.1}. The reward runs in a sandboxed verifier
worker's main thread, where math-verify's own signal-based timeouts work; the
worker's hard kill is the backstop.
"""

import functools
import json
import os
from typing import Any

from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards.tasks.base import INSTRUCTION, Example, Task, local_splits


def _read_rows(path: str) -> list[tuple[int, Any]]:
  """(1-based row number, row) pairs from a .jsonl/.json lines or .parquet file."""
  if not os.path.exists(path):
    raise ValueError(f"data file not found: {path}")
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq

    return list(enumerate(pq.read_table(path).to_pylist(), start=1))
  rows = []
  with open(path) as f:
    for n, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        rows.append((n, json.loads(line)))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: row {n}: invalid JSON ({e.msg}).") from e
  return rows


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces."""
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth = 1
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


def _gsm8k_row(row: Any) -> Example:
  if not isinstance(row, dict) or not isinstance(row.get("question"), str):
    raise ValueError("needs a string 'question'")
  ans = row.get("answer")
  if not isinstance(ans, str) or "####" not in ans:
    raise ValueError("needs a string 'answer' containing '#### <final answer>'")
  gold = ans.split("####")[-1].strip().replace(",", "")
  if not gold:
    raise ValueError("empty final answer after '####'")
  return {"question": row["question"], "gold": gold}


def _math_row(row: Any) -> Example:
  if not isinstance(row, dict) or not isinstance(row.get("problem"), str):
    raise ValueError("needs a string 'problem'")
  gold = row.get("answer")
  if not isinstance(gold, str) or not gold.strip():
    gold = last_boxed(row.get("solution") or "") if isinstance(row.get("solution"), str) else None
  if not gold:
    raise ValueError("needs an 'answer' or a 'solution' containing \\boxed{...}")
  return {"question": row["problem"], "gold": gold.strip()}


def load_examples(path: str, kind: str) -> list[Example]:
  """Reads and validates every row up front; errors name the file and row."""
  parse_row = {"gsm8k": _gsm8k_row, "math": _math_row}[kind]
  out = []
  for n, row in _read_rows(os.fspath(path)):
    try:
      out.append(parse_row(row))
    except ValueError as e:
      raise ValueError(f"{path}: row {n}: malformed {kind} row: {e}.") from None
  if not out:
    raise ValueError(f"{path}: no rows.")
  return out


def math_reward(example: Example, text: str, format_coef: float = 0.1, timeout_s: int = 5) -> float:
  """`1{verify(gold, answer)} + (format_coef if format ok else -format_coef)`.

  math-verify's parsing and verification each stop after `timeout_s` seconds
  (its SIGALRM timeouts, which need the main thread: run this through
  `rewards.score_batch`, whose workers call rewards on their main thread).
  """
  import math_verify

  gold = math_verify.parse(f"\\boxed{{{example['gold']}}}", parsing_timeout=timeout_s)
  pred = math_verify.parse(rewards.extract_answer(text), parsing_timeout=timeout_s)
  correct = bool(pred) and math_verify.verify(gold, pred, timeout_seconds=timeout_s)
  fmt = format_coef if rewards.follows_format(text) else -format_coef
  return float(correct) + fmt


def make_task(
  kind: str,
  *,
  train_path: str | None = None,
  eval_path: str | None = None,
  format_coef: float = 0.1,
  instruction: str = INSTRUCTION,
) -> Task:
  """GSM8K (`question`, `answer` with `#### x`) or MATH (`problem`, `solution`
  with `\\boxed{x}`, or an `answer` column) from local files.

  Args:
    kind: "gsm8k" or "math".
    train_path: .jsonl or .parquet training file (required).
    eval_path: evaluation file; defaults to `train_path` when omitted.
    format_coef: size of the think/answer format bonus/penalty.
    instruction: appended to every question.

  Returns:
    The Task (chat-templated prompts, host reward only).
  """
  train, evals = local_splits(kind, train_path, eval_path, load_examples)
  return Task(
    name=kind,
    train_source=train,
    eval_source=evals,
    prompt=lambda ex: ex["question"] + instruction,
    reward=functools.partial(math_reward, format_coef=format_coef),
    use_chat_template=True,
  )
