"""Tests for tasks.code, code_data and code_reward (only trusted or harmless programs are run)."""

import json
import os
import pickle
import re

import pytest

from offpolicy_jax.models.tokenizers import CharTokenizer
from offpolicy_jax.rewards import isolation_wire
from offpolicy_jax.rewards.tasks import code, code_reward

TOK = CharTokenizer()

# Hand-computed: shown f(2,3)=5 f(4,1)=5; hidden calls and outputs of a+b.
IO_EX = {
  "prompt": "f(2,3)=5 f(4,1)=5\n",
  "answer": "def f(a,b):return a+b",
  "entry_point": "f",
  "io": [[[0, 7], 7], [[1, 1], 2], [[3, 3], 6], [[9, 0], 9]],
}

MBPP = [
  {
    "task_id": 1,
    "text": "Write a function to add two numbers.",
    "code": "def add(a, b):\r\n  return a + b",
    "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
    "test_setup_code": "",
  },
  {
    "task_id": 2,
    "text": "Find the area of a circle.",
    "code": "import math\nimport re\ndef area(r):\n  return math.pi * r * r",
    "test_list": ["assert math.isclose(area(1), 3.14159, rel_tol=1e-3)", "assert area(0) == 0"],
  },
  {
    "task_id": 3,
    "text": "Count the nodes of a linked list.",
    "code": "def length(n):\n  return 0 if n is None else 1 + length(n.nxt)",
    "test_list": [
      "assert length(lst) == 3",
      "assert length(None) == 0",
      "assert [length(Node(k)) for k in range(2)] == [1, 1]",
    ],
    "test_setup_code": (
      "class Node:\n  def __init__(self, v, nxt=None):\n    self.v = v\n    self.nxt = nxt\n"
      "lst = Node(1, Node(2, Node(3)))"
    ),
  },
  {
    "task_id": 4,
    "text": "Make a pair.",
    "code": "class Pair:\n  def __init__(self, a, b):\n    self.a, self.b = a, b\n"
    "def first(p):\n  return p.a",
    "test_list": ["assert first(Pair(3, 4)) == 3"],
  },
]

HUMANEVAL = [
  {
    "task_id": "HumanEval/0",
    "prompt": 'def double(x: int) -> int:\n  """Returns 2 * x."""\n',
    "canonical_solution": "  return helper(x) * 2\n",
    "test": "def check(candidate):\n  assert candidate(2) == 4\n  assert candidate(-1) == -2\n",
    "entry_point": "double",
  },
]
HUMANEVAL[0]["prompt"] = "def helper(x):\n  return x\n\n\n" + HUMANEVAL[0]["prompt"]

FAKE_EQ = "class E:\n  def __eq__(self, other):\n    return True\n  __hash__ = None\n"


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_procedural_references_score_one_and_fit_the_char_vocab():
  task = code.make_task("code", seed=1, num_eval=64)
  train = [task.train_source[i] for i in range(400)]
  evals = [task.eval_source[i] for i in range(len(task.eval_source))]
  assert len(evals) == 64
  assert {ex["answer"] for ex in train} == {code._PROGRAM.format(e) for e, _ in code._TEMPLATES}
  for ex in train + evals:
    assert task.reward(ex, task.answer(ex)) == 1.0
    assert len(ex["io"]) == 6 and ex["prompt"].endswith("\n")
    assert len(task.prompt(ex)) <= 40 and len(task.answer(ex)) <= task.max_answer_len <= 40
    TOK.encode(task.prompt(ex) + task.answer(ex))  # raises on a character outside the vocab
    assert all(type(y) is int for _, y in ex["io"])
  assert not task.use_chat_template and task.device_reward is None


def test_procedural_prompts_identify_the_hidden_function():
  task = code.make_task("code", seed=2, num_eval=8)
  for i in range(200):
    ex = task.train_source[i]
    shown = [tuple(map(int, m)) for m in re.findall(r"f\((\d+),(\d+)\)=(-?\d+)", ex["prompt"])]
    assert len(shown) == 3 and len({(a, b) for a, b, _ in shown}) == 3
    hidden = {tuple(args) for args, _ in ex["io"]}
    assert len(hidden) == 6 and not hidden & {(a, b) for a, b, _ in shown}
    fits = [e for e, fn in code._TEMPLATES if all(fn(a, b) == y for a, b, y in shown)]
    assert [code._PROGRAM.format(e) for e in fits] == [ex["answer"]]


