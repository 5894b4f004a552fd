"""Tests for offpolicy_jax.rewards.environments and the multi-turn tasks (tasks/agentic.py).

Environments run in real sandboxed verifier workers here, as in a run: a
misbehaving environment (hangs, raises, kills its worker, returns each kind of
garbage, acts on the host) fails its own row, counted by kind, while the
other rows of the batch return; the tasks' episodes, scripted by hand, get
the documented rewards.
"""

import functools
import gc
import json
import multiprocessing.connection
import os
import sys
import time

import numpy as np
import pytest

from offpolicy_jax.models.tokenizers import CharTokenizer
from offpolicy_jax.rewards import (
  environments,
  tasks,
  text_episodes,
  verifier_results,
  verifiers,
  worker,
)
from offpolicy_jax.rewards.environments import OBS_PREFIX, TURN_END, EnvResult, EnvRunner
from offpolicy_jax.rewards.tasks import agentic, rgym

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Misbehaving(environments.Environment):
  """An environment that does what its action says (module level, so it reaches the workers)."""

  def reset(self, example):
    return EnvResult("", 0.0, False, {"n": 0, "path": example["path"]})

  def step(self, state, action_text):
    n, path = state["n"] + 1, state["path"]
    ok = {"n": n, "path": path}
    act = action_text.strip()
    if act == "ok":
      return EnvResult(f"o{n}", 0.5, False, ok, info={"turns": n})
    if act == "done":
      return EnvResult("", 1.0, True, ok)
    if act == "numpy_reward":
      return EnvResult("o", np.float32(0.25), False, ok)
    if act == "long":
      return EnvResult("y" * 50, 0.0, False, ok)
    if act == "lines":
      return EnvResult("a\nb", 0.0, False, ok)
    if act == "hang":
      time.sleep(60)
    if act == "spin":
      while True:
        pass
    if act == "raise":
      raise RuntimeError("environment bug")
    if act == "exit":
      os._exit(3)
    if act == "write":  # outside the sandbox: must fail
      with open(os.path.join(path, "pwned"), "w") as f:
        f.write("x")
    if act == "read":  # a repository file: not on the read allow-list
      with open(os.path.join(REPO, "pyproject.toml")) as f:
        return EnvResult(f.read(10), 1.0, False, ok)
    garbage = {
      "nan": lambda: EnvResult("o", float("nan"), False, ok),
      "big_reward": lambda: EnvResult("o", 1e300, False, ok),
      "str_reward": lambda: EnvResult("o", "1", False, ok),
      "bool_reward": lambda: EnvResult("o", True, False, ok),
      "int_done": lambda: EnvResult("o", 0.0, 1, ok),
      "int_obs": lambda: EnvResult(5, 0.0, False, ok),
      "set_state": lambda: EnvResult("o", 0.0, False, {1, 2}),
      "tuple_state": lambda: EnvResult("o", 0.0, False, (1, 2)),
      "int_key_state": lambda: EnvResult("o", 0.0, False, {1: 2}),
      "object_state": lambda: EnvResult("o", 0.0, False, object()),
      "deep_state": lambda: EnvResult(
        "o", 0.0, False, functools.reduce(lambda a, _: [a], range(99), [])
      ),
      "huge_obs": lambda: EnvResult("x" * (worker.MAX_REPLY_BYTES + 1), 0.0, False, ok),
      "bad_info": lambda: EnvResult("o", 0.0, False, ok, "", {"turns": "many"}),
      "not_a_result": lambda: "hello",
      "short_tuple": lambda: ("o", 0.0),
      "bad_char": lambda: EnvResult("o\x00", 0.0, False, ok),
    }
    return garbage[act]()


def make_misbehaving():
  return Misbehaving()


@pytest.fixture(scope="module")
def pool():
  p = verifiers.VerifierPool(2, memory_mb=1024)
  yield p
  p.close()


def _runner(pool, env=None, **kw):
  kw = {"timeout_s": 1.0, "batch_timeout_s": 30.0, "max_observation_chars": 10, **kw}
  return EnvRunner(env or Misbehaving(), pool, **kw)


