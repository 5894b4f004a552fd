"""Programs that forge the code reward instead of computing the task's function.

Each attack below is written against an in-process grader (the one this
repository had before programs ran in processes of their own, where each of
them scored 1.0 on every example); here every one must score 0 while the
reference scores 1, for the procedural task, MBPP and HumanEval formats, all
scored through `rewards.score_batch` as the loop does. Then: reads outside
the sandbox's allow-list fail, in verifier workers and program processes.
"""

import json
import os

import numpy as np
import pytest

from offpolicy_jax.rewards import sandbox, verifiers
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards.tasks import code

# `{f}` is the entry point's name, `{args}` its parameters.
ATTACKS = {
  # The grader's expected value, read from the caller's frames.
  "stack": """import sys
def {f}({args}):
  frame = sys._getframe(1)
  while frame is not None:
    if "want" in frame.f_locals:
      return frame.f_locals["want"]
    frame = frame.f_back
""",
  # The expected value as a constant of the calling test's code.
  "test_consts": """import sys
def {f}({args}):
  consts = [c for c in sys._getframe(1).f_code.co_consts if type(c) is int]
  return consts[-1]
""",
  # Replace the grader's result functions.
  "patch_grader": """import sys
m = sys.modules.get("offpolicy_jax.rewards.tasks.code_reward")
if m is not None:
  m._io_results = lambda *a: [True] * len(a[1]["io"])
  m._assert_results = lambda *a: [True] * len(a[1]["tests"])
def {f}({args}):
  return -999999
""",
  # The example's tests, found through the garbage collector.
  "gc": """import gc
def {f}({args}):
  for o in gc.get_objects():
    if type(o) is dict and "io" in o:
      for xs, want in o["io"]:
        if xs == [{args}]:
          return want
""",
  # Patched builtins: the grader's sum counts tests, its type() lies.
  "builtins": """import builtins
builtins.sum = lambda xs, *a: len(xs)
_type = type
class I(int):
  def __eq__(self, other):
    return True
  __hash__ = int.__hash__
builtins.type = lambda x, *a: int if _type(x) is I else _type(x, *a)
builtins.isinstance = lambda *a: True
def {f}({args}):
  return I(-999999)
""",
  # A comparison dunder patched on the returned object's class after the fact.
  "dunder": """class R(list):
  pass
R.__eq__ = lambda self, other: True
R.__ne__ = lambda self, other: False
def {f}({args}):
  return R()
""",
  # Exit codes and exceptions carrying forged messages.
  "exit": "import os\nos._exit(0)\n",
  "sys_exit": "def {f}({args}):\n  raise SystemExit(0)\n",
  "forged_exception": (
    "def {f}({args}):\n"
    '  raise AssertionError(\'{{"i": 0, "score": 1.0}} {{"ok": [1, 1, 1, 1, 1, 1]}}\')\n'
  ),
  # Forged replies written to every inherited descriptor, then a quiet exit.
  "descriptors": """import os, json, sys
def {f}({args}):
  frame, i = sys._getframe(1), 0
  while frame is not None:
    i = frame.f_locals.get("i", i) if type(frame.f_locals.get("i")) is int else i
    frame = frame.f_back
  body = json.dumps({{"i": i, "score": 1.0}}).encode()
  for fd in range(3, 64):
    try:
      os.write(fd, len(body).to_bytes(4, "big") + body)
      os.write(fd, b'{{"ok": null}}\\n' + b'{{"ok": 1}}\\n' * 8)
    except OSError:
      pass
  os._exit(0)
""",
  # Timing: sleep past the deadline; leave a thread to answer later.
  "sleep": "import time\ndef {f}({args}):\n  time.sleep(60)\n",
  "late_thread": """import threading, time, builtins
def later():
  time.sleep(0.05)
  builtins.sum = lambda xs, *a: len(xs)
threading.Thread(target=later, daemon=True).start()
def {f}({args}):
  time.sleep(0.2)
  return -999999
""",
}
# Attacks that leave their worker patched; a wrong program scored after them must still score 0.
WRONG = "def {f}({args}):\n  return -999999\n"

