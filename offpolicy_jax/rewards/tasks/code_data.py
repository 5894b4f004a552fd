"""MBPP and HumanEval files: rows read, validated and turned into code examples.

Rows. MBPP: `{"task_id": 11, "text": str, "code": str, "test_list": [str, ...],
"test_setup_code": str (optional)}`, each test an `assert` statement. HumanEval:
`{"task_id": str, "prompt": str, "canonical_solution": str, "test": str
defining check(candidate), "entry_point": str}`.

Examples (plain picklable dicts): `{"task_id", "prompt", "answer" (the
reference in a fenced block), "prefix", "setup", "tests": [str, ...],
"entry_points": [str, ...], "classes": [str, ...]}`, graded by
`code_reward.program_reward`.

MBPP: the prompt is the task text and its first test; `setup` is the row's
`test_setup_code` after the reference's imports that the tests use;
`entry_points` are the names the tests read but neither bind nor get from
setup or builtins; `classes` are the reference's top-level classes.
HumanEval: the prompt is the signature and docstring, which is also the
trusted `prefix` of the program; the one test is `check(entry_point)`.
"""

import ast
import builtins
import os
from typing import Any

from offpolicy_jax.rewards.tasks.base import Example
from offpolicy_jax.rewards.tasks.math_data import _read_rows

# Names a test may read without the program defining them (taken once, at import).
_BUILTIN_NAMES = frozenset(vars(builtins))


def _fenced(code: str) -> str:
  return "```python\n" + code.rstrip("\n") + "\n```"


def _parse(src: str, field: str) -> ast.Module:
  try:
    return ast.parse(src)
  except (SyntaxError, ValueError) as e:
    raise ValueError(f"{field!r} is not valid Python ({e})") from None


def _string(row: Any, field: str) -> str:
  if not isinstance(row.get(field), str):
    raise ValueError(f"needs a string {field!r}")
  return row[field].replace("\r\n", "\n")


def _names(trees: list[ast.Module]) -> tuple[set[str], set[str]]:
  """(names read, names bound) anywhere in `trees`."""
  read: set[str] = set()
  bound: set[str] = set()
  for node in (n for tree in trees for n in ast.walk(tree)):
    if isinstance(node, ast.Name):
      (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      bound.add(node.name)
    elif isinstance(node, ast.arg):
      bound.add(node.arg)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      bound.update((a.asname or a.name).split(".")[0] for a in node.names)
  return read, bound


def _mbpp_row(row: Any, n: int) -> Example:
  if not isinstance(row, dict):
    raise ValueError("not a JSON object")
  text, code = _string(row, "text").strip(), _string(row, "code")
  tests = row.get("test_list")
  if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
    raise ValueError("needs 'test_list', a non-empty list of assert strings")
  tests = [t.replace("\r\n", "\n") for t in tests]
  setup = _string(row, "test_setup_code") if row.get("test_setup_code") is not None else ""
  task_id = row.get("task_id", n)
  if not text or not isinstance(task_id, (int, str)):
    raise ValueError("needs a non-empty 'text' and an int or string 'task_id'")
  code_tree = _parse(code, "code")
  read, stored = _names([_parse(t, f"test_list[{i}]") for i, t in enumerate(tests)])
  # The reference's imports that the tests use (e.g. `math`) run as trusted setup.
  imports = []
  for node in code_tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      node.names = [a for a in node.names if (a.asname or a.name).split(".")[0] in read]
      imports += [ast.unparse(node)] if node.names else []
  setup = "\n".join([*imports, setup])
  _, bound = _names([_parse(setup, "test_setup_code")])
  entry = sorted(read - stored - bound - _BUILTIN_NAMES)
  if not entry:
    raise ValueError("'test_list' uses no name the program defines")
  classes = {node.name for node in code_tree.body if isinstance(node, ast.ClassDef)}
  return {
    "task_id": task_id,
    "prompt": f"{text}\nYour code should pass this test:\n{tests[0]}",
    "answer": _fenced(code),
    "prefix": "",
    "setup": setup,
    "tests": tests,
    "entry_points": entry,
    "classes": sorted(classes),
  }


def _humaneval_row(row: Any, n: int) -> Example:
  del n
  if not isinstance(row, dict):
    raise ValueError("not a JSON object")
  task_id, prompt, solution, test, entry = (
    _string(row, k) for k in ("task_id", "prompt", "canonical_solution", "test", "entry_point")
  )
  if not entry.isidentifier():
    raise ValueError(f"'entry_point' {entry!r} is not an identifier")
  prompt = prompt if prompt.endswith("\n") else prompt + "\n"
  _parse(prompt + solution, "prompt + canonical_solution")
  if not any(
    isinstance(node, ast.FunctionDef) and node.name == "check" for node in _parse(test, "test").body
  ):
    raise ValueError("'test' defines no check(candidate)")
  return {
    "task_id": task_id,
    "prompt": f"Complete the following Python function:\n```python\n{prompt}```",
    "answer": _fenced(prompt + solution),
    "prefix": prompt,
    "setup": "",
    "tests": [f"{test}\n\ncheck({entry})\n"],
    "entry_points": [entry],
    "classes": [],
  }


_ROW_PARSERS = {"mbpp": _mbpp_row, "humaneval": _humaneval_row}
# The kinds read from files, in the order of `_ROW_PARSERS`.
FILE_KINDS = tuple(_ROW_PARSERS)


def load_examples(path: str, kind: str) -> list[Example]:
  """Reads and validates every row of an MBPP or HumanEval file up front.

  Args:
    path: a .jsonl (JSON lines) or .parquet file.
    kind: "mbpp" or "humaneval".

  Returns:
    The examples, in file order.

  Raises:
    ValueError: missing file, invalid JSON or a malformed row, naming the file
      and the 1-based row.
  """
  out = []
  for n, row in _read_rows(os.fspath(path)):
    try:
      out.append(_ROW_PARSERS[kind](row, n))
    except ValueError as e:
      raise ValueError(f"{path}: row {n}: malformed {kind} row: {e}.") from None
  if not out:
    raise ValueError(f"{path}: no rows.")
  return out
