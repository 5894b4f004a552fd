"""The rollout half of `components`: reward, samplers, episodes, the rollout kind.

Part of the config's one reader (`components.build_components` calls these):
each function reads the fields it is named after and returns a frozen part of
the run's `StepFns`. `rollout_kind` is the one place the `protocol.Rollout`
kind of a run is chosen.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from offpolicy_jax.rewards import environments
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rollout import episode_pool, episodes, whole
from offpolicy_jax.rollout import partial as partial_rollout
from offpolicy_jax.rollout.protocol import Rollout
from offpolicy_jax.sampling import multiturn
from offpolicy_jax.sampling import partial as partial_rollouts
from offpolicy_jax.sampling import sampler as sampling
from offpolicy_jax.step import run_state


def recorded_logp(config) -> str:
  """What the sampler records (`rollout.behavior_logp`; "mismatched" records as "sampled")."""
  return "sampled" if config.rollout.behavior_logp == "mismatched" else config.rollout.behavior_logp


def reward(config, task) -> run_state.Reward:
  if config.multiturn.max_turns:  # the environment scores the episodes (`_episodes`)
    return run_state.Reward()
  if task.device_reward is not None:
    return run_state.Reward(device=jax.jit(task.device_reward))
  c = config
  pool = rewards.get_pool(c.reward_workers or None, c.reward_memory_mb, c.reward_sandbox)
  pool.check(task.reward, config.task)  # fails here if it cannot reach a worker
  return run_state.Reward(
    host=task.reward,
    pool=pool,
    timeout_s=config.reward_timeout,
    batch_timeout_s=config.reward_batch_timeout or None,
  )


def partial_sampler(config, graphdef, task, tokenizer) -> partial_rollouts.PartialSampler | None:
  """The partial-rollout sampler of `config.rollout.partial_budget` (None when 0)."""
  c, budget = config, config.rollout.partial_budget
  if not budget or c.multiturn.max_turns:  # episodes: `rollout.episode_pool`, built by the loop
    return None
  if task.device_reward is None:
    raise ValueError(
      f"config.rollout.partial_budget: partial rollouts need a task with a device reward; "
      f"{c.task!r} is scored on the host"
    )
  advance = partial_rollouts.make_advance(
    graphdef,
    max_new_tokens=c.max_new_tokens,
    budget=budget,
    group_size=c.group_size,
    temperature=c.temperature,
    top_p=c.top_p,
    top_k=c.top_k,
    eos_id=tokenizer.eos_id,
    behavior_logp=recorded_logp(c),
  )
  slots = partial_rollouts.steps_to_finish(c.max_new_tokens, budget) * c.prompts_per_step
  return partial_rollouts.PartialSampler(advance, slots, c.group_size, c.max_new_tokens)


def episodes_of(config, task, tokenizer, graphdef, sampler_graphdef) -> episodes.Episodes | None:
  """The multi-turn rollout parts of `config.multiturn.max_turns` (None when 0)."""
  c, mt = config, config.multiturn
  if not mt.max_turns:
    return None
  if task.environment is None:
    raise ValueError(
      f"config.multiturn.max_turns: task {c.task!r} has no environment to answer turns "
      "(set multiturn.max_turns = 0, or pick a multi-turn task such as guess_number or "
      "calculator)"
    )
  if jax.process_count() > 1:
    raise ValueError("config.multiturn.max_turns: multi-turn episodes run in one process")
  chat = task.use_chat_template and getattr(tokenizer, "chat_template", None) is not None
  fmt = episodes.turn_format(tokenizer, chat)
  pool = rewards.get_pool(c.reward_workers or None, c.reward_memory_mb, c.reward_sandbox)
  runner = environments.EnvRunner(
    task.environment,
    pool,
    timeout_s=c.reward_timeout,
    batch_timeout_s=c.reward_batch_timeout or None,
    # Characters are at least tokens; the token cap applies after encoding.
    max_observation_chars=8 * mt.observation_tokens,
    wrap=not chat,  # a chat template frames observations itself
    alphabet=getattr(tokenizer, "alphabet", None),
  )

  @functools.lru_cache(maxsize=4)
  def make_sampler(group_size: int, greedy: bool) -> multiturn.MultiTurnSampler:
    return multiturn.MultiTurnSampler(
      graphdef if greedy else sampler_graphdef,
      max_new_tokens=c.max_new_tokens,
      turn_tokens=mt.turn_tokens or c.max_new_tokens,
      max_turns=mt.max_turns,
      observation_tokens=mt.observation_tokens,
      group_size=group_size,
      temperature=0.0 if greedy else c.temperature,
      top_p=c.top_p,
      top_k=c.top_k,
      eos_id=fmt.eos_id,
      turn_end=fmt.turn_end,
      behavior_logp=recorded_logp(c),
      decode_block=c.rollout.decode_block,
    )

  return episodes.Episodes(
    make_sampler,
    runner,
    fmt,
    mt.observation_tokens,
    credit=mt.credit,
    gamma=mt.gamma,
    partial_budget=c.rollout.partial_budget,
  )


def rollout_kind(config, task, sampler, partial, eps, score_old, mesh, sizes) -> Rollout:
  """The run's rollout kind (`rollout.protocol`): the one place the kind is chosen."""
  c = config
  fields = {
    "prompt_tokens": ((c.max_prompt_len,), np.int32),
    "prompt_lengths": ((), np.int32),
    "answer_tokens": ((task.max_answer_len + 1,), np.int32),  # `data.prompt_iterator`'s
  }
  if eps is not None and c.rollout.partial_budget:
    budget = c.rollout.partial_budget
    return episode_pool.EpisodePool(eps, task, sizes, budget, fields, score_old)
  if eps is not None:
    return episodes.WholeEpisodes(eps, task, c.group_size, score_old)
  if partial is not None:
    return partial_rollout.Partial(partial, fields, mesh, score_old)
  return whole.Whole(sampler, score_old)


def eval_sampler(graphdef, sample_kw: dict, temperature: float, k: int) -> sampling.Sampler:
  """Evaluation's sampler: greedy for k = 1, else k samples per prompt at `temperature`."""
  if k == 1:
    return sampling.make_sampler(graphdef, group_size=1, temperature=0.0, **sample_kw)
  return sampling.make_sampler(graphdef, group_size=k, temperature=temperature, **sample_kw)


def check_routing_replay(c, model_config) -> None:
  """Refuses `rollout.routing_replay` where nothing records routing, naming the field."""
  mode = c.rollout.routing_replay
  if mode == "off":
    return
  if not model_config.num_experts:
    raise ValueError(
      f"rollout.routing_replay={mode!r}: model {c.model!r} has no experts to route "
      "(a mixture of experts such as tiny-moe; or rollout.routing_replay='off')"
    )
  others = (
    ("rollout.continuous_slots", c.rollout.continuous_slots),
    ("rollout.partial_budget", c.rollout.partial_budget),
    ("multiturn.max_turns", c.multiturn.max_turns),
  )
  for field, value in others:
    if value:
      raise ValueError(
        f"rollout.routing_replay={mode!r}: the sampler of {field}={value} does not record "
        f"routing (only the static sampler does); set {field}=0 or rollout.routing_replay='off'"
      )