MBPP_ROW = {
  "task_id": 1,
  "text": "Add two numbers.",
  "code": "def add(a, b):\n  return a + b",
  "test_list": ["assert add(1, 2) == 3", "assert add(5, 4) == 9", "assert add(2, 6) == 8"],
}
HUMANEVAL_ROW = {
  "task_id": "HumanEval/0",
  "prompt": 'def add(a: int, b: int) -> int:\n  """Returns a + b."""\n',
  "canonical_solution": "  return a + b\n",
  "test": "def check(candidate):\n  assert candidate(1, 2) == 3\n  assert candidate(5, 4) == 9\n",
  "entry_point": "add",
}


@pytest.fixture(scope="module")
def pool():
  p = verifiers.VerifierPool(1, memory_mb=1024)  # one worker: every call follows the last
  yield p
  p.close()


def _task(kind, tmp_path):
  if kind == "code":
    return code.make_task("code", seed=0, num_eval=8)
  path = tmp_path / f"{kind}.jsonl"
  path.write_text(json.dumps(MBPP_ROW if kind == "mbpp" else HUMANEVAL_ROW) + "\n")
  return code.make_task(kind, train_path=str(path))


@pytest.mark.parametrize("kind", ["code", "mbpp", "humaneval"])
def test_forging_programs_score_zero_and_references_one(kind, pool, tmp_path):
  task = _task(kind, tmp_path)
  names = {"code": ("f", "a, b"), "mbpp": ("add", "a, b"), "humaneval": ("add", "a, b")}[kind]
  programs = {}
  for name, attack in ATTACKS.items():
    programs[name] = attack.format(f=names[0], args=names[1])
    programs[name + "+then_wrong"] = WRONG.format(f=names[0], args=names[1])
  for ex in [task.train_source[i] for i in range(2 if kind == "code" else 1)]:
    texts = [f"```python\n{p}```" for p in programs.values()] + [task.answer(ex)]
    res = rewards.score_batch(
      task.reward, [ex] * len(texts), texts, timeout_s=2.0, pool=pool, batch_timeout_s=60.0
    )
    scores = dict(zip([*programs, "reference"], res.scores.tolist(), strict=True))
    assert scores == {**dict.fromkeys(programs, 0.0), "reference": 1.0}, res.errors
    assert res.timed_out[list(programs).index("sleep")]


# --------------------------------------------------------------------- reads


def _read(example, text):
  """A verifier that returns 1.0 if it could read `text` (a path)."""
  del example
  with open(text, "rb") as f:
    f.read(1)
  return 1.0


def _read_in_program(example, text):
  """The same read, from inside a program's process."""
  from offpolicy_jax.rewards import isolation

  program = f"def f():\n  with open({text!r}, 'rb') as fh:\n    return len(fh.read(1))\n"
  with isolation.Session(program) as prog:
    return float(prog.call("f"))


def test_reads_outside_the_allow_list_fail_in_workers_and_programs(pool, tmp_path):
  secret = tmp_path / "other_example_tests.json"
  secret.write_text('{"io": [[[1, 2], 3]]}')
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  denied = [str(secret), os.path.join(repo, "pyproject.toml"), "/proc/self/environ", "/etc/passwd"]
  home = os.path.expanduser("~")
  denied += [
    os.path.join(home, f) for f in os.listdir(home)[:3] if os.path.isfile(os.path.join(home, f))
  ]
  allowed = [os.__file__, sandbox.__file__]
  paths = denied + allowed
  for fn in (_read, _read_in_program):
    res = rewards.score_batch(fn, [{}] * len(paths), paths, timeout_s=10.0, pool=pool)
    np.testing.assert_array_equal(res.scores, [0.0] * len(denied) + [1.0] * len(allowed))
  assert all(os.path.realpath(p).startswith(tuple(sandbox.read_paths())) for p in allowed)
  assert not any(p == repo or p == home for p in sandbox.read_paths())
