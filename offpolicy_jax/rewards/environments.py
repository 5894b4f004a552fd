"""Environments of multi-turn tasks, run where rewards run: in sandboxed verifier workers.

A multi-turn episode alternates policy turns with environment turns:

  prompt, a_1, o_1, a_2, o_2, ..., a_T        (a: policy text, o: observation)

An `Environment` answers each policy turn. Its code is third-party code fed
by model output (a game, a tool, a tool's parser), so, like a host reward, it
never runs in the trainer: `EnvRunner` sends every `reset` and `step` to the
verifier workers (`verifiers.VerifierPool.call`), with the pool's timeouts,
kill-and-replace and confinement (`sandbox`), and reads the answers back as
JSON data, never unpickled:

  runner = EnvRunner(task.environment, pool, timeout_s=5.0, max_observation_chars=64)
  first = runner.reset(examples)                 # [B] EnvResult
  nxt = runner.step([r.state for r in first], actions)
  runner.stats()                                 # calls, timeouts, errors, garbage, ...

The environment keeps nothing between calls: everything an episode needs
travels in its `state`, JSON data that the trainer holds and sends back with
the next action, so any worker can answer any step and a killed worker loses
nothing. A call that hangs, raises, returns something that is not
`[observation: str, reward: finite number, done: bool, state: JSON data]`
(or an `EnvResult`), or whose worker dies, ends its episode:
`EnvResult("", 0.0, True, None, failure)` with `failure` one of
`verifier_results.FAILURES` ("timeout", "error", "garbage", "crashed"), counted in
`stats()`; the other rows of the batch return as usual.

Text conventions (the toy models' character alphabet has no roles): a policy
turn ends with `TURN_END` (the sampler's stop text); the runner returns an
observation `o` as `OBS_PREFIX + o + TURN_END` (`observation_text`; each
line so marked), so the environment's text is marked as such and the next
policy turn starts on a fresh line. An empty observation stays empty (nothing to append). A
chat-template run takes the environment's raw text (`wrap=False`) and renders
it as a tool or user message instead.

Environments reach a worker as tasks' rewards do: an instance of a
module-level class (pickled), or a `RebuildEnv(factory, kwargs, name)` that the
worker resolves once to the environment `factory(**kwargs)` is or carries
(`tasks.get_task` makes one for a task whose environment does not pickle).
"""

import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from offpolicy_jax.rewards import verifier_results, verifiers, worker

TURN_END = "\n"
OBS_PREFIX = "|"
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# The `stats()` counter of each failure kind.
_COUNTER = {
  verifier_results.TIMEOUT: "timeouts",
  verifier_results.ERROR: "errors",
  verifier_results.GARBAGE: "garbage",
  verifier_results.CRASHED: "crashes",
}
_COUNTERS = ("calls", "failures", *_COUNTER.values(), "truncated", "restarts")


class EnvResult(NamedTuple):
  """The environment's answer to a reset or a step.

  Attributes:
    observation: text for the policy ("" for none). From `EnvRunner`: wrapped
      as `OBS_PREFIX + text + TURN_END` (unless `wrap=False`) and truncated to
      `max_observation_chars` characters before wrapping.
    reward: reward of this step (0 at reset).
    done: the episode is over (the policy gets no further turn).
    state: JSON data the next `step` receives (None after a failure).
    failure: "" when the call succeeded, else one of `verifier_results.FAILURES`
      (set by `EnvRunner`; what an environment puts there is ignored).
    info: the episode's metrics so far, `{name: number}` (e.g. "tool_calls",
      "turns", "solved"), or None; read it at `done`.
  """

  observation: str
  reward: float
  done: bool
  state: Any
  failure: str = ""
  info: dict[str, Any] | None = None


class Environment:
  """The environment protocol (subclass it, or write any class with these methods).

  Both methods run in a verifier worker, get their inputs as data and must
  return an `EnvResult` whose `state` is JSON data (None, bool, int, finite
  float, str, lists, dicts with str keys): the worker sends it to the trainer
  as JSON, and anything else ends the episode as "garbage". Keep no episode
  in `self`: consecutive steps of one episode may run in different workers.
  An environment that acts on model output must do so as data (parse it; never
  eval/exec it), and one that runs policy-written code must run it in an
  `isolation.Session`.
  """

  def reset(self, example: Any) -> EnvResult:
    """The episode's first answer: usually `EnvResult("", 0.0, False, state0)`.

    Args:
      example: the task's example (a dict from its data source).
    """
    raise NotImplementedError

  def step(self, state: Any, action_text: str) -> EnvResult:
    """The answer to one policy turn.

    Args:
      state: the state of the previous answer (JSON data).
      action_text: the policy's turn, decoded; may end with `TURN_END`.
    """
    raise NotImplementedError


