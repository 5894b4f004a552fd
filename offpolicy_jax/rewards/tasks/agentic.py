"""Multi-turn tasks that a tiny model can learn on a CPU: a search game and a calculator tool.

Episodes are written in the character alphabet of the toy models
(`models.tokenizers.CharTokenizer`): every policy turn ends with
`environments.TURN_END` ("\\n"), every observation is `|text\\n`
(`environments.observation_text`). Both environments run in the verifier
workers (`environments.EnvRunner`), never in the trainer.

guess_number (`hi=16`, `max_turns=8`, `turn_penalty=0.05`): a secret in
`1..hi` is drawn per example; each policy turn is a number; the observation
says where the secret is: `h` (higher than the guess), `l` (lower), `?` (not a
number in `1..hi`). A correct guess at turn `t` ends the episode with reward

  r = 1 - turn_penalty * (t - 1)        (t = 1, ..., max_turns)

and no correct guess within `max_turns` gives 0. `max_turns` must allow a
binary search (`max_turns >= hi.bit_length()`) and `turn_penalty` keep every
solve above 0. The secret is hidden state, not part of the prompt
(`guess 1-16\\n` for every example), so there is nothing to hold out: the
eval split is every secret once.

  guess 1-16      8      |h      12      |l      10      |h      11
  (prompt)        policy  env     policy  env     policy  env     policy: solved at t=4, r=0.85

calculator (`kind="mul"`: a 3-digit times a 2-digit number; `kind="sum"`:
`num_terms` 3-digit numbers; `max_turns=4`): the prompt is the expression,
`123*45=?\\n`. A policy turn is either a tool call `<calc>EXPR</calc>`, whose
observation is the value of EXPR (or `?`), or a final answer `=VALUE`, which
ends the episode with reward 1 if VALUE is the prompt's value and 0 if not;
any other turn gets `?`; no answer within `max_turns` gives 0. EXPR is
evaluated by `safe_eval` (integer literals, `+ - * ( )` and spaces only,
parsed with `ast`, never `eval`). `info["tool_calls"]` counts the tool calls
of an episode. Train/eval splits as the synthetic tasks
(`synthetic.ProceduralSource`: a problem is held out iff the CRC32 of its
prompt is 0 mod 10).

  123*45=?        <calc>123*45</calc>      |5535      =5535
  (prompt)        policy                   env        policy: r=1, 1 tool call

A tool with latency (`tool_latency_ms` > 0): each tool call takes a
log-normal time before it answers, median `tool_latency_ms` and shape
`tool_latency_sigma` (`delay = median * exp(sigma * z)`, z standard normal; 1.0
puts the 99th percentile about 10x above the median), cut at
`tool_latency_max_ms`. The environment sleeps that long in its verifier
worker, so a step that waits for its episodes waits for the slowest tool
calls: the workload where sampling ahead of the learner (asynchrony, episodes
in flight) pays on one machine (docs/lag_and_study.md).

Each task's `demonstration(example)` is a solved episode (binary search; one
tool call then the answer); its text is the task's `answer`, for the
supervised warm start.
"""

import ast
import functools
import math
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from offpolicy_jax.rewards.environments import TURN_END, Environment, EnvResult, observation_text
from offpolicy_jax.rewards.tasks import synthetic
from offpolicy_jax.rewards.tasks.base import Example, ListSource, Task
from offpolicy_jax.rewards.text_episodes import replay_reward

HIGHER, LOWER, INVALID = "h", "l", "?"
_NUMBER = re.compile(r"-?[0-9]{1,20}")
_CALL = re.compile(r"<calc>(.*)</calc>", re.DOTALL)
_CALC_CHARS = re.compile(r"[0-9+\-*() ]*")
_CALC_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}


# ---------------------------------------------------------------- guess_number


def _feedback(secret: int, guess: int | None) -> str:
  if guess is None:
    return INVALID
  return HIGHER if secret > guess else LOWER


def _parse_int(text: str) -> int | None:
  text = text.strip()
  return int(text) if _NUMBER.fullmatch(text) else None