def test_round_trip_from_an_instance_a_factory_and_a_rebuild(pool, tmp_path):
  envs = [
    Misbehaving(),
    make_misbehaving,
    environments.RebuildEnv(make_misbehaving, {}, "misbehaving"),
  ]
  for env in envs:
    runner = _runner(pool, env)
    first = runner.reset([{"path": str(tmp_path)}] * 3)
    assert first == [EnvResult("", 0.0, False, {"n": 0, "path": str(tmp_path)})] * 3
    nxt = runner.step([r.state for r in first], ["ok\n", "numpy_reward", "done"])
    assert nxt[0] == EnvResult(
      "|o1\n", 0.5, False, {"n": 1, "path": str(tmp_path)}, "", {"turns": 1}
    )
    assert nxt[1].observation == f"{OBS_PREFIX}o{TURN_END}" and nxt[1].reward == 0.25
    assert nxt[2].observation == "" and nxt[2].done and nxt[2].reward == 1.0
    assert runner.stats()["calls"] == 6 and runner.stats()["failures"] == 0
  raw = _runner(pool, wrap=False).step([{"n": 0, "path": ""}] * 2, ["ok", "lines"])
  assert [r.observation for r in raw] == ["o1", "a\nb"]
  lines = runner.step([{"n": 0, "path": ""}], ["lines"])[0].observation
  assert lines == "|a\n|b\n" and [r for r, _ in text_episodes.split_turns(lines)] == ["env"] * 2
  assert runner.step([], []) == []
  with pytest.raises(ValueError, match="differ in length"):
    runner.step([{}], [])


def test_every_failure_is_counted_and_the_rest_of_the_batch_returns(pool, tmp_path):
  tok = CharTokenizer()
  alphabet = "".join(tok.decode([i]) for i in range(3, tok.vocab_size))
  # A call's time includes loading the environment where a worker is new (after "exit"):
  # 3 s, not 1, so that the load fits on a loaded machine; "hang" still times out.
  runner = _runner(pool, alphabet=alphabet, timeout_s=3.0)
  kinds = {
    "hang": "timeout",
    "raise": "error",
    "exit": "crashed",
    "write": "error",
    "read": "error",
    "nan": "garbage",
    "big_reward": "garbage",
    "str_reward": "garbage",
    "bool_reward": "garbage",
    "int_done": "garbage",
    "int_obs": "garbage",
    "set_state": "garbage",
    "tuple_state": "garbage",
    "int_key_state": "garbage",
    "object_state": "garbage",
    "deep_state": "garbage",
    "huge_obs": "garbage",
    "bad_info": "garbage",
    "not_a_result": "garbage",
    "short_tuple": "garbage",
    "bad_char": "garbage",
  }
  actions = [a for k in kinds for a in (k, "ok")] + ["long"]
  state = {"n": 0, "path": str(tmp_path)}
  pids = set(pool.pids())
  out = runner.step([state] * len(actions), actions)
  for action, r in zip(actions, out, strict=True):
    if action == "ok":
      assert r == EnvResult("|o1\n", 0.5, False, {**state, "n": 1}, "", {"turns": 1}), r
    elif action == "long":  # truncated to max_observation_chars, then wrapped
      assert r.observation == "|" + "y" * 10 + "\n" and not r.failure
    else:
      assert r == environments.failed(kinds[action]), (action, r)
      assert r == EnvResult("", 0.0, True, None, kinds[action])
  stats = runner.stats()
  counts = {c: list(kinds.values()).count(c) for c in verifier_results.FAILURES}
  assert stats["timeouts"] == counts["timeout"] == 1
  assert stats["errors"] == counts["error"] == 3
  assert stats["crashes"] == counts["crashed"] == 1
  assert stats["garbage"] == counts["garbage"]
  assert stats["failures"] == len(kinds) and stats["calls"] == len(actions)
  assert stats["truncated"] == 1 and stats["restarts"] == 2  # hang and exit
  assert len(pool.pids()) == 2 and set(pool.pids()) != pids
  assert not (tmp_path / "pwned").exists() and os.listdir(tmp_path) == []
  # Acting on the host fails for the sandbox's reason, not another bug of the environment.
  host = runner.step([state] * 2, ["write", "read"])
  assert [r.failure for r in host] == ["error", "error"]
  assert [e.split(": ")[1] for e in runner.errors] == ["PermissionError", "PermissionError"]
  # The pool goes on: a spinning step times out near its limit, the next batch is fine.
  start = time.monotonic()
  spun = _runner(pool, batch_timeout_s=None).step([state] * 2, ["spin", "ok"])
  assert time.monotonic() - start < 2 * 1.0 + 2.0
  assert spun[0].failure == "timeout" and spun[1].observation == "|o1\n"