def observation_text(text: str) -> str:
  """`OBS_PREFIX + text + TURN_END` for each line of `text` ("" for an empty `text`).

  Every line of a multi-line observation is marked, so no line of it can pass
  for a policy turn (`text_episodes.split_turns`).
  """
  return "".join(OBS_PREFIX + line + TURN_END for line in text.split(TURN_END)) if text else ""


def failed(failure: str) -> EnvResult:
  """The result of a call that failed: the episode ends with no reward."""
  return EnvResult("", 0.0, True, None, failure)


class _EnvCall:
  """What a worker calls: `("reset", example)` or `("step", state, action)` on the environment."""

  def __init__(self, env: Any):
    self.env = env

  def __call__(self, op: str, *args: Any) -> Any:
    out = self.env.reset(*args) if op == "reset" else self.env.step(*args)
    if not isinstance(out, tuple):
      return out  # not a result: the trainer counts it as garbage
    out = list(out)
    if len(out) > 1 and isinstance(out[1], numbers.Real) and not isinstance(out[1], bool):
      out[1] = float(out[1])  # numpy scalars as rewards
    return out


class RebuildEnv(worker.Rebuild):
  """An environment the worker rebuilds from `factory(**kwargs)`.

  The factory returns an `Environment`, or a task carrying one as its
  `environment` attribute (`tasks.get_task`'s factories do).
  """

  def resolve(self) -> Callable[..., Any]:
    made = self.factory(**self.kwargs)
    env = getattr(made, "environment", None) or made
    if not (hasattr(env, "reset") and hasattr(env, "step")):
      raise TypeError(f"{self!r}: {type(env).__name__} is not an environment (reset, step)")
    return _EnvCall(env)


def _check_result(value: Any) -> tuple[EnvResult | None, str]:
  """`value` (parsed JSON) as an EnvResult, or None and what is wrong with it."""
  if type(value) is not list or not 4 <= len(value) <= 6:
    return None, "not an EnvResult ([observation, reward, done, state, ...])"
  obs, reward, done, state = value[:4]
  info = value[5] if len(value) > 5 else None
  if type(obs) is not str:
    return None, f"observation is {type(obs).__name__}, not str"
  if type(reward) not in (int, float) or not (
    math.isfinite(reward) and abs(reward) <= _FLOAT32_MAX
  ):
    return None, f"reward {reward!r} is not a number finite in float32"
  if type(done) is not bool:
    return None, f"done is {type(done).__name__}, not bool"
  if not worker.is_json_data(state):
    return None, "state is not JSON data"
  if info is not None and not (
    type(info) is dict and all(type(v) in (int, float) and math.isfinite(v) for v in info.values())
  ):
    return None, "info is not a dict of finite numbers"
  return EnvResult(obs, float(reward), done, state, "", info), ""


