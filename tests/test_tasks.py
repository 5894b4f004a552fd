"""Tests for offpolicy_jax.tasks and offpolicy_jax.rewards."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from offpolicy_jax.models.tokenizers import CharTokenizer
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards import tasks
from offpolicy_jax.rewards.tasks import synthetic

TOK = CharTokenizer()


# ----------------------------------------------------------------- synthetic


@pytest.mark.parametrize("name", ["add", "reverse", "copy", "sort"])
def test_synthetic_answers_determinism_and_heldout(name):
  task = tasks.get_task(name, seed=3, num_eval=64)
  again = tasks.get_task(name, seed=3, num_eval=64)
  other = tasks.get_task(name, seed=4, num_eval=64)
  train = [task.train_source[i] for i in range(300)]
  assert train == [again.train_source[i] for i in range(300)]
  assert train != [other.train_source[i] for i in range(300)]
  assert len(task.eval_source) == 64
  eval_prompts = {task.eval_source[i]["prompt"] for i in range(64)}
  assert len(eval_prompts) == 64  # distinct
  assert not eval_prompts & {ex["prompt"] for ex in train}
  for ex in train[:50] + [task.eval_source[i] for i in range(10)]:
    body = ex["prompt"][:-1].split(":")[-1]
    if name == "add":
      a, b = body.split("+")
      want = str(int(a) + int(b))
    else:
      want = {"reverse": body[::-1], "copy": body, "sort": "".join(sorted(body))}[name]
    assert ex["answer"] == want and ex["prompt"].endswith("=")
    assert len(ex["answer"]) <= task.max_answer_len
    TOK.encode(ex["prompt"])  # every character is in the built-in vocab


def _responses(answer, texts, n=8):
  """Answer tokens [B, A] and responses [B, n] (text + EOS, then pad) with masks."""
  a = [*TOK.encode(answer), TOK.eos_id]
  ans = np.array([a + [-1] * 2] * len(texts), np.int32)
  tok = np.zeros((len(texts), n), np.int32)
  mask = np.zeros((len(texts), n), np.float32)
  for b, t in enumerate(texts):
    ids = ([*TOK.encode(t), TOK.eos_id] if t is not None else TOK.encode("9" * n))[:n]
    tok[b, : len(ids)] = ids
    mask[b, : len(ids)] = 1.0
  return ans, tok, mask


def test_device_reward_golden():
  texts = ["123", "124", "1234", "12", "", "321", None]  # None: no EOS at all
  ans, tok, mask = _responses("123", texts)
  exact = np.asarray(synthetic.device_reward(ans, tok, mask))
  np.testing.assert_array_equal(exact, [1, 0, 0, 0, 0, 0, 0])
  partial = np.asarray(synthetic.device_reward(ans, tok, mask, partial_credit=True))
  # positions: '1','2','3',EOS
  np.testing.assert_allclose(partial, [1, 0.75, 0.75, 0.5, 0, 0.5, 0])
  # Masked-out tokens never count, even if they hold the right ids.
  np.testing.assert_array_equal(synthetic.device_reward(ans[:1], tok[:1], mask[:1] * 0), [0])
  # Response shorter than the answer.
  np.testing.assert_array_equal(synthetic.device_reward(ans[:1], tok[:1, :2], mask[:1, :2]), [0])
  jitted = jax.jit(lambda a, t, m: synthetic.device_reward(a, t, m, True))
  np.testing.assert_allclose(jitted(ans, tok, mask), partial)


def test_host_reward_matches_device_reward():
  task = tasks.get_task("reverse")
  task_p = tasks.get_task("reverse", partial_credit=True)
  texts = ["123", "124", "1234", "12", "", "321", "3"]
  ans, tok, mask = _responses("123", texts)
  ex = {"prompt": "rev:321=", "answer": "123"}
  host = [task.reward(ex, TOK.decode(t)) for t in tok]
  np.testing.assert_array_equal(host, task.device_reward(ans, tok, mask))
  host_p = [task_p.reward(ex, TOK.decode(t)) for t in tok]
  np.testing.assert_allclose(host_p, task_p.device_reward(ans, tok, mask), atol=1e-6)


def test_get_task_errors():
  with pytest.raises(ValueError, match="nope"):
    tasks.get_task("nope")
  with pytest.raises(ValueError, match="bogus_kwarg"):
    tasks.get_task("add", bogus_kwarg=1)
  with pytest.raises(ValueError, match="max_len"):
    tasks.get_task("reverse", min_len=4, max_len=2)
  assert {"add", "reverse", "copy", "sort", "gsm8k", "math"} <= set(tasks.task_names())
  with pytest.raises(ValueError, match="taken"):
    tasks.register("add", lambda: None)


_ECHO = tasks.ListSource([{"q": "x", "a": "y"}])


def _echo_task(suffix=""):
  """A module-level factory whose reward is a closure (rebuilt in the verifier worker)."""
  return tasks.Task(
    name="echo" + suffix,
    train_source=_ECHO,
    eval_source=_ECHO,
    prompt=lambda ex: ex["q"],
    reward=lambda ex, text: float(text == ex["a"] + suffix),
  )


def test_register_custom_task():
  tasks.register("test_echo", _echo_task)
  task = tasks.get_task("test_echo", suffix="!")
  assert task.name == "echo!" and "test_echo" in tasks.task_names()
  assert isinstance(task.reward, rewards.SandboxedReward)
  assert task.reward(_ECHO[0], "y!") == 1.0 and task.device_reward is None
  assert task.reward(_ECHO[0], "y") == 0.0


def test_custom_reward_that_cannot_reach_a_worker_names_the_task():
  tasks.register("test_notebook_echo", lambda: _echo_task())  # a lambda factory: not importable
  task = tasks.get_task("test_notebook_echo")
  with pytest.raises(ValueError, match="test_notebook_echo.*cannot run in a sandboxed"):
    rewards.get_pool().check(task.reward, "test_notebook_echo")


# ------------------------------------------------------------ reasoning gym


def test_reasoning_gym_task():
  task = tasks.get_task("reasoning_gym:basic_arithmetic", seed=1, train_size=6, eval_size=3)
  assert task.name == "reasoning_gym:basic_arithmetic" and task.use_chat_template
  assert len(task.train_source) == 6 and len(task.eval_source) == 3
  ex = task.train_source[0]
  assert ex["question"] in task.prompt(ex) and "<answer>" in task.prompt(ex)
  assert task.reward(ex, f"<think>easy</think><answer>{ex['answer']}</answer>") == 1.0
  assert task.reward(ex, ex["answer"]) == 1.0  # no tags: the whole response
  assert task.reward(ex, "<answer>not a number</answer>") == 0.0
  with pytest.raises(ValueError, match="no_such_dataset"):
    tasks.get_task("reasoning_gym:no_such_dataset", train_size=2, eval_size=2)
  assert task.answer(ex) == str(ex["answer"]) and task.max_answer_len >= len(str(ex["answer"]))


def test_reasoning_gym_task_with_a_compact_prompt_for_the_character_tokenizer():
  """spell_backward's word alone, raw after BOS: a prompt and answers the char tokenizer reads."""
  task = tasks.get_task(
    "reasoning_gym:spell_backward",
    train_size=20,
    eval_size=5,
    prompt_format="{metadata[word]}",
    instruction="",
    chat=False,
    distractor_format="{metadata[word]}",
    lowercase=True,  # some words are names; the verifier ignores case
  )
  assert not task.use_chat_template
  for ex in (task.train_source[i] for i in range(20)):
    word = ex["metadata"]["word"].lower()
    assert task.prompt(ex) == word and task.answer(ex) == word[::-1] == ex["answer"].lower()
    assert task.distractor(ex) == word
    assert len(task.answer(ex)) <= task.max_answer_len
    assert TOK.decode(TOK.encode(task.prompt(ex) + task.answer(ex))) == word + word[::-1]
  assert task.reward(ex, task.answer(ex)) == 1.0
  assert task.reward(ex, task.distractor(ex)) < 1.0
  with pytest.raises(ValueError, match=r"prompt_format: '\{metadata\[nope\]\}' does not fit"):
    tasks.get_task(
      "reasoning_gym:spell_backward", train_size=2, eval_size=2, prompt_format="{metadata[nope]}"
    )


