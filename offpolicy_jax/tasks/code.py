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

Reward (`program_reward`): with `n` tests of which `p` pass,

  r = p / n               (partial_credit=True)
  r = 1{p == n}           (partial_credit=False)

and r = 0 if the program (`extract_program(response)`, after the trusted
`prefix`) does not compile or raises while it runs. A test fails if it raises.

* io tests ("code"): `y = f(*args)` passes iff `type(y) is type(want)` and
  `y == want`, so an object whose `__eq__` returns True never passes.
* assert tests (MBPP, HumanEval): the tests run in a namespace of their own,
  built from trusted code only (`prefix`, `setup`, and the reference's imports
  the tests use) plus the program's `entry_points`; the result of every call in
  test code must be built from trusted types (static and importable types,
  classes of the trusted code or named like a class of the reference, and
  lists, dicts, tuples, sets and attributes of those), so a class defined by
  the program cannot fake equality or truth. MBPP scores each assert (the
  prompt shows the first); HumanEval's `check(candidate)` is one
  all-or-nothing test.

Rows. MBPP: `{"task_id": 11, "text": str, "code": str, "test_list": [str, ...],
"test_setup_code": str (optional)}`, each test an `assert` statement. HumanEval:
`{"task_id": str, "prompt": str, "canonical_solution": str, "test": str
defining check(candidate), "entry_point": str}`.

Examples (plain picklable dicts). "code": `{"prompt", "answer", "entry_point",
"io": [[[a, b], y], ...]}`. MBPP / HumanEval: `{"task_id", "prompt", "answer"
(the reference in a fenced block), "prefix", "setup", "tests": [str, ...],
"entry_points": [str, ...], "classes": [str, ...]}`.