def test_environments_that_cannot_reach_a_worker_fail_at_start(pool):
  class Local(Misbehaving):  # not importable in a worker
    pass

  with pytest.raises(ValueError, match="cannot run in a sandboxed verifier worker"):
    _runner(pool, Local())
  with pytest.raises(ValueError, match="not an environment"):
    _runner(pool, environments.RebuildEnv(dict, {}, "dict"))
  with pytest.raises(ValueError, match="max_observation_chars"):
    _runner(pool, max_observation_chars=0)
  with pytest.raises(ValueError, match="timeout_s"):
    _runner(pool, timeout_s=float("inf"))


def test_pool_call_returns_json_data_and_failure_kinds(pool):
  res = pool.call(_echo, [(1,), ([1, "a", None],), ({"k": 1.5},), ((1, 2),), (float("inf"),)])
  assert [o.value for o in res.outcomes[:3]] == [1, [1, "a", None], {"k": 1.5}]
  assert [o.failure for o in res.outcomes] == ["", "", "", "garbage", "garbage"]
  assert worker.is_json_data({"a": [1, 2.0, True, None, "s"]})
  assert not worker.is_json_data({"a": (1,)}) and not worker.is_json_data(float("nan"))


def _echo(x):
  return x


def _pid_after(seconds):
  time.sleep(seconds)
  return os.getpid()


def test_a_lane_has_workers_of_its_own(pool):
  """Calls inside `verifiers.lane(1)` go to lane 1's workers (a pool of the same settings),
  so two threads' batches do not queue behind each other's."""
  pids = {}

  def call(i):
    with verifiers.lane(i):
      pids[i] = {o.value for o in pool.call(_pid_after, [(0.0,), (0.0,)]).outcomes}

  call(0)
  call(1)
  assert pids[0] <= set(pool.pids()) and pids[1].isdisjoint(pool.pids())
  lane_1 = verifiers.get_pool(*pool.settings, lane=1)
  assert lane_1 is not pool and lane_1.lane == 1 and pids[1] <= set(lane_1.pids())
  with pytest.raises(ValueError, match="lane must be >= 0"):
    with verifiers.lane(-1):
      pass


def test_safe_eval_computes_integers_and_refuses_everything_else():
  ev = agentic.safe_eval
  assert ev("123*45") == 5535 and ev("100+200+300") == 600 and ev("-(2-5)*3") == 9
  assert ev(" 7 * ( 1 + 2 ) ") == 21
  refused = [
    "a+1",  # a name
    "().__class__",  # attribute access
    "__import__('os')",
    "2**10",  # powers (the alphabet has *, so ** parses)
    "9**9**9",
    "1" * 40,  # longer than max_chars
    "9" * 13,  # larger than max_abs
    "99999999*99999999",  # an intermediate value too large
    "1/2",
    "1.5",
    "",
    "(",
    "1 2",
    "0x10",
    "[1]",
  ]
  for expr in refused:
    with pytest.raises(ValueError):
      ev(expr)
  for deep in ("(" * 5000 + "1" + ")" * 5000, "-" * 20_000 + "1"):  # nesting: refused, no crash
    with pytest.raises(ValueError):
      ev(deep, max_chars=100_000)


def _play(runner, examples, turns):
  """Steps every example through the same scripted policy turns; the results of each turn."""
  res = runner.reset(examples)
  out = [res]
  for t in turns:
    res = runner.step([r.state for r in res], [t] * len(examples))
    out.append(res)
  return out