# --------------------------------------------------------------- gsm8k/math

GSM = [
  {"question": "Tom has 3 apples and buys 15. How many?", "answer": "3+15=18\n#### 18"},
  {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
]
MATH = [
  {"problem": "Half of one?", "answer": None, "solution": "It is $\\boxed{\\frac{1}{2}}$."},
  {"problem": "2+2?", "answer": "4", "solution": "no box here"},
]


def _jsonl(path, rows):
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  return str(path)


def test_gsm8k_jsonl_and_reward(tmp_path):
  task = tasks.get_task("gsm8k", train_path=_jsonl(tmp_path / "g.jsonl", GSM))
  ex = task.train_source[0]
  assert ex["gold"] == "18" and task.train_source[1]["gold"] == "1234"
  assert "<think>" in task.prompt(ex) and ex["question"] in task.prompt(ex)
  r = task.reward
  assert r(ex, "<think>3+15</think><answer>18</answer>") == pytest.approx(1.1)
  assert r(ex, "<think>3+15</think>\n<answer>$18$</answer>\n") == pytest.approx(1.1)
  assert r(ex, "The answer is 18") == pytest.approx(0.9)
  assert r(ex, "<think>hm</think><answer>17</answer>") == pytest.approx(0.1)
  assert r(ex, "no idea") == pytest.approx(-0.1)
  ex2 = task.train_source[1]
  assert r(ex2, "<think>x</think><answer>1234</answer>") == pytest.approx(1.1)


def _rss(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
  except (FileNotFoundError, StopIteration):
    return 0


def test_pathological_math_answer_scores_zero_within_the_timeout(tmp_path):
  task = tasks.get_task("gsm8k", train_path=_jsonl(tmp_path / "g.jsonl", GSM))
  ex = task.train_source[0]
  texts = ["<answer>(2**2**2**2**2**2)</answer>", "<think>a</think><answer>18</answer>"]
  pool = rewards.get_pool()
  rewards.score_batch(task.reward, [ex], texts[1:], timeout_s=3.0)  # warm the workers
  # The trainer's own RSS depends on what ran before in this process: bound its
  # growth, and the workers' total (each is capped at reward_memory_mb of address space).
  base, peak, done = _rss(os.getpid()), [0, 0], threading.Event()

  def watch():
    while not done.is_set():
      peak[0] = max(peak[0], _rss(os.getpid()) - base)
      peak[1] = max(peak[1], sum(_rss(p) for p in pool.pids()))
      time.sleep(0.02)

  watcher = threading.Thread(target=watch)
  watcher.start()
  start = time.monotonic()
  res = rewards.score_batch(task.reward, [ex] * 2, texts, timeout_s=3.0)
  elapsed = time.monotonic() - start
  done.set()
  watcher.join()
  assert res.scores.tolist() == pytest.approx([0.0, 1.1]) and res.failed.tolist() == [True, False]
  assert elapsed < 3.0 + 2.0 and peak[0] < 2**29 and peak[1] < 3 * 2**30


def test_math_parquet_and_reward(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  path = str(tmp_path / "m.parquet")
  pq.write_table(pa.Table.from_pylist(MATH), path)
  task = tasks.get_task("math", train_path=path, eval_path=path)
  ex = task.eval_source[0]
  assert ex["gold"] == "\\frac{1}{2}" and task.eval_source[1]["gold"] == "4"
  assert task.reward(ex, "<think>x</think><answer>\\frac{1}{2}</answer>") == pytest.approx(1.1)
  assert task.reward(ex, "<think>x</think><answer>0.5</answer>") == pytest.approx(1.1)
  assert task.reward(ex, "<think>x</think><answer>\\frac{1}{3}</answer>") == pytest.approx(0.1)


def test_model_output_is_parsed_never_evaluated(tmp_path):
  task = tasks.get_task("gsm8k", train_path=_jsonl(tmp_path / "g.jsonl", GSM))
  marker = tmp_path / "pwned"
  text = f"<answer>__import__('os').system('touch {marker}')</answer>"
  assert task.reward(task.train_source[0], text) == pytest.approx(-0.1)
  assert not marker.exists()


def test_data_file_errors(tmp_path):
  missing = str(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="missing.jsonl"):
    tasks.get_task("gsm8k", train_path=missing)
  bad = _jsonl(tmp_path / "bad.jsonl", [GSM[0], {"question": "q", "answer": "no marker"}])
  with pytest.raises(ValueError, match=r"bad.jsonl: row 2"):
    tasks.get_task("gsm8k", train_path=bad)
  (tmp_path / "broken.jsonl").write_text(json.dumps(MATH[0]) + "\n{not json\n")
  with pytest.raises(ValueError, match=r"broken.jsonl: row 2"):
    tasks.get_task("math", train_path=str(tmp_path / "broken.jsonl"))
  nobox = _jsonl(tmp_path / "nobox.jsonl", [{"problem": "p", "solution": "s"}])
  with pytest.raises(ValueError, match=r"nobox.jsonl: row 1.*boxed"):
    tasks.get_task("math", train_path=nobox)
  with pytest.raises(ValueError, match="train_path"):
    tasks.get_task("gsm8k")


def test_last_boxed():
  from offpolicy_jax.rewards.tasks.math_data import last_boxed

  assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
  assert last_boxed("\\fbox{7}") == "7"
  assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
