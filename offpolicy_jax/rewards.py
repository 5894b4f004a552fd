"""Host-side reward execution: timeouts, error counting, answer/format parsing.

Text rewards run arbitrary verifier code (math-verify, reasoning-gym) on model
output. A verifier that raises or hangs must never kill a run: it scores 0 and
is counted. Model output is only ever parsed (regexes, sympy parsing inside
math-verify), never evaluated.
"""

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def extract_answer(text: str) -> str:
  """Content of the last `<answer>...</answer>` block, else the stripped text."""
  found = _ANSWER_RE.findall(text)
  return (found[-1] if found else text).strip()


def follows_format(text: str) -> bool:
  """True iff `text` is exactly `<think>...</think><answer>...</answer>` (whitespace ok)."""
  return _FORMAT_RE.match(text) is not None


def score_with_timeout(
  fn: Callable[[Any, str], float], example: Any, text: str, timeout_s: float = 10.0
) -> tuple[float, bool]:
  """Runs `fn(example, text)` in a daemon thread with a timeout.

  A reward that raises, returns a non-finite value, or does not finish within
  `timeout_s` seconds scores 0 and is reported as failed. A hung call is left
  running in its daemon thread (Python threads cannot be killed) and never
  blocks interpreter exit.

  Args:
    fn: host reward `fn(example, response_text) -> float`.
    example: the task example (dict).
    text: decoded model response.
    timeout_s: wall-clock limit in seconds.

  Returns:
    `(score, failed)`.
  """
  return _run_many(fn, [example], [text], timeout_s)[0]


def _run_many(fn, examples, texts, timeout_s) -> list[tuple[float, bool]]:
  results: list[Any] = [None] * len(examples)

  def work(i):
    try:
      results[i] = float(fn(examples[i], texts[i]))
    except Exception:  # noqa: BLE001  any verifier failure scores 0
      results[i] = None

  threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(examples))]
  deadline = time.monotonic() + timeout_s
  for t in threads:
    t.start()
  out = []
  for i, t in enumerate(threads):
    t.join(max(0.0, deadline - time.monotonic()))
    score = None if t.is_alive() else results[i]
    if score is None or not np.isfinite(score):
      out.append((0.0, True))
    else:
      out.append((score, False))
  return out


class RewardResult(NamedTuple):
  """Scores of a batch of responses.

  Attributes:
    scores: float32 [B] rewards (0 where the reward failed).
    failed: bool [B] True where the reward raised or timed out.
  """

  scores: np.ndarray
  failed: np.ndarray


def score_batch(
  fn: Callable[[Any, str], float],
  examples: Sequence[Any],
  texts: Sequence[str],
  timeout_s: float = 10.0,
  max_threads: int = 16,
) -> RewardResult:
  """Scores `B` responses with `score_with_timeout` semantics, `max_threads` at a time.

  Args:
    fn: host reward `fn(example, response_text) -> float`.
    examples: B examples (repeat each prompt's example K times for groups).
    texts: B decoded responses.
    timeout_s: wall-clock limit in seconds for each chunk of `max_threads` calls.
    max_threads: concurrent verifier threads.

  Returns:
    RewardResult with scores [B] and failed [B]; `failed.sum()` is the count to log.
  """
  if len(examples) != len(texts):
    raise ValueError(f"examples ({len(examples)}) and texts ({len(texts)}) differ in length.")
  out: list[tuple[float, bool]] = []
  for s in range(0, len(texts), max_threads):
    out += _run_many(fn, examples[s : s + max_threads], texts[s : s + max_threads], timeout_s)
  scores = np.array([o[0] for o in out], np.float32).reshape(len(out))
  failed = np.array([o[1] for o in out], bool).reshape(len(out))
  return RewardResult(scores, failed)


def score_groups(
  fn: Callable[[Any, str], float],
  tokenizer,
  examples: Sequence[Any],
  tokens: np.ndarray,
  timeout_s: float = 10.0,
  max_threads: int = 16,
) -> RewardResult:
  """Decodes group-major responses and scores them against their prompts' examples.

  Args:
    fn: host reward `fn(example, response_text) -> float` (e.g. `task.reward`).
    tokenizer: anything with `decode(ids) -> str` (stops at EOS, skips padding).
    examples: G examples, one per prompt (e.g. `data.examples(task, split, batch["index"])`).
    tokens: [B, N] response tokens with B = G * K, row `g * K + k` answering prompt g.
    timeout_s: wall-clock limit per chunk of `max_threads` calls.
    max_threads: concurrent verifier threads.

  Returns:
    RewardResult with scores [B] and failed [B].
  """
  tokens = np.asarray(tokens)
  g = len(examples)
  if g == 0 or tokens.ndim != 2 or tokens.shape[0] % g:
    raise ValueError(f"tokens {tokens.shape} must be [G*K, N] with G={g} examples.")
  k = tokens.shape[0] // g
  texts = [tokenizer.decode(row) for row in tokens]
  return score_batch(fn, [ex for ex in examples for _ in range(k)], texts, timeout_s, max_threads)