def test_guess_number_episodes_get_the_documented_rewards(pool):
  task = tasks.get_task("guess_number", hi=16, max_turns=6, turn_penalty=0.05)
  assert isinstance(task.environment, agentic.GuessNumber)  # it pickles: sent as is
  runner = EnvRunner(task.environment, pool, timeout_s=5.0, max_observation_chars=8)
  ep = _play(runner, [{"secret": 11}], ["8\n", "12\n", "x\n", "99\n", "11\n"])
  assert [r[0].observation for r in ep] == ["", "|h\n", "|l\n", "|?\n", "|?\n", ""]
  assert ep[-1][0].reward == pytest.approx(1 - 0.05 * 4) and ep[-1][0].done
  assert ep[-1][0].info == {"turns": 5, "solved": 1}
  lost = _play(runner, [{"secret": 3}], ["8"] * 6)[-1][0]
  assert lost.done and lost.reward == 0.0 and lost.info == {"turns": 6, "solved": 0}
  first = _play(runner, [{"secret": 8}], ["8"])[-1][0]
  assert first.done and first.reward == 1.0
  # Eval: every secret once; the demonstration (binary search) solves each, and its
  # observations are the environment's.
  secrets = [ex["secret"] for ex in task.eval_source]
  assert secrets == list(range(1, 17))
  texts = [task.answer(ex) for ex in task.eval_source]
  scores = [task.reward(ex, t) for ex, t in zip(task.eval_source, texts, strict=True)]
  turns = [len(task.demonstration(ex)) // 2 + 1 for ex in task.eval_source]
  np.testing.assert_allclose(scores, [1 - 0.05 * (t - 1) for t in turns], rtol=1e-6)
  assert max(turns) == 5 and max(map(len, texts)) == task.max_answer_len
  _assert_demonstration_matches_the_environment(runner, task, list(task.eval_source))


def test_calculator_episodes_get_the_documented_rewards(pool):
  task = tasks.get_task("calculator", kind="mul", max_turns=3)
  runner = EnvRunner(task.environment, pool, timeout_s=5.0, max_observation_chars=16)
  ex = {"prompt": "123*45=?\n", "expr": "123*45", "answer": "5535"}
  ep = _play(runner, [ex], ["<calc>123*45</calc>\n", "=5535\n"])
  assert [r[0].observation for r in ep] == ["", "|5535\n", ""]
  assert ep[-1][0].reward == 1.0 and ep[-1][0].info == {"tool_calls": 1, "turns": 2, "solved": 1}
  wrong = _play(runner, [ex], ["=5536"])[-1][0]
  assert wrong.done and wrong.reward == 0.0 and wrong.info["solved"] == 0
  head = _play(runner, [ex], ["=5535"])[-1][0]  # right without the tool: still right
  assert head.reward == 1.0 and head.info["tool_calls"] == 0
  bad = _play(runner, [ex], ["<calc>a+1</calc>", "<calc>2**99</calc>", "hello"])
  assert [r[0].observation for r in bad[1:3]] == ["|?\n", "|?\n"]
  assert bad[-1][0].done and bad[-1][0].reward == 0.0 and bad[-1][0].info["tool_calls"] == 2
  examples = [task.train_source[i] for i in range(8)] + list(task.eval_source)[:8]
  assert {e["prompt"] for e in examples[:8]}.isdisjoint(e["prompt"] for e in task.eval_source)
  for e in examples:
    a, b = map(int, e["expr"].split("*"))
    assert 100 <= a <= 999 and 10 <= b <= 99 and int(e["answer"]) == a * b
    assert task.reward(e, task.answer(e)) == 1.0
    assert len(task.answer(e)) <= task.max_answer_len
  _assert_demonstration_matches_the_environment(runner, task, examples)
  summed = tasks.get_task("calculator", kind="sum", num_terms=4).train_source[0]
  assert len(summed["expr"].split("+")) == 4 and agentic.safe_eval(summed["expr"]) == int(
    summed["answer"]
  )


def test_calculator_tool_latency_is_log_normal_cut_at_its_maximum_and_checked(pool):
  lat = agentic.ToolLatency(median_s=0.2, sigma=1.0, max_s=2.0)
  rng = np.random.default_rng(0)
  draws = np.array([lat.draw(rng) for _ in range(20000)])
  assert np.median(draws) == pytest.approx(0.2, rel=0.05)
  assert np.quantile(draws, 0.9) == pytest.approx(0.2 * np.exp(1.2816), rel=0.05)
  assert draws.max() == 2.0 and np.mean(draws == 2.0) == pytest.approx(0.011, abs=0.004)
  # The environment sleeps in its worker on tool calls only: 3 calls of exactly 50 ms.
  task = tasks.get_task("calculator", tool_latency_ms=50, tool_latency_sigma=0.0)
  runner = EnvRunner(task.environment, pool, timeout_s=5.0, max_observation_chars=16)
  ex = {"prompt": "123*45=?\n", "expr": "123*45", "answer": "5535"}
  begin = time.perf_counter()
  _play(runner, [ex], ["<calc>1+1</calc>", "<calc>2+2</calc>", "<calc>123*45</calc>", "=5535"])
  assert time.perf_counter() - begin >= 0.15
  for kwargs, field in [
    ({"tool_latency_ms": -1.0}, "tool_latency_ms"),
    ({"tool_latency_ms": 200.0, "tool_latency_sigma": float("nan")}, "tool_latency_sigma"),
    ({"tool_latency_ms": 200.0, "tool_latency_max_ms": 100.0}, "tool_latency_max_ms"),
  ]:
    with pytest.raises(ValueError, match=f"calculator: {field} must be"):
      tasks.get_task("calculator", **kwargs)


def _assert_demonstration_matches_the_environment(runner, task, examples):
  """The demonstrations' env turns are what the environment answers to their policy turns."""
  tok = CharTokenizer()
  for ex in examples:
    demo = task.demonstration(ex)
    tok.encode(task.prompt(ex) + "".join(t for _, t in demo))  # in the toy alphabet
    assert text_episodes.split_turns("".join(t for _, t in demo)) == demo
    res = runner.reset([ex])[0]
    for (role, text), nxt in zip(demo, demo[1:] + [("end", "")], strict=True):
      if role != "policy":
        continue
      res = runner.step([res.state], [text])[0]
      assert res.observation == (nxt[1] if nxt[0] == "env" else "") and not res.failure
      assert res.done == (nxt[0] == "end")
    assert res.info["solved"] == 1
    assert all(len(t) <= task.max_turn_len for r, t in demo if r == "policy")


def test_task_arguments_are_checked():
  for kwargs, match in [
    ({"hi": 1}, "hi"),
    ({"hi": 16, "max_turns": 4}, "max_turns must be >= 5"),
    ({"turn_penalty": 0.5}, "turn_penalty"),
    ({"turn_penalty": -0.1}, "turn_penalty"),
  ]:
    with pytest.raises(ValueError, match=match):
      tasks.get_task("guess_number", **kwargs)
  for kwargs, match in [
    ({"kind": "div"}, "kind"),
    ({"kind": "sum", "num_terms": 9}, "num_terms"),
    ({"max_turns": 1}, "max_turns"),
    ({"max_expr_chars": 5}, "max_expr_chars"),
    ({"hi": 3}, "unexpected keyword"),
  ]:
    with pytest.raises(ValueError, match=match):
      tasks.get_task("calculator", **kwargs)


def test_episode_stats_count_tool_calls_per_solved_episode():
  finals = [
    EnvResult("", 1.0, True, {}, "", {"tool_calls": 1, "turns": 2, "solved": 1}),
    EnvResult("", 1.0, True, {}, "", {"tool_calls": 3, "turns": 4, "solved": 1}),
    EnvResult("", 0.0, True, {}, "", {"tool_calls": 4, "turns": 4, "solved": 0}),
    environments.failed("timeout"),
  ]
  stats = text_episodes.episode_stats(finals)
  assert stats == {
    "episodes": 4.0,
    "solved": 2.0,
    "success_rate": 0.5,
    "failed": 1.0,
    "tool_calls": 2.0,
    "tool_calls_per_solved": 2.0,
    "turns": 2.5,
    "turns_per_solved": 3.0,
  }
  assert text_episodes.episode_stats([])["success_rate"] == 0.0


class Forging(environments.Environment):
  """A step that takes over its worker's reply pipe: it answers for itself, then for later rows."""

  def reset(self, example):
    return EnvResult("", 0.0, False, {})

  def step(self, state, action_text):
    if action_text != "forge":
      return EnvResult("o", 0.0, False, {})
    frame = sys._getframe(1)
    while frame.f_code.co_name != "worker_main":
      frame = frame.f_back
    i = frame.f_locals["i"]
    conns = [o for o in gc.get_objects() if isinstance(o, multiprocessing.connection.Connection)]
    pipe = next(c for c in conns if c.writable)
    for row in range(i, i + 64):
      pipe.send_bytes(json.dumps({"i": row, "value": ["|won", 1.0, True, {}]}).encode())
    return EnvResult("o", 0.0, False, {})


def test_a_step_that_forges_replies_for_later_calls_cannot_answer_for_them():
  one = verifiers.VerifierPool(1, memory_mb=1024)  # one worker: every row follows the last
  try:
    runner = EnvRunner(Forging(), one, timeout_s=5.0, max_observation_chars=8)
    out = runner.step([{}] * 4, ["ok", "forge", "ok", "ok"])
    # The forging row may keep its own forged value (its environment decides it anyway) or
    # be caught sending a second reply; either way no later row gets a forged value.
    assert out[0].observation == "|o\n" and out[3].observation == "|o\n"
    assert out[2] in (EnvResult("|o\n", 0.0, False, {}), environments.failed("crashed"))
    assert runner.stats()["crashes"] == 1 and runner.stats()["restarts"] == 1
  finally:
    one.close()


def test_reasoning_gym_retry_gives_feedback_and_a_discounted_reward(pool):
  task = tasks.get_task("reasoning_gym:basic_arithmetic", train_size=8, eval_size=4, max_attempts=3)
  assert task.max_turns == 3 and isinstance(task.environment, rgym.Retry)
  runner = EnvRunner(task.environment, pool, timeout_s=10.0, max_observation_chars=64, wrap=False)
  ex = task.train_source[0]
  right = f"<answer>{ex['answer']}</answer>"
  ep = _play(runner, [ex], ["<answer>x</answer>", "12345678", right])
  feedback = rgym.RETRY_FEEDBACK
  assert [r[0].observation for r in ep] == ["", feedback, feedback, ""]
  assert ep[-1][0].done and ep[-1][0].reward == pytest.approx(1 - 0.1 * 2)
  assert ep[-1][0].info == {"attempts": 3, "solved": 1, "score": 1.0}
  first = _play(runner, [ex], [task.demonstration(ex)[0][1]])[-1][0]
  assert first.done and first.reward == 1.0
  never = _play(runner, [ex], ["no"] * 3)[-1][0]
  assert never.done and never.reward == 0.0 and never.info["solved"] == 0
  assert (
    tasks.get_task("reasoning_gym:basic_arithmetic", train_size=8, eval_size=4).environment is None
  )
  with pytest.raises(ValueError, match="attempt_penalty"):
    tasks.get_task("reasoning_gym:basic_arithmetic", max_attempts=3, attempt_penalty=0.5)


def _demonstrator(task, examples):
  """A host policy that plays each example's demonstration, turn by turn."""

  def policy(rows, texts):
    out = []
    for b, text in zip(rows, texts, strict=True):
      mine = [t for r, t in task.demonstration(examples[b]) if r == "policy"]
      out.append(mine[sum(r == "policy" for r, _ in text_episodes.split_turns(text))])
    return out

  return policy


def test_play_runs_episodes_to_done_and_stops_at_max_turns(pool):
  task = tasks.get_task("guess_number")
  runner = EnvRunner(task.environment, pool, timeout_s=5.0, max_observation_chars=8)
  examples = list(task.eval_source)
  eps = text_episodes.play(runner, examples, _demonstrator(task, examples), task.max_turns)
  assert eps.texts == [task.answer(ex) for ex in examples]
  np.testing.assert_allclose(eps.returns, [task.reward(ex, task.answer(ex)) for ex in examples])
  stats = text_episodes.episode_stats(eps.finals)
  assert stats["success_rate"] == 1.0 and stats["turns"] == 54 / 16 and not any(eps.truncated)
  # Two turns of always guessing 1: only secret 1 is solved; the others are cut, not done.
  short = text_episodes.play(runner, examples, lambda rows, texts: ["1"] * len(rows), 2)
  assert short.truncated == [False] + [True] * 15 and short.returns == [1.0] + [0.0] * 15
  assert short.texts[1] == "1\n|h\n1\n|h\n"
  calc = tasks.get_task("calculator")
  runner = EnvRunner(calc.environment, pool, timeout_s=5.0, max_observation_chars=16)
  examples = list(calc.eval_source)[:16]
  eps = text_episodes.play(runner, examples, _demonstrator(calc, examples), calc.max_turns)
  stats = text_episodes.episode_stats(eps.finals)
  assert stats["success_rate"] == 1.0 and stats["tool_calls_per_solved"] == 1.0


def test_encode_turns_masks_the_policy_tokens_of_a_demonstration():
  tok = CharTokenizer()
  turns = agentic.calc_demonstration({"expr": "12*34", "answer": "408"})
  ids, mask = text_episodes.encode_turns(tok.encode, turns)
  text = "<calc>12*34</calc>\n|408\n=408\n"
  assert ids == tok.encode(text) and tok.decode(ids) == text
  assert "".join(c for c, m in zip(text, mask, strict=True) if m) == "<calc>12*34</calc>\n=408\n"
