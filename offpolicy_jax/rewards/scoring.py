"""Host rewards: scoring in sandboxed verifier workers, answer and format parsing.

Text rewards run third-party verifier code (math-verify, reasoning-gym, unit
tests of the code task) on model output. None of it runs in the trainer
process: `score_batch` sends every call to a pool of sandboxed, killable
worker processes (`verifiers.VerifierPool`, confined by `sandbox.apply`). A
call that raises, returns a score that is not finite in float32, crashes its
worker or runs past its timeout scores 0 and is counted; its worker is
replaced, and nothing keeps running once `score_batch` returns.

  result = rewards.score_batch(task.reward, examples, texts, timeout_s=10.0)
  result.scores, result.failed, result.timed_out

Tasks made by `tasks.get_task` carry a `SandboxedReward`: calling it directly
(`task.reward(example, text)`) also scores in a worker.
"""

import re
from collections.abc import Callable, Sequence
from typing import Any

from offpolicy_jax.rewards import verifiers
from offpolicy_jax.rewards.verifier_results import RewardResult
from offpolicy_jax.rewards.verifiers import RebuildReward, VerifierPool, get_pool

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def extract_answer(text: str) -> str:
  """Content of the last `<answer>...</answer>` block, else the stripped text."""
  found = _ANSWER_RE.findall(text)
  return (found[-1] if found else text).strip()


def follows_format(text: str) -> bool:
  """True iff `text` is exactly `<think>...</think><answer>...</answer>` (whitespace ok)."""
  return _FORMAT_RE.match(text) is not None


class RewardError(RuntimeError):
  """A direct call of a `SandboxedReward` failed (raised, timed out or crashed)."""


class SandboxedReward:
  """A host reward that runs in a sandboxed verifier worker when called.

  Attributes:
    fn: the verifier `fn(example, text) -> float` (never called in this process).
    ref: what is sent to the worker: `fn` itself when it pickles, else a
      `verifiers.RebuildReward` that rebuilds the task there.
    name: the task name, for errors.
  """

  def __init__(self, fn: Callable[[Any, str], float], ref: Any = None, name: str = ""):
    self.fn, self.ref, self.name = fn, fn if ref is None else ref, name

  def __call__(self, example: Any, text: str, timeout_s: float = 10.0) -> float:
    """Scores one response in the default pool (`get_pool()`).

    Raises:
      RewardError: the verifier raised, timed out or crashed its worker.
    """
    res = score_batch(self, [example], [text], timeout_s=timeout_s)
    if res.failed[0]:
      raise RewardError(f"{self.name or 'reward'}: {res.errors[0] if res.errors else 'failed'}")
    return float(res.scores[0])

  def __repr__(self) -> str:
    return f"SandboxedReward({self.name or self.fn!r})"


def score_batch(
  fn: Callable[[Any, str], float],
  examples: Sequence[Any],
  texts: Sequence[str],
  timeout_s: float = 10.0,
  *,
  pool: VerifierPool | None = None,
  batch_timeout_s: float | None = None,
) -> RewardResult:
  """Scores B responses in sandboxed verifier workers.

  Args:
    fn: host reward `fn(example, response_text) -> float`: a `SandboxedReward`
      (`task.reward`), or a module-level function (or `functools.partial` of
      one) of an importable module.
    examples: B examples (repeat each prompt's example K times for groups).
    texts: B decoded responses.
    timeout_s: wall-clock limit of one call; past it the call scores 0, counts
      as a timeout and its worker is killed and replaced.
    pool: the worker pool (default: `get_pool()`, one worker per CPU).
    batch_timeout_s: wall-clock limit of the whole batch (default `2 * timeout_s`).

  Returns:
    RewardResult: `scores` float32 [B] (0 where failed), `failed` bool [B],
    `timed_out` bool [B], `seconds`, worker `restarts`, first `errors`.
  """
  pool = pool or get_pool()
  return pool.score(fn, examples, texts, timeout_s, batch_timeout_s)


def score_with_timeout(
  fn: Callable[[Any, str], float], example: Any, text: str, timeout_s: float = 10.0
) -> tuple[float, bool]:
  """`(score, failed)` of one response, with `score_batch` semantics."""
  res = score_batch(fn, [example], [text], timeout_s)
  return float(res.scores[0]), bool(res.failed[0])


__all__ = [
  "RebuildReward",
  "RewardError",
  "RewardResult",
  "SandboxedReward",
  "VerifierPool",
  "extract_answer",
  "follows_format",
  "get_pool",
  "score_batch",
  "score_with_timeout",
  "verifiers",
]