class EnvRunner:
  """Runs an environment's resets and steps, batched, in the verifier workers.

  Args:
    env_factory_or_rebuild: a `RebuildEnv` (what `tasks.get_task` puts in
      `task.environment`), an environment instance that pickles (a module-level
      class), or a module-level zero-argument factory of one.
    pool: the verifier pool (`verifiers.get_pool(...)`).
    timeout_s: limit of one call; past it the row fails as "timeout" and its
      worker is killed and replaced.
    batch_timeout_s: limit of one batch (default `2 * timeout_s`).
    max_observation_chars: longer observations are cut to this many
      characters (before wrapping), counted in "truncated".
    wrap: return observations as `observation_text(o)`; False for the raw text.
    alphabet: if given, an observation with a character outside it fails as
      "garbage" (a character tokenizer cannot encode it).
    check: load the environment in a worker now, so one that cannot reach a
      worker fails here, naming it.

  Raises:
    ValueError: the environment cannot reach a worker, or a bad argument.
  """

  def __init__(
    self,
    env_factory_or_rebuild: Any,
    pool: verifiers.VerifierPool,
    *,
    timeout_s: float,
    batch_timeout_s: float | None = None,
    max_observation_chars: int,
    wrap: bool = True,
    alphabet: str | None = None,
    check: bool = True,
  ):
    env = env_factory_or_rebuild
    if isinstance(env, worker.Rebuild):
      self._fn: Any = env
    elif hasattr(env, "reset") and hasattr(env, "step"):
      self._fn = _EnvCall(env)
    elif callable(env):
      self._fn = RebuildEnv(env, {}, getattr(env, "__name__", ""))
    else:
      raise ValueError(f"EnvRunner: {env!r} is neither an environment nor a factory of one.")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
      raise ValueError(f"EnvRunner: timeout_s must be finite and > 0, got {timeout_s}")
    if int(max_observation_chars) < 1:
      raise ValueError(
        f"EnvRunner: max_observation_chars must be >= 1, got {max_observation_chars}"
      )
    self.name = getattr(env, "name", "") or type(env).__name__
    self.pool = pool
    self.timeout_s, self.batch_timeout_s = float(timeout_s), batch_timeout_s
    self.max_observation_chars, self.wrap = int(max_observation_chars), wrap
    self.alphabet = None if alphabet is None else frozenset(alphabet)
    self._stats: dict[str, float] = {**dict.fromkeys(_COUNTERS, 0), "seconds": 0.0}
    self._lock = threading.Lock()
    self.errors: tuple[str, ...] = ()
    if check:
      pool.check(self._fn, self.name, timeout_s=max(60.0, self.timeout_s))

  def reset(self, examples: Sequence[Any]) -> list[EnvResult]:
    """First answers of B episodes, `env.reset(examples[b])` in the workers."""
    return self._run([("reset", ex) for ex in examples])

  def step(self, states: Sequence[Any], actions: Sequence[str]) -> list[EnvResult]:
    """Answers to B policy turns, `env.step(states[b], actions[b])` in the workers."""
    if len(states) != len(actions):
      raise ValueError(f"states ({len(states)}) and actions ({len(actions)}) differ in length.")
    return self._run([("step", s, str(a)) for s, a in zip(states, actions, strict=True)])

  def stats(self) -> dict[str, float]:
    """Counters since the runner was made, for logs.

    Returns:
      `calls` (rows sent), `failures` (rows that failed) and by kind
      `timeouts`, `errors`, `garbage`, `crashes`; `truncated` observations;
      worker `restarts`; `seconds` in `reset` and `step`, summed over the threads that
      call them (the async sampler's threads: more than the wall clock).
    """
    return dict(self._stats)

  def _run(self, args: list[tuple]) -> list[EnvResult]:
    if not args:
      return []
    start = time.monotonic()
    res = self.pool.call(self._fn, args, self.timeout_s, self.batch_timeout_s)
    errors = list(res.errors)
    out = []
    with self._lock:  # the async sampler's threads share the counters (`verifiers.lane`)
      for i, o in enumerate(res.outcomes):
        r, why = (None, o.error) if o.failure else _check_result(o.value)
        if r is not None:
          r, why = self._observation(r)
        if r is None:
          failure = o.failure or verifier_results.GARBAGE
          self._stats[_COUNTER[failure]] += 1
          self._stats["failures"] += 1
          if not o.failure and len(errors) < 5:
            errors.append(f"row {i}: {why}")
          r = failed(failure)
        out.append(r)
      self._stats["calls"] += len(args)
      self._stats["restarts"] += res.restarts
      self._stats["seconds"] += time.monotonic() - start
      self.errors = tuple(errors)
    return out

  def _observation(self, r: EnvResult) -> tuple[EnvResult | None, str]:
    obs = r.observation
    if len(obs) > self.max_observation_chars:
      obs = obs[: self.max_observation_chars]
      self._stats["truncated"] += 1
    if self.alphabet is not None and not self.alphabet.issuperset(obs):
      bad = sorted(set(obs) - self.alphabet)[:5]
      return None, f"observation has characters outside the alphabet: {bad!r}"
    return r._replace(observation=observation_text(obs) if self.wrap else obs), ""


__all__ = [
  "OBS_PREFIX",
  "TURN_END",
  "EnvResult",
  "EnvRunner",
  "Environment",
  "RebuildEnv",
  "failed",
  "observation_text",
]