The program runs wherever the reward is called: `tasks.get_task` wraps it so
that it runs only in sandboxed verifier workers (`rewards.score_batch`, and
direct `task.reward(...)` calls too), never in the trainer. Inside its worker a
program could still patch the worker's modules, so these checks stop a
policy's accidental hacks, not a determined attacker; such a program can at
worst forge the scores of calls in its own worker (the trainer reads replies
as JSON data), never act on the host.
"""

import ast
import builtins
import collections
import functools
import operator
import os
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from offpolicy_jax.tasks import synthetic
from offpolicy_jax.tasks.base import Example, Task, local_splits
from offpolicy_jax.tasks.math_data import _read_rows

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

_FAIL = (Exception, SystemExit)  # other BaseExceptions reach the caller, which scores 0
_BUILTINS = dict(vars(builtins))
_GUARD = "__plain__"
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: set for every class created by a class statement
_MAX_VISITS = 100_000
_TYPE_ATTR = {k: type.__dict__[k] for k in ("__flags__", "__module__", "__qualname__")}
_FENCE_RE = re.compile(r"```[ \t]*([\w+.-]*)[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)
_PYTHON_TAGS = ("", "python", "py", "python3")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_program(text: str) -> str:
  """The program in a response.

  Args:
    text: the decoded response.

  Returns:
    The body of the last ```python (or untagged ```) fenced block, else the
    content of the last `<answer>...</answer>` block, else `text` unchanged.
  """
  blocks = [body for tag, body in _FENCE_RE.findall(text) if tag.lower() in _PYTHON_TAGS]
  if blocks:
    return blocks[-1]
  answers = _ANSWER_RE.findall(text)
  return answers[-1] if answers else text


def program_reward(example: Example, text: str, partial_credit: bool = True) -> float:
  """Runs the response's program against the example's tests (see the module docstring).

  `r = passed / n` with partial credit, else `1{passed == n}`; 0 if the
  program fails to compile or raises while it runs. Picklable through
  `functools.partial(program_reward, partial_credit=...)`.

  Args:
    example: a "code" example (with `io`) or an MBPP / HumanEval example (with `tests`).
    text: the decoded response.
    partial_credit: fraction of tests passed instead of all-or-nothing.

  Returns:
    The reward in [0, 1].
  """
  ns = _namespace("__program__")
  try:
    exec(compile(example.get("prefix", "") + extract_program(text), "<program>", "exec"), ns)
  except _FAIL:
    return 0.0
  passed = _io_results(ns, example) if "io" in example else _assert_results(ns, example)
  if partial_credit:
    return sum(passed) / len(passed)
  return float(all(passed))


def _namespace(name: str) -> dict[str, Any]:
  return {"__builtins__": dict(_BUILTINS), "__name__": name}


def _io_results(ns: dict[str, Any], example: Example) -> list[bool]:
  fn = ns.get(example["entry_point"])
  if not callable(fn):
    return [False] * len(example["io"])
  passed = []
  for args, want in example["io"]:
    try:
      got = fn(*args)
      passed.append(type(got) is type(want) and _check_plain(got, set()) is got and got == want)
    except _FAIL:
      passed.append(False)
  return passed


def _assert_results(program_ns: dict[str, Any], example: Example) -> list[bool]:
  tests = example["tests"]
  ns = _namespace("__tests__")
  try:
    exec(example.get("prefix", ""), ns)
    exec(example.get("setup", ""), ns)
  except _FAIL:
    return [False] * len(tests)
  trusted = {id(v) for v in ns.values() if issubclass(type(v), type)}
  for name in example["entry_points"]:
    ns.pop(name, None)
    if name in program_ns:
      ns[name] = program_ns[name]
  for name in example.get("classes", ()):  # the reference's classes, if the program has them
    if issubclass(type(program_ns.get(name)), type):
      trusted.add(id(program_ns[name]))
  ns[_GUARD] = functools.partial(_check_plain, trusted=trusted)
  passed = []
  for src in tests:
    try:
      exec(_guarded(src), ns)
      passed.append(True)
    except _FAIL:
      passed.append(False)
  return passed


class _GuardCalls(ast.NodeTransformer):
  """Rewrites every call `g(x)` in trusted test code to `__plain__(g(x))`."""

  def visit_Call(self, node: ast.Call) -> ast.AST:
    self.generic_visit(node)
    return ast.copy_location(ast.Call(ast.Name(_GUARD, ast.Load()), [node], []), node)


@functools.lru_cache(maxsize=4096)
def _guarded(src: str) -> types.CodeType:
  tree = ast.fix_missing_locations(_GuardCalls().visit(ast.parse(src)))
  return compile(tree, "<test>", "exec")


def _trusted_type(cls: type, trusted: set[int]) -> bool:
  """Static (C) types, classes of the trusted code, and classes importable by name.

  Attributes are read through `type`'s own descriptors so a metaclass cannot lie.
  """
  if id(cls) in trusted or not _TYPE_ATTR["__flags__"].__get__(cls) & _HEAPTYPE:
    return True
  obj = sys.modules.get(_TYPE_ATTR["__module__"].__get__(cls))
  if obj is None:
    return False
  for part in _TYPE_ATTR["__qualname__"].__get__(cls).split("."):
    obj = getattr(obj, part, None)
  return obj is cls


def _check_plain(value: Any, trusted: set[int]) -> Any:
  """Returns `value` if it is built only from trusted types, else raises AssertionError."""
  stack, seen = [value], set()
  while stack:
    v = stack.pop()
    if not _trusted_type(type(v), trusted):
      raise AssertionError(f"value of untrusted type {type(v).__name__!r}")
    if id(v) in seen or isinstance(v, (type, types.ModuleType)):
      continue
    seen.add(id(v))
    if len(seen) > _MAX_VISITS:
      raise AssertionError("value too large to check")
    if isinstance(v, dict):
      stack.extend(v.keys())
      stack.extend(v.values())
    elif isinstance(v, (list, tuple, set, frozenset, collections.deque)):
      stack.extend(v)
    attrs = getattr(v, "__dict__", None)
    if isinstance(attrs, dict):
      stack.append(attrs)
  return value


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
  entry = sorted(read - stored - bound - set(_BUILTINS))
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
    programs as answers, no device reward. MBPP / HumanEval: chat-templated
    prompts, the fenced reference programs as answers (`max_answer_len` in UTF-8
    bytes, an upper bound on tokens).

  Raises:
    ValueError: unknown kind, bad arguments, or a missing or malformed data file.
  """
  reward = functools.partial(program_reward, partial_credit=partial_credit)
  if kind == "code":
    if train_path is not None or eval_path is not None:
      raise ValueError("task 'code' is procedural; it takes no train_path or eval_path.")
    if num_shown < 1 or num_hidden < 1 or num_eval < 1 or max_value < 1:
      raise ValueError("num_shown, num_hidden, num_eval and max_value must be >= 1.")
    if num_shown + num_hidden > (max_value + 1) ** 2:
      raise ValueError(f"num_shown + num_hidden > {(max_value + 1) ** 2} distinct argument pairs.")
    gen = functools.partial(
      _gen_program, num_shown=num_shown, num_hidden=num_hidden, max_value=max_value
    )
    return Task(
      name=kind,
      train_source=synthetic.ProceduralSource(gen, seed),
      eval_source=synthetic._eval_source(gen, seed, num_eval),
      prompt=operator.itemgetter("prompt"),
      reward=reward,
      use_chat_template=False,
      answer=operator.itemgetter("answer"),
      max_answer_len=max(len(_PROGRAM.format(expr)) for expr, _ in _TEMPLATES),
      device_reward=None,
    )
  if kind not in _ROW_PARSERS:
    raise ValueError(f"unknown code task {kind!r}; expected code, mbpp or humaneval.")
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