class GuessNumber(Environment):
  """Guess a secret in `1..hi` with higher/lower feedback (see the module docstring).

  State: `{"secret": int, "turn": int}`; info: `turns`, `solved` (0 or 1).
  """

  def __init__(self, hi: int, max_turns: int, turn_penalty: float):
    self.hi, self.max_turns, self.turn_penalty = hi, max_turns, turn_penalty

  def solve_reward(self, turn: int) -> float:
    """`1 - turn_penalty * (turn - 1)`: the reward of a correct guess at `turn` (from 1)."""
    return 1.0 - self.turn_penalty * (turn - 1)

  def reset(self, example: Example) -> EnvResult:
    secret = example["secret"]
    if type(secret) is not int or not 1 <= secret <= self.hi:
      raise ValueError(f"guess_number: secret {secret!r} is not an int in 1..{self.hi}")
    return EnvResult("", 0.0, False, {"secret": secret, "turn": 0}, info={"turns": 0, "solved": 0})

  def step(self, state: Any, action_text: str) -> EnvResult:
    secret, turn = int(state["secret"]), int(state["turn"]) + 1
    guess = _parse_int(action_text)
    if guess is not None and not 1 <= guess <= self.hi:
      guess = None
    state = {"secret": secret, "turn": turn}
    solved = guess == secret
    info = {"turns": turn, "solved": int(solved)}
    if solved:
      return EnvResult("", self.solve_reward(turn), True, state, info=info)
    if turn >= self.max_turns:
      return EnvResult("", 0.0, True, state, info=info)
    return EnvResult(_feedback(secret, guess), 0.0, False, state, info=info)


class _Secrets:
  """Grain source of training secrets: example `i` is drawn uniformly from `(seed, i)`."""

  def __init__(self, hi: int, seed: int):
    self._hi, self._seed = hi, seed

  def __len__(self) -> int:
    return 2**31 - 1

  def __getitem__(self, index: int) -> Example:
    rng = np.random.default_rng([self._seed, 0, int(index)])
    return {"secret": int(rng.integers(1, self._hi + 1))}

  def __repr__(self) -> str:
    return f"_Secrets(hi={self._hi}, seed={self._seed})"


def guess_demonstration(example: Example, hi: int, max_turns: int) -> list[tuple[str, str]]:
  """Binary search (guess the middle of what is left) as `[(role, text), ...]`."""
  secret, lo, up = example["secret"], 1, hi
  turns: list[tuple[str, str]] = []
  for _ in range(max_turns):
    guess = (lo + up) // 2
    turns.append(("policy", f"{guess}{TURN_END}"))
    if guess == secret:
      break
    turns.append(("env", observation_text(_feedback(secret, guess))))
    lo, up = (guess + 1, up) if secret > guess else (lo, guess - 1)
  return turns


def make_guess_number(
  *, seed: int = 0, hi: int = 16, max_turns: int = 8, turn_penalty: float = 0.05
) -> Task:
  """The guess_number task (see the module docstring).

  Args:
    seed: data seed of the training secrets.
    hi: secrets are in `1..hi` (2 <= hi <= 999).
    max_turns: guesses per episode (>= `hi.bit_length()`, what a binary search needs).
    turn_penalty: reward lost per guess after the first (>= 0; a solve at
      `max_turns` must still earn more than 0).

  Returns:
    The Task, with its `environment` and `demonstration`.
  """
  if not 2 <= hi <= 999:
    raise ValueError(f"guess_number: hi must be in [2, 999], got {hi}.")
  if max_turns < hi.bit_length():
    raise ValueError(
      f"guess_number: max_turns must be >= {hi.bit_length()} (a binary search over 1..{hi}), "
      f"got {max_turns}."
    )
  if not (turn_penalty >= 0 and 1.0 - turn_penalty * (max_turns - 1) > 0):
    raise ValueError(
      f"guess_number: turn_penalty must be in [0, 1 / (max_turns - 1)) = [0, "
      f"{1 / max(max_turns - 1, 1):.4g}), got {turn_penalty}."
    )
  env = GuessNumber(hi, max_turns, float(turn_penalty))
  demo = functools.partial(guess_demonstration, hi=hi, max_turns=max_turns)
  evals = [{"secret": s} for s in range(1, hi + 1)]
  return Task(
    name="guess_number",
    train_source=_Secrets(hi, seed),
    eval_source=ListSource(evals),
    prompt=lambda ex: f"guess 1-{hi}{TURN_END}",
    reward=functools.partial(replay_reward, env=env),
    answer=lambda ex: "".join(t for _, t in demo(ex)),
    max_answer_len=max(sum(len(t) for _, t in demo(ex)) for ex in evals),
    environment=env,
    demonstration=demo,
    max_turns=max_turns,
    max_turn_len=len(str(hi)) + len(TURN_END),
  )


