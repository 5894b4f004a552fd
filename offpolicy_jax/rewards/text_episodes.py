"""Multi-turn episodes as text: played with a host policy, split into turns, encoded, replayed.

The text conventions (`TURN_END`, `OBS_PREFIX`) are those of `rewards.environments`:
`split_turns` reads them back, `encode_turns` encodes an episode turn by turn as
the multi-turn sampler does, `replay_reward` scores an episode text against its
environment, `play` runs episodes through an `EnvRunner` with a host policy, and
`episode_stats` summarises the last results of episodes for logs.
"""

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from offpolicy_jax.rewards.environments import OBS_PREFIX, TURN_END, EnvResult, EnvRunner

_LINE = re.compile(r"[^\n]*\n|[^\n]+$")


def split_turns(text: str) -> list[tuple[str, str]]:
  """`text` (policy turns and wrapped observations) as `("policy" | "env", line)` turns.

  A line that starts with `OBS_PREFIX` is an observation; every other line is a
  policy turn; each keeps its `TURN_END` (the last line may lack it).
  """
  lines = _LINE.findall(text)
  return [("env" if line.startswith(OBS_PREFIX) else "policy", line) for line in lines]


class Episodes(NamedTuple):
  """B episodes played by `play`.

  Attributes:
    texts: each episode after its prompt: policy turns and observations, as
      the sampler's token rows hold them.
    returns: the summed rewards of each episode.
    finals: the last `EnvResult` of each episode (`episode_stats` reads them).
    truncated: True where the episode hit `max_turns` before `done`.
  """

  texts: list[str]
  returns: list[float]
  finals: list[EnvResult]
  truncated: list[bool]


def play(
  runner: EnvRunner,
  examples: Sequence[Any],
  policy: Callable[[list[int], list[str]], list[str]],
  max_turns: int,
) -> Episodes:
  """Plays B episodes with a host policy: the multi-turn loop on text, for scripts and tests.

  Each round asks `policy(rows, texts)` for the next turn of every episode
  still running (`rows` their indices in `examples`, `texts` their episodes so
  far), appends it (with `TURN_END` if it lacks one) and the environment's
  observation, and steps only those episodes; an episode ends at `done` or
  after `max_turns` policy turns. The sampler does the same on tokens.

  Args:
    runner: the environment's runner.
    examples: B examples.
    policy: `policy(rows, texts) -> actions`, one action per row.
    max_turns: policy turns per episode at most.

  Returns:
    Episodes.
  """
  finals = runner.reset(examples)
  texts = [r.observation for r in finals]
  returns = [r.reward for r in finals]
  active = [b for b, r in enumerate(finals) if not r.done]
  for _ in range(max_turns):
    if not active:
      break
    actions = [
      a if a.endswith(TURN_END) else a + TURN_END
      for a in policy(active, [texts[b] for b in active])
    ]
    if len(actions) != len(active):
      raise ValueError(f"policy returned {len(actions)} actions for {len(active)} episodes.")
    out = runner.step([finals[b].state for b in active], actions)
    for b, action, r in zip(active, actions, out, strict=True):
      texts[b] += action + r.observation
      returns[b] += r.reward
      finals[b] = r
    active = [b for b in active if not finals[b].done]
  truncated = [not r.done for r in finals]
  return Episodes(texts, returns, finals, truncated)


def episode_stats(finals: Sequence[EnvResult]) -> dict[str, float]:
  """Episode metrics for logs, from the last `EnvResult` of each episode.

  Returns:
    `episodes`; `solved` (episodes whose `info["solved"]` is true) and
    `success_rate`; `failed` (episodes that ended on a failure); for every
    other number `k` of the infos, `k` (its mean over the episodes) and
    `k_per_solved` (its sum over solved episodes / `solved`; 0 if none),
    e.g. `tool_calls_per_solved`.
  """
  n = len(finals)
  infos = [r.info or {} for r in finals]
  solved = [bool(i.get("solved")) for i in infos]
  num_solved = sum(solved)
  out = {
    "episodes": float(n),
    "solved": float(num_solved),
    "success_rate": num_solved / n if n else 0.0,
    "failed": float(sum(bool(r.failure) for r in finals)),
  }
  keys = sorted({k for i in infos for k in i if k != "solved"})
  for k in keys:
    values = [float(i.get(k, 0.0)) for i in infos]
    out[k] = sum(values) / n
    out[f"{k}_per_solved"] = sum(v for v, s in zip(values, solved, strict=True) if s) / max(
      num_solved, 1
    )
  return out


def encode_turns(
  encode: Callable[[str], list[int]], turns: Sequence[tuple[str, str]]
) -> tuple[list[int], list[int]]:
  """Token ids of an episode's turns and its policy mask, each turn encoded on its own.

  Encoding turn by turn (never the joined text) gives the ids a multi-turn
  sampler produces: its policy tokens end at the turn's stop text and each
  observation is encoded by itself, so a warm start on demonstrations
  trains on the same token boundaries as the rollouts.

  Args:
    encode: `tokenizer.encode` (text -> ids, no special tokens added).
    turns: `[(role, text), ...]` as `Task.demonstration` returns them.

  Returns:
    `(ids, mask)`: the concatenated ids, and 1 on the ids of "policy" turns, 0 elsewhere.
  """
  ids: list[int] = []
  mask: list[int] = []
  for role, text in turns:
    t = list(encode(text))
    ids += t
    mask += [int(role == "policy")] * len(t)
  return ids, mask


def replay_reward(example: Any, text: str, *, env: Any) -> float:
  """The summed reward of the episode `text` replays against `env` (a task's host reward).

  The policy turns of `text` (`split_turns`; observations written in it are
  ignored) are stepped through `env` from `env.reset(example)` until it is
  done. So a whole episode written as one text (a demonstration, a sample
  that wrote its own observations) is scored by the environment itself. It
  runs where a task's reward runs: in a verifier worker.
  """
  res = env.reset(example)
  total, state = float(res.reward), res.state
  for role, turn in split_turns(text):
    if res.done:
      break
    if role == "policy":
      res = env.step(state, turn)
      total, state = total + float(res.reward), res.state
  return total


__all__ = [
  "Episodes",
  "encode_turns",
  "episode_stats",
  "play",
  "replay_reward",
  "split_turns",
]