def test_procedural_distractor_is_the_other_template_that_fits_most_shown_calls():
  task = code.make_task("code", seed=2, num_eval=8)
  assert pickle.loads(pickle.dumps(task.distractor)) is task.distractor
  # f(5,8)=6 f(8,1)=4 f(4,7)=5 is (a+b)//2; a//(b+1) fits f(8,1)=4 only, the most of the others.
  ex = {"prompt": "f(5,8)=6 f(8,1)=4 f(4,7)=5\n", "answer": "def f(a,b):return (a+b)//2"}
  assert task.distractor(ex) == "def f(a,b):return a//(b+1)"
  for i in range(200):
    ex = task.train_source[i]
    wrong = task.distractor(ex)
    shown = [tuple(map(int, m)) for m in re.findall(r"f\((\d+),(\d+)\)=(-?\d+)", ex["prompt"])]
    fits = {
      code._PROGRAM.format(e): sum(fn(a, b) == y for a, b, y in shown) for e, fn in code._TEMPLATES
    }
    assert wrong != ex["answer"] and wrong in fits
    assert fits[wrong] == max(n for p, n in fits.items() if p != ex["answer"]) < len(shown)


def test_procedural_determinism_and_heldout_split():
  task = code.make_task("code", seed=3, num_eval=64)
  again = code.make_task("code", seed=3, num_eval=64)
  train = [task.train_source[i] for i in range(500)]
  assert train == [again.train_source[i] for i in range(500)]
  other = code.make_task("code", seed=4, num_eval=8)
  assert train != [other.train_source[i] for i in range(500)]
  eval_prompts = {task.eval_source[i]["prompt"] for i in range(len(task.eval_source))}
  assert len(eval_prompts) == 64
  assert not eval_prompts & {ex["prompt"] for ex in train}


def test_io_reward_golden():
  r = lambda text, partial=True: code_reward.program_reward(IO_EX, text, partial_credit=partial)
  assert r("def f(a,b):return a+b") == 1.0
  # a*b+1 on (0,7) (1,1) (3,3) (9,0): 1 2 10 1 against 7 2 6 9.
  assert r("def f(a,b):return a*b+1") == 0.25
  assert r("def f(a,b):return a*b+1", partial=False) == 0.0
  assert r("def f(a,b):return 7//a") == 0.0  # raises on the first call, wrong on the rest
  assert r("def f(a,b):return a+b+0//b") == 0.75  # raises on (9,0) only
  assert r("```python\ndef f(a, b):\n  return a + b\n```") == 1.0
  assert r("<answer>def f(a,b):return a+b</answer>") == 1.0


@pytest.mark.parametrize(
  "text",
  [
    "def f(a,b) return a+b",  # syntax error
    "def g(a,b):return a+b",  # no f
    "f = 5",  # f not callable
    "def f(a,b):return a+b\nraise ValueError",  # raises while running
    "def f(a,b):return a+b\nexit()",  # SystemExit
    "def f(a,b):return float(a+b)",  # right value, wrong type
    "def f(a,b):return str(a+b)",
    "def f(a,b):return [a+b]",
    FAKE_EQ + "def f(a,b):return E()",  # __eq__ always True
    "class I(int):\n  def __eq__(self, other):\n    return True\ndef f(a,b):return I(a+b)",
    "",
  ],
)
def test_io_reward_zero(text):
  assert code_reward.program_reward(IO_EX, text) == 0.0


def test_extract_program():
  assert code_reward.extract_program("no fences") == "no fences"
  assert code_reward.extract_program("x <answer>a=1</answer> <answer>b=2</answer>") == "b=2"
  text = "```python\nA\n```\ntext\n```\nB\n```\n```bash\nls\n```\n<answer>C</answer>"
  assert code_reward.extract_program(text) == "B\n"
  assert code_reward.extract_program("```py\nx = 1\ny = 2\n```") == "x = 1\ny = 2\n"
  assert code_reward.extract_program("<answer>```python\nD\n```</answer>") == "D\n"
  assert code_reward.extract_program("```text\nE\n```") == "```text\nE\n```"
  assert code_reward.extract_program("Code: ```python\nF\n```, done.") == "F\n"
  assert code_reward.extract_program("```python\nunclosed") == "```python\nunclosed"