# ------------------------------------------------------------------ calculator


def safe_eval(expr: str, max_chars: int = 32, max_abs: int = 10**12) -> int:
  """The value of an integer expression with `+ - * ( )`, never `eval`.

  Accepted: at most `max_chars` characters among `0-9 + - * ( )` and space;
  parsed with `ast.parse(mode="eval")`; only integer literals, unary `+ -` and
  binary `+ - *` nodes are evaluated (no names, calls, attributes, powers,
  floats, ...), and every intermediate value must stay within `max_abs`.

  Raises:
    ValueError: anything else (the message says what).
  """
  if len(expr) > max_chars:
    raise ValueError(f"expression longer than {max_chars} characters")
  if not _CALC_CHARS.fullmatch(expr):
    raise ValueError("characters outside 0-9 + - * ( ) and space")
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise ValueError(f"not an expression ({type(e).__name__})") from None
  try:
    return _eval_node(tree.body, max_abs)
  except RecursionError:
    raise ValueError("expression nested too deep") from None


def _eval_node(node: ast.AST, max_abs: int) -> int:
  if isinstance(node, ast.Constant) and type(node.value) is int:
    value = node.value
  elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
    value = _eval_node(node.operand, max_abs)
    value = -value if isinstance(node.op, ast.USub) else value
  elif isinstance(node, ast.BinOp) and type(node.op) in _CALC_OPS:
    left, right = _eval_node(node.left, max_abs), _eval_node(node.right, max_abs)
    value = _CALC_OPS[type(node.op)](left, right)
  else:
    what = type(getattr(node, "op", node)).__name__
    raise ValueError(f"{what} is not allowed (integers and + - * only)")
  if abs(value) > max_abs:
    raise ValueError(f"a value is larger than {max_abs}")
  return value


class Calculator(Environment):
  """Arithmetic with a calculator tool (see the module docstring).

  State: `{"answer": int, "turn": int, "calls": int}`; info: `tool_calls`,
  `turns`, `solved` (0 or 1).
  """

  def __init__(self, max_turns: int, max_expr_chars: int, latency: "ToolLatency | None" = None):
    self.max_turns, self.max_expr_chars, self.latency = max_turns, max_expr_chars, latency
    self._rng = np.random.default_rng()  # delays change timing only, never a number of the run

  def reset(self, example: Example) -> EnvResult:
    answer = int(example["answer"])
    state = {"answer": answer, "turn": 0, "calls": 0}
    return EnvResult("", 0.0, False, state, info={"tool_calls": 0, "turns": 0, "solved": 0})

  def step(self, state: Any, action_text: str) -> EnvResult:
    answer, turn, calls = int(state["answer"]), int(state["turn"]) + 1, int(state["calls"])
    text = action_text.strip()
    call = _CALL.fullmatch(text)
    done, solved, obs = False, False, INVALID
    if call is not None:
      calls += 1
      if self.latency is not None:
        time.sleep(self.latency.draw(self._rng))
      try:
        obs = str(safe_eval(call.group(1), self.max_expr_chars))
      except ValueError:
        obs = INVALID
    elif text.startswith("="):
      given = _parse_int(text[1:])
      done, solved = True, given == answer
    state = {"answer": answer, "turn": turn, "calls": calls}
    info = {"tool_calls": calls, "turns": turn, "solved": int(solved)}
    if done or turn >= self.max_turns:
      return EnvResult("", float(solved), True, state, info=info)
    return EnvResult(obs, 0.0, False, state, info=info)


class ToolLatency:
  """A tool call's delay in seconds: log-normal, `median_s * exp(sigma * z)`, at most `max_s`."""

  def __init__(self, median_s: float, sigma: float, max_s: float):
    self.median_s, self.sigma, self.max_s = median_s, sigma, max_s

  def draw(self, rng: np.random.Generator) -> float:
    return min(self.median_s * math.exp(self.sigma * float(rng.standard_normal())), self.max_s)


