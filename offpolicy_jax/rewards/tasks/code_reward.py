"""The code tasks' reward: run a response's program, grade it against unit tests.

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

The example formats are described in `tasks.code` (tasks) and
`tasks.code_data` (MBPP / HumanEval rows).

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
import re
import sys
import types
from typing import Any

from offpolicy_jax.rewards.tasks.base import Example

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