def test_mbpp_references_wrong_programs_and_fake_equality(tmp_path):
  task = code.make_task("mbpp", train_path=_jsonl(tmp_path / "m.jsonl", MBPP))
  exs = [task.train_source[i] for i in range(len(MBPP))]
  assert task.use_chat_template and "```python" in task.prompt(exs[0])
  assert exs[0]["entry_points"] == ["add"] and exs[1]["entry_points"] == ["area"]
  assert exs[1]["setup"] == "import math\n"  # the reference's imports the tests use
  assert exs[2]["entry_points"] == ["length"] and exs[3]["entry_points"] == ["Pair", "first"]
  for ex in exs:
    assert task.reward(ex, task.answer(ex)) == 1.0
    assert len(task.answer(ex).encode()) <= task.max_answer_len
  add = exs[0]
  assert task.reward(add, "def add(a, b):\n  return a - b") == pytest.approx(1 / 3)
  no_partial = code.make_task(
    "mbpp", train_path=_jsonl(tmp_path / "m.jsonl", MBPP), partial_credit=False
  )
  assert no_partial.reward(add, "def add(a, b):\n  return a - b") == 0.0
  assert task.reward(add, "def add(a, b) return a") == 0.0
  assert task.reward(add, "def plus(a, b):\n  return a + b") == 0.0
  assert task.reward(add, "raise RuntimeError\ndef add(a, b):\n  return a + b") == 0.0
  assert task.reward(add, FAKE_EQ + "def add(a, b):\n  return E()") == 0.0
  assert task.reward(add, FAKE_EQ + "class add(E):\n  def __init__(self, a, b):\n    pass") == 0.0
  # Names the tests use but the program does not define come from trusted code only.
  math_hack = "class M:\n  def isclose(self, *a, **k):\n    return True\nmath = M()\n"
  assert task.reward(exs[1], math_hack + "def area(r):\n  return 0") == 0.5  # area(0) == 0
  assert task.reward(exs[2], "def length(n):\n  return 3") == pytest.approx(1 / 3)


def test_values_cross_as_data_of_exact_types():
  ns = {}
  exec("class Node:\n  def __eq__(self, o):\n    return vars(self) == vars(o)\n" + FAKE_EQ, ns)
  node = ns["Node"]()
  node.v, node.nxt = 1, None
  value = [1, True, 2.5, "s", None, (1, [2]), {3: {4}}, frozenset({5}), b"\xff", 1j, range(3), node]
  data = json.loads(json.dumps(isolation_wire.encode(value, {ns["Node"]: "Node"}, _refuse)))
  back = isolation_wire.decode(data, {"Node": ns["Node"]}, _refuse)
  assert back == value and [type(v) for v in back] == [type(v) for v in value]
  assert isolation_wire.encode(ns["E"](), {}, lambda v: {"handle": 7}) == {"handle": 7}
  for bad in ({"eval": "1"}, {"tuple": 1}, {"object": "E", "attrs": {"dict": []}}, {}, {"a": 1}):
    with pytest.raises(ValueError):
      isolation_wire.decode(bad, {"Node": ns["Node"]}, _refuse)
  deep = []
  for _ in range(isolation_wire.MAX_DEPTH + 1):
    deep = [deep]
  with pytest.raises(ValueError, match="deeper"):
    isolation_wire.decode(deep, {}, _refuse)


def _refuse(value):
  raise AssertionError(f"unexpected handle for {value!r}")


def test_humaneval_reference_and_wrong_programs(tmp_path):
  task = code.make_task("humaneval", train_path=_jsonl(tmp_path / "h.jsonl", HUMANEVAL))
  ex = task.train_source[0]
  assert ex["tests"][-1].endswith("check(double)\n") and ex["entry_points"] == ["double"]
  assert task.reward(ex, task.answer(ex)) == 1.0
  assert task.reward(ex, "```python\n  return x + x\n```") == 1.0  # body only, after the prompt
  assert task.reward(ex, "```python\ndef double(x):\n  return helper(x) + 2\n```") == 0.0
  assert task.reward(ex, "```python\ndef triple(x):\n  return 3 * x\n```") == 0.0
  assert task.reward(ex, "```python\n" + FAKE_EQ + "def double(x):\n  return E()\n```") == 0.0


def test_reward_and_examples_pickle(tmp_path):
  mbpp = code.make_task("mbpp", train_path=_jsonl(tmp_path / "m.jsonl", MBPP))
  for task in (code.make_task("code", num_eval=4), mbpp):
    ex = task.eval_source[0]
    reward = pickle.loads(pickle.dumps(task.reward))
    ex2 = pickle.loads(pickle.dumps(ex))
    assert ex2 == ex and reward(ex2, task.answer(ex)) == 1.0
    assert pickle.loads(pickle.dumps(task.prompt))(ex) == task.prompt(ex)