def _latency(median_ms: float, sigma: float, max_ms: float) -> ToolLatency | None:
  """The calculator's tool latency (None for none); ValueError naming the bad argument."""
  for name, value in (("tool_latency_ms", median_ms), ("tool_latency_sigma", sigma)):
    if not math.isfinite(value) or value < 0:
      raise ValueError(f"calculator: {name} must be a finite number >= 0, got {value}.")
  if not median_ms:
    return None
  if not math.isfinite(max_ms) or max_ms < median_ms:
    raise ValueError(
      f"calculator: tool_latency_max_ms must be >= tool_latency_ms ({median_ms}), got {max_ms}."
    )
  return ToolLatency(median_ms / 1e3, sigma, max_ms / 1e3)


def _gen_calc(kind: str, num_terms: int):
  def gen(rng: np.random.Generator) -> Example:
    if kind == "mul":
      a, b = int(rng.integers(100, 1000)), int(rng.integers(10, 100))
      expr, value = f"{a}*{b}", a * b
    else:
      terms = [int(x) for x in rng.integers(100, 1000, num_terms)]
      expr, value = "+".join(map(str, terms)), sum(terms)
    return {"prompt": f"{expr}=?{TURN_END}", "expr": expr, "answer": str(value)}

  return gen


def calc_demonstration(example: Example) -> list[tuple[str, str]]:
  """One tool call on the prompt's expression, then its value as the answer."""
  return [
    ("policy", f"<calc>{example['expr']}</calc>{TURN_END}"),
    ("env", observation_text(example["answer"])),
    ("policy", f"={example['answer']}{TURN_END}"),
  ]


def make_calculator(
  *,
  seed: int = 0,
  num_eval: int = 256,
  kind: str = "mul",
  num_terms: int = 3,
  max_turns: int = 4,
  max_expr_chars: int = 32,
  tool_latency_ms: float = 0.0,
  tool_latency_sigma: float = 1.0,
  tool_latency_max_ms: float = 5000.0,
) -> Task:
  """The calculator task (see the module docstring).

  Args:
    seed: data seed (the same seed gives the same examples).
    num_eval: size of the fixed held-out evaluation set.
    kind: "mul" (3-digit * 2-digit) or "sum" (`num_terms` 3-digit numbers).
    num_terms: terms of a "sum" problem (2..8).
    max_turns: policy turns per episode (>= 2: a tool call and the answer).
    max_expr_chars: longest expression the tool evaluates.
    tool_latency_ms: median delay of a tool call (0: answered at once).
    tool_latency_sigma: the delay's log-normal shape (0: always the median).
    tool_latency_max_ms: the longest delay (heavier tails are cut here; keep
      it below `reward_timeout`, or slow calls time out and score 0).

  Returns:
    The Task, with its `environment` and `demonstration`.
  """
  if kind not in ("mul", "sum"):
    raise ValueError(f"calculator: kind must be 'mul' or 'sum', got {kind!r}.")
  if not 2 <= num_terms <= 8:
    raise ValueError(f"calculator: num_terms must be in [2, 8], got {num_terms}.")
  if max_turns < 2:
    raise ValueError(
      f"calculator: max_turns must be >= 2 (a tool call and the answer), got {max_turns}."
    )
  if num_eval < 1:
    raise ValueError(f"calculator: num_eval must be >= 1, got {num_eval}.")
  gen = _gen_calc(kind, num_terms)
  longest = 3 + 1 + 2 if kind == "mul" else 4 * num_terms - 1  # characters of the expression
  if max_expr_chars < longest:
    raise ValueError(f"calculator: max_expr_chars must be >= {longest}, got {max_expr_chars}.")
  latency = _latency(tool_latency_ms, tool_latency_sigma, tool_latency_max_ms)
  env = Calculator(max_turns, max_expr_chars, latency)
  answer_len = 6 if kind == "mul" else 4  # digits of the largest value
  return Task(
    name="calculator",
    train_source=synthetic.ProceduralSource(gen, seed),
    eval_source=synthetic._eval_source(gen, seed, num_eval),
    prompt=lambda ex: ex["prompt"],
    reward=functools.partial(replay_reward, env=env),
    answer=lambda ex: "".join(t for _, t in calc_demonstration(ex)),
    max_answer_len=len("<calc></calc>|=") + longest + 2 * answer_len + 3 * len(TURN_END),
    environment=env,
    demonstration=calc_demonstration,
    max_turns=max_turns,
    max_turn_len=len("<calc></calc>") + longest + len(TURN_END),
  )


FACTORIES: dict[str, Callable[..., Task]] = {
  "guess_number": make_guess_number,
  "calculator": make_calculator,
}
