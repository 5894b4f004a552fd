"""Tasks: a prompt source, a prompt template and a reward.

  task = tasks.get_task("reverse")                            # synthetic, on-device reward
  task = tasks.get_task("reasoning_gym:basic_arithmetic")     # any reasoning-gym dataset
  task = tasks.get_task("gsm8k", train_path="train.jsonl", eval_path="test.jsonl")
  task = tasks.get_task("calculator", kind="mul")              # multi-turn, task.environment

New tasks: build a `Task` (any grain RandomAccessDataSource of dicts, a prompt
function and a host reward; optionally an answer and a jittable device reward)
and `register("my_task", factory)` so configs can name it.
"""

import dataclasses
import functools
import pickle
from collections.abc import Callable

from offpolicy_jax.rewards import environments
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards.tasks import agentic, code, math_data, rgym, synthetic
from offpolicy_jax.rewards.tasks.base import ListSource, Task

_RG_PREFIX = "reasoning_gym:"
_REGISTRY: dict[str, Callable[..., Task]] = {
  **{name: functools.partial(synthetic.make_task, name) for name in synthetic.NAMES},
  "gsm8k": functools.partial(math_data.make_task, "gsm8k"),
  "math": functools.partial(math_data.make_task, "math"),
  **{name: functools.partial(code.make_task, name) for name in code.KINDS},
  **agentic.FACTORIES,
}


def task_names() -> list[str]:
  """Registered task names (`reasoning_gym:<dataset>` accepts any reasoning-gym dataset)."""
  return [*_REGISTRY, _RG_PREFIX + "<dataset_name>"]


def register(name: str, factory: Callable[..., Task]) -> None:
  """Makes `get_task(name, **kwargs)` return `factory(**kwargs)`."""
  if name in _REGISTRY or name.startswith(_RG_PREFIX):
    raise ValueError(f"task name {name!r} is already taken.")
  _REGISTRY[name] = factory


def get_task(name: str, **kwargs) -> Task:
  """Builds a task by name; `kwargs` go to the task's factory.

  Args:
    name: one of `task_names()`.
    **kwargs: synthetic: seed, num_eval, partial_credit, max_digits, min_len,
      max_len; reasoning_gym: seed, train_size, eval_size, instruction,
      max_attempts, attempt_penalty, prompt_format, chat, distractor_format,
      lowercase, dataset config fields; gsm8k/math:
      train_path, eval_path, format_coef, instruction; code: seed, num_eval,
      partial_credit, num_shown, num_hidden, max_value; mbpp/humaneval:
      train_path, eval_path, partial_credit, instruction; guess_number: seed,
      hi, max_turns, turn_penalty; calculator: seed, num_eval, kind, num_terms,
      max_turns, max_expr_chars, tool_latency_ms, tool_latency_sigma, tool_latency_max_ms.

  Returns:
    The Task; its `reward` is a `rewards.SandboxedReward` (scored in sandboxed
    verifier workers, also when called directly); a multi-turn task's
    `environment` is an instance that pickles or an `environments.RebuildEnv`
    (run by an `environments.EnvRunner` in the same workers).

  Raises:
    ValueError: unknown task name or bad kwargs (missing or malformed data files
      included, naming the file and row).
  """
  factory: Callable[..., Task]
  if name.startswith(_RG_PREFIX):
    factory = functools.partial(rgym.make_task, name[len(_RG_PREFIX) :])
  elif name in _REGISTRY:
    factory = _REGISTRY[name]
  else:
    raise ValueError(f"unknown task {name!r}; expected one of {task_names()}.")
  try:
    task = factory(**kwargs)
  except TypeError as e:  # unexpected keyword
    raise ValueError(f"task {name!r}: {e}") from e
  return _sandboxed(task, name, factory, kwargs)


def _sandboxed(task: Task, name: str, factory: Callable[..., Task], kwargs: dict) -> Task:
  """`task` with its reward wrapped to run in verifier workers.

  A reward (or an environment) that pickles is sent as is; a closure (or an
  environment that does not pickle) is rebuilt in the worker from the
  (importable) factory and kwargs (`RebuildReward`, `environments.RebuildEnv`);
  `verifiers.VerifierPool.check` reports one that can be neither, naming the task.
  """
  if task.environment is not None and not isinstance(task.environment, environments.RebuildEnv):
    try:
      pickle.dumps(task.environment)
    except (pickle.PicklingError, TypeError, AttributeError):
      env = environments.RebuildEnv(factory, kwargs, name)
      task = dataclasses.replace(task, environment=env)
  if isinstance(task.reward, rewards.SandboxedReward):
    return task
  try:
    pickle.dumps(task.reward)
    ref = None
  except (pickle.PicklingError, TypeError, AttributeError):
    ref = rewards.RebuildReward(factory, kwargs, name)
  return dataclasses.replace(task, reward=rewards.SandboxedReward(task.reward, ref, name))


__all__ = ["ListSource", "Task", "get_task", "register", "task_names"]