@pytest.mark.parametrize(
  "kind,row,message",
  [
    ("mbpp", {"text": "t", "code": "x", "test_list": []}, "test_list"),
    ("mbpp", {"text": "t", "code": "x", "test_list": ["assert f(1) =="]}, "test_list\\[0\\]"),
    ("mbpp", {"text": "t", "code": 5, "test_list": ["assert f(1)"]}, "'code'"),
    ("mbpp", {"text": "t", "code": "def f(:", "test_list": ["assert f(1)"]}, "'code'"),
    ("mbpp", {"text": "t", "code": "x", "test_list": ["assert len('')"]}, "uses no name"),
    ("humaneval", {**HUMANEVAL[0], "entry_point": "not ok"}, "entry_point"),
    ("humaneval", {**HUMANEVAL[0], "test": "def chek(c):\n  pass\n"}, "check"),
    ("humaneval", {k: v for k, v in HUMANEVAL[0].items() if k != "prompt"}, "'prompt'"),
  ],
)
def test_malformed_rows_name_file_and_row(tmp_path, kind, row, message):
  good = MBPP[0] if kind == "mbpp" else HUMANEVAL[0]
  path = _jsonl(tmp_path / "bad.jsonl", [good, row])
  with pytest.raises(ValueError, match=rf"bad\.jsonl: row 2: malformed {kind} row: .*{message}"):
    code.make_task(kind, train_path=path)


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="unknown code task"):
    code.make_task("cobol")
  with pytest.raises(ValueError, match="needs train_path"):
    code.make_task("mbpp")
  with pytest.raises(ValueError, match="data file not found"):
    code.make_task("humaneval", train_path=str(tmp_path / "missing.jsonl"))
  with pytest.raises(ValueError, match="no train_path"):
    code.make_task("code", train_path="x.jsonl")
  with pytest.raises(ValueError, match="distinct argument pairs"):
    code.make_task("code", max_value=1, num_shown=2, num_hidden=3)
  (tmp_path / "broken.jsonl").write_text(json.dumps(MBPP[0]) + "\n{not json\n")
  with pytest.raises(ValueError, match="broken.jsonl: row 2: invalid JSON"):
    code.make_task("mbpp", train_path=str(tmp_path / "broken.jsonl"))


# ------------------------------------------------------- hostile programs, sandboxed

_GOOD = "def f(a,b):return a+b"
_HOSTILE = {
  "loop": "def f(a,b):\n  while True:\n    pass",
  "fork": "import os\nos.fork()\n" + _GOOD,
  "subprocess": "import subprocess\nsubprocess.run(['touch', {path!r}])\n" + _GOOD,
  "memory": "x = bytearray(100 * 2**30)\n" + _GOOD,
  "write": "open({path!r}, 'w').write('x')\n" + _GOOD,
  "remove": "import os\nos.remove({keep!r})\n" + _GOOD,
  "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n" + _GOOD,
  "signal": "import os, signal\nos.kill({pid}, signal.SIGCONT)\n" + _GOOD,
  "exit": "import os\nos._exit(0)",
}


def test_hostile_programs_score_zero_in_the_sandbox_and_the_run_goes_on(tmp_path):
  import socket

  from offpolicy_jax.rewards import scoring as rewards
  from offpolicy_jax.rewards import tasks

  task = tasks.get_task("code")
  ex = {"prompt": "", "answer": _GOOD, "entry_point": "f", "io": [[[1, 2], 3], [[4, 4], 8]]}
  keep = tmp_path / "keep"
  keep.write_text("data")
  server = socket.create_server(("127.0.0.1", 0))
  server.settimeout(0.5)
  fields = {
    "path": str(tmp_path / "pwned"),
    "keep": str(keep),
    "port": server.getsockname()[1],
    "pid": os.getpid(),
  }
  texts = [p.format(**fields) for p in _HOSTILE.values()] + [_GOOD]
  res = rewards.score_batch(task.reward, [ex] * len(texts), texts, timeout_s=3.0)
  scores = dict(zip([*_HOSTILE, "good"], res.scores.tolist(), strict=True))
  assert scores == {**dict.fromkeys(_HOSTILE, 0.0), "good": 1.0}
  assert res.timed_out[list(_HOSTILE).index("loop")]
  assert sorted(os.listdir(tmp_path)) == ["keep"] and keep.read_text() == "data"
  with pytest.raises(TimeoutError):
    server.accept()
  server.close()
  again = rewards.score_batch(task.reward, [ex], [_GOOD], timeout_s=3.0)
  assert again.scores.tolist() == [1.0] and not again.failed.any()
  assert task.reward(ex, _GOOD) == 1.0  # a direct call runs in a worker too
