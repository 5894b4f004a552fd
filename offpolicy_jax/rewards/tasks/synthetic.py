"""Procedural synthetic tasks with on-device rewards (learnable on a CPU).

Each task draws example `i` from `numpy.random.default_rng([seed, split, i])`,
so the training set is effectively infinite and any example can be regenerated
from its index. A problem belongs to the held-out evaluation split iff
`crc32(prompt) % 10 == 0`; training examples are resampled until they fall
outside it, so train and eval never share a problem.

| task    | prompt        | answer |
|---------|---------------|--------|
| add     | `12+7=`       | `19`   |
| reverse | `rev:1234=`   | `4321` |
| copy    | `copy:1234=`  | `1234` |
| sort    | `sort:3142=`  | `1234` |

Rewards: exact match of the response (up to EOS) with the answer, 1.0 / 0.0;
`partial_credit=True` gives the fraction of correct positions over the answer
characters plus the EOS position.
"""

import functools
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from offpolicy_jax.rewards.tasks.base import Example, ListSource, Task

_TRAIN_LEN = 2**31 - 1
_EVAL_MOD = 10


def _is_eval(prompt: str) -> bool:
  return zlib.crc32(prompt.encode()) % _EVAL_MOD == 0


class ProceduralSource:
  """Infinite-ish grain data source: example `i` is generated from `(seed, i)`."""

  def __init__(self, gen: Callable[[np.random.Generator], Example], seed: int):
    self._gen = gen
    self._seed = seed

  def __len__(self) -> int:
    return _TRAIN_LEN

  def __getitem__(self, index: int) -> Example:
    rng = np.random.default_rng([self._seed, 0, int(index)])
    for _ in range(1000):
      ex = self._gen(rng)
      if not _is_eval(ex["prompt"]):
        return ex
    raise RuntimeError("could not draw a training example outside the eval split")

  def __repr__(self) -> str:
    return f"ProceduralSource(seed={self._seed})"


def _eval_source(gen, seed: int, num_eval: int) -> ListSource:
  """`num_eval` distinct held-out examples (fewer if the problem space is small)."""
  rng = np.random.default_rng([seed, 1])
  seen: dict[str, Example] = {}
  for _ in range(200 * num_eval):
    ex = gen(rng)
    if _is_eval(ex["prompt"]) and ex["prompt"] not in seen:
      seen[ex["prompt"]] = ex
      if len(seen) == num_eval:
        break
  return ListSource(list(seen.values()))


def _digits(rng: np.random.Generator, min_len: int, max_len: int) -> str:
  n = int(rng.integers(min_len, max_len + 1))
  return "".join(str(d) for d in rng.integers(0, 10, n))


def device_reward(
  answer_tokens: ArrayLike, tokens: ArrayLike, mask: ArrayLike, partial_credit: bool = False
) -> jax.Array:
  """Compares responses with the answer tokens (answer ids, EOS, then -1 padding).

  Exact: `r_b = 1` iff `tokens[b, j] == answer_tokens[b, j]` with `mask[b, j] > 0`
  at every non-padding answer position `j` (so the response is the answer
  immediately followed by EOS), else 0. Partial: the fraction of those
  positions that match.

  Args:
    answer_tokens: [B, A] int answer ids + EOS, padded with -1.
    tokens: [B, N] int sampled response tokens.
    mask: [B, N] response mask (1 up to and including EOS).
    partial_credit: return the matched fraction instead of exact match.

  Returns:
    [B] float32 rewards.
  """
  ans = jnp.asarray(answer_tokens)
  tok = jnp.asarray(tokens)
  msk = jnp.asarray(mask)
  a = ans.shape[1]
  if tok.shape[1] < a:  # response too short to contain the answer: pad (never matches)
    extra = a - tok.shape[1]
    tok = jnp.pad(tok, ((0, 0), (0, extra)), constant_values=-2)
    msk = jnp.pad(msk, ((0, 0), (0, extra)))
  valid = ans >= 0
  match = (tok[:, :a] == ans) & (msk[:, :a] > 0) & valid
  if partial_credit:
    return (jnp.sum(match, 1) / jnp.maximum(jnp.sum(valid, 1), 1)).astype(jnp.float32)
  return jnp.all(match | ~valid, axis=1).astype(jnp.float32)


def host_reward(example: Example, text: str, partial_credit: bool = False) -> float:
  """Host twin of `device_reward` on decoded text (decoding stops at EOS).

  Partial credit counts matching characters plus one for the right length
  (standing for the EOS position), divided by `len(answer) + 1`.
  """
  ans = example["answer"]
  if not partial_credit:
    return float(text == ans)
  hits = sum(a == b for a, b in zip(ans, text, strict=False)) + (len(text) == len(ans))
  return hits / (len(ans) + 1)


def _gen_add(max_digits: int):
  def gen(rng):
    a, b = (int(x) for x in rng.integers(0, 10**max_digits, 2))
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

  return gen, max_digits + 1


def _gen_string(op: str, fn, min_len: int, max_len: int):
  def gen(rng):
    s = _digits(rng, min_len, max_len)
    return {"prompt": f"{op}:{s}=", "answer": fn(s)}

  return gen, max_len


_OPS = {
  "reverse": ("rev", lambda s: s[::-1]),
  "copy": ("copy", lambda s: s),
  "sort": ("sort", lambda s: "".join(sorted(s))),
}
# A plausible wrong answer of each string task (`Task.distractor`): the operand transformed
# by a neighbouring operation.
_DISTRACTORS = {"reverse": lambda s: s, "copy": lambda s: s[::-1], "sort": lambda s: s}


def _distractor(fn, example: Example) -> str:
  prompt = example["prompt"]
  return fn(prompt[prompt.index(":") + 1 : -1])


def make_task(
  name: str,
  *,
  seed: int = 0,
  num_eval: int = 256,
  partial_credit: bool = False,
  max_digits: int = 2,
  min_len: int = 2,
  max_len: int = 5,
) -> Task:
  """Builds a synthetic task.

  Args:
    name: "add", "reverse", "copy" or "sort".
    seed: data seed (the same seed gives the same examples).
    num_eval: size of the fixed held-out evaluation set.
    partial_credit: fraction-of-positions reward instead of exact match.
    max_digits: operands of "add" are in `[0, 10**max_digits)`.
    min_len: shortest digit string (string tasks).
    max_len: longest digit string (string tasks).

  Returns:
    The Task.
  """
  if name == "add":
    if max_digits < 1:
      raise ValueError(f"max_digits must be >= 1, got {max_digits}.")
    gen, max_answer_len = _gen_add(max_digits)
  elif name in _OPS:
    if not 1 <= min_len <= max_len:
      raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}.")
    gen, max_answer_len = _gen_string(*_OPS[name], min_len, max_len)
  else:
    raise ValueError(f"unknown synthetic task {name!r}; expected add, {', '.join(_OPS)}.")
  if num_eval < 1:
    raise ValueError(f"num_eval must be >= 1, got {num_eval}.")
  return Task(
    name=name,
    train_source=ProceduralSource(gen, seed),
    eval_source=_eval_source(gen, seed, num_eval),
    prompt=lambda ex: ex["prompt"],
    reward=functools.partial(host_reward, partial_credit=partial_credit),
    use_chat_template=False,
    answer=lambda ex: ex["answer"],
    max_answer_len=max_answer_len,
    device_reward=lambda a, t, m: device_reward(a, t, m, partial_credit),
    distractor=functools.partial(_distractor, _DISTRACTORS[name]) if name in _OPS else None,
  )


NAMES = ("add", "reverse", "copy", "sort")
