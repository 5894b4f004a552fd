"""The code tasks' reward: run a response's program, grade it against unit tests.

Reward (`program_reward`): with `n` tests of which `p` pass,

  r = p / n               (partial_credit=True)
  r = 1{p == n}           (partial_credit=False)

and r = 0 if the program (`extract_program(response)`, after the trusted
`prefix`) does not compile or raises while it runs. A test fails if it raises.

Grading never shares a process with the graded program. The program runs in
an `isolation.Session`: a fresh process forked from a clean template, which
never receives the example's expected values and is killed after the
grading, so nothing the program does survives into the next call. The grader
(this module, in the process that called the reward) sends the calls of the
tests there and gets back their results as data (JSON values of exact types,
or opaque handles), then compares them itself:

* io tests ("code"): `y = f(*args)` passes iff `type(y) is type(want)` and
  `y == want`, `y` decoded from the program's answer (so an object whose
  `__eq__` returns True cannot even reach the comparison).
* assert tests (MBPP, HumanEval): the tests themselves (`prefix`, `setup` and
  the asserts; HumanEval's `check(candidate)`) run here, as trusted code, with
  each of the program's `entry_points` bound to a `Remote` that forwards its
  calls to the program's process. What comes back is data; an object that is
  not data stays in the program's process as a handle, which the tests can
  pass back and read attributes of, but which has no truth value and equals
  only itself. Instances of the classes the trusted code defines (e.g. a
  linked list node of MBPP's setup) travel as values in both directions and
  are rebuilt from the trusted class. Side effects of a call on its arguments
  stay in the program's process. MBPP scores each assert (the prompt shows the
  first); HumanEval's `check(candidate)` is one all-or-nothing test.

Why split tests rather than run each test file with the program in a fresh
process and read a verdict from it: whatever computes the verdict next to the
program can be patched by it (the stack, the gc, builtins, the assert's own
comparison), so the comparison must happen where the program never ran.

The example formats are described in `tasks.code` (tasks) and
`tasks.code_data` (MBPP / HumanEval rows). `tasks.get_task` wraps the reward
so that the grading itself runs in sandboxed verifier workers, never in the
trainer.
"""

import builtins
import re
from typing import Any

from offpolicy_jax.rewards import isolation, isolation_wire
from offpolicy_jax.rewards.tasks.base import Example

_TESTS = "__tests__"  # `__name__` of the trusted test namespace (and its classes' `__module__`)
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


def program_reward(
  example: Example, text: str, partial_credit: bool = True, timeout_s: float = 10.0
) -> float:
  """Runs the response's program against the example's tests (see the module docstring).

  `r = passed / n` with partial credit, else `1{passed == n}`; 0 if the
  program fails to compile or raises while it runs. Picklable through
  `functools.partial(program_reward, partial_credit=...)`.

  Args:
    example: a "code" example (with `io`) or an MBPP / HumanEval example (with `tests`).
    text: the decoded response.
    partial_credit: fraction of tests passed instead of all-or-nothing.
    timeout_s: wall-clock limit of the program's process (a verifier worker
      caps it at its call's timeout).

  Returns:
    The reward in [0, 1].

  Raises:
    TimeoutError: the program ran past its time (a verifier worker reports a timeout).
  """
  program = example.get("prefix", "") + extract_program(text)
  grade = _io_results if "io" in example else _assert_results
  try:
    passed = grade(program, example, timeout_s)
  except isolation_wire.ProgramError:  # did not compile, or raised while it ran
    return 0.0
  if partial_credit:
    return sum(passed) / len(passed)
  return float(all(passed))


def _io_results(program: str, example: Example, timeout_s: float) -> list[bool]:
  with isolation.Session(program, timeout_s=timeout_s) as prog:
    got = prog.map(example["entry_point"], [args for args, _ in example["io"]])
  return [
    type(y) is type(want) and y == want for y, (_, want) in zip(got, example["io"], strict=True)
  ]


def _assert_results(program: str, example: Example, timeout_s: float) -> list[bool]:
  tests = example["tests"]
  ns: dict[str, Any] = {"__builtins__": builtins, "__name__": _TESTS}
  try:
    exec(example.get("prefix", ""), ns)
    exec(example.get("setup", ""), ns)
  except Exception:  # noqa: BLE001  a broken trusted prefix or setup fails every test
    return [False] * len(tests)
  classes = {k: v for k, v in ns.items() if isinstance(v, type) and v.__module__ == _TESTS}
  passed = []
  with isolation.Session(
    program, setup=example.get("setup", ""), classes=classes, timeout_s=timeout_s
  ) as prog:
    for name in example["entry_points"]:
      ns[name] = prog.remote(name)
    for src in tests:
      try:
        exec(src, ns)
        passed.append(True)
      except Exception:  # noqa: BLE001  a failed assert, or an error in a call
        if prog.timed_out:
          raise TimeoutError("the program ran past its time") from None
        passed.append(False)
  return passed
