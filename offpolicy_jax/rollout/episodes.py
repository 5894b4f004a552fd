"""Multi-turn episodes: the run's rollout when its task has an environment.

With `multiturn.max_turns > 0` a rollout is an episode per row: the policy
writes a turn (`sampling.multiturn`), the task's environment answers it in
the sandboxed verifier workers (`rewards.environments.EnvRunner`: never in
this process), and the answer's tokens are appended to the row's trajectory
and to its KV cache, until the environment says done or a limit is reached.
Everything after that is the single-turn pipeline: one row per trajectory,
whose `mask` is 1 on the policy's tokens only (observation tokens carry no
loss, ratio, KL, entropy or token count), per-token behaviour log-probs and
versions, packed and learnt from like any batch (`WholeEpisodes`, a `protocol.Rollout`).

Token in, token out. A trajectory's tokens are the sampled ones and the
observation tokens exactly as appended: nothing is decoded and re-encoded
between turns. Only what crosses the process boundary is text: a turn's
tokens are decoded for the environment, and its observation is encoded once.

Turn formats (`turn_format`):
  plain  (character / raw-text tasks) a policy turn ends with
         `environments.TURN_END`; the observation text is appended as is
         (it starts with `environments.OBS_PREFIX` and ends with TURN_END).
  chat   (tokenizers with a chat template, `Task.use_chat_template`) a policy
         turn is an assistant message ending with the template's end-of-turn
         token (the tokenizer's EOS); the observation is appended as the
         template renders a user message after it, followed by the generation
         prompt of the next assistant message. So the final trajectory is the
         template's rendering of the whole conversation (a test checks it).

Credit (`multiturn.credit`): `trajectory` (default) sums each trajectory's
environment rewards, and advantages are group-relative over the K
trajectories of a prompt (the task's advantage estimator, as for single-turn
rows). `turn` keeps the reward paid after each turn, [B, max_turns], and
gives every token of turn t the discounted sum (`multiturn.gamma`) of the
group-relative rewards of turns t, t+1, ... (`advantages.per_turn`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import types
from offpolicy_jax.rewards import environments, tasks
from offpolicy_jax.rollout import data, protocol
from offpolicy_jax.rollout.protocol import Finished, Rollout, Stateless, pi_old
from offpolicy_jax.sampling import SampleOutput

# Per-step episode statistics (every metrics row of a multi-turn run carries them).
EPISODE_STATS = (
  "episode/turns",
  "episode/solved",
  "episode/tool_calls",
  "episode/tool_calls_per_solved",
  "episode/observation_tokens",
  "episode/observations_cut",
  "episode/env_failures",
  "episode/env_s",
)


class TurnFormat(NamedTuple):
  """How turns meet tokens (module docstring).

  Attributes:
    name: "plain" or "chat".
    turn_end: token sequences that end a policy turn.
    eos_id: the token that ends an episode from the policy's side, or None
      (chat: the end-of-turn token is the EOS, so only the environment ends it).
    action_text: a turn's token ids -> the text the environment reads.
    observation: an observation's text -> its token ids (`reply` adds what a cut turn lacks).
  """

  name: str
  turn_end: tuple[tuple[int, ...], ...]
  eos_id: int | None
  action_text: Callable[[Sequence[int]], str]
  observation: Callable[[str], list[int]]

  def reply(self, action: Sequence[int], text: str) -> list[int]:
    """The tokens appended after a policy turn `action` (ids): its observation `text`.

    A turn cut by its token budget has no turn end; the turn end is written
    first, so the trajectory stays a well-formed transcript (in the chat
    format: the template's rendering of the conversation).
    """
    ids = [int(t) for t in action]
    ended = any(len(e) <= len(ids) and tuple(ids[len(ids) - len(e) :]) == e for e in self.turn_end)
    return ([] if ended else list(self.turn_end[0])) + self.observation(text)


def turn_format(tokenizer: Any, chat: bool) -> TurnFormat:
  """The turn format of a tokenizer: `chat` renders turns with its chat template."""
  if not chat:
    end = tuple(tokenizer.encode(environments.TURN_END))

    def plain_action(ids: Sequence[int]) -> str:
      text = tokenizer.decode(ids)
      return text[: -len(environments.TURN_END)] if text.endswith(environments.TURN_END) else text

    return TurnFormat("plain", (end,), tokenizer.eos_id, plain_action, tokenizer.encode)
  if tokenizer.eos_id is None:
    raise ValueError("a chat-template turn format needs the tokenizer's end-of-turn (EOS) token")
  eos_text = getattr(tokenizer, "eos_token", None)
  if not eos_text:
    raise ValueError("a chat-template turn format needs the text of the tokenizer's EOS token")
  probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
  before = tokenizer.apply_chat_template(probe, add_generation_prompt=False)
  cut = before.rfind(eos_text)
  if cut < 0:
    raise ValueError(
      f"the chat template does not end an assistant message with the EOS token {eos_text!r}"
    )
  cut += len(eos_text)

  def chat_observation(text: str) -> list[int]:
    msgs = [*probe, {"role": "user", "content": text}]
    after = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    if not after.startswith(before[:cut]):
      raise ValueError("the chat template renders earlier turns differently after a new one")
    return tokenizer.encode(after[cut:])

  def chat_action(ids: Sequence[int]) -> str:
    return tokenizer.decode(ids)  # stops at the EOS

  eos = int(tokenizer.eos_id)
  return TurnFormat("chat", ((eos,),), None, chat_action, chat_observation)


@dataclasses.dataclass(frozen=True, eq=False)
class Episodes:
  """The static parts of a run's multi-turn rollouts (`components` builds it).

  Attributes:
    make_sampler: `(group_size, greedy) -> sampling.multiturn.MultiTurnSampler`,
      memoised (the behaviour sampler is `make_sampler(K, False)`).
    runner: the environment in the verifier workers.
    fmt: the turn format.
    observation_tokens: the longest observation kept, in tokens.
    credit: "trajectory" or "turn" (module docstring).
    gamma: the per-turn discount of `turn` credit.
    partial_budget: policy tokens per trajectory per loop step, episodes
      carried across steps (`rollout.episode_pool`); 0: whole episodes.
  """

  make_sampler: Callable[[int, bool], Any]
  runner: environments.EnvRunner
  fmt: TurnFormat
  observation_tokens: int
  credit: str = "trajectory"
  gamma: float = 1.0
  partial_budget: int = 0


class Played(NamedTuple):
  """A batch of episodes: the trajectories, their rewards and statistics.

  Attributes:
    out: `SampleOutput` [B, N], `mask` on policy tokens only.
    rewards: float32 [B] summed environment rewards.
    turn_rewards: float32 [B, max_turns] the reward paid after each turn (a
      reward of the reset counts for turn 0), NaN for turns not taken.
    turns: int32 [B] policy turns of each trajectory.
    tool_calls: int32 [B] tool calls the environment counted (0 if it does not).
    failures: int32 [B] environment calls that failed (timeout, error, garbage).
    stats: host statistics (`scoring.REWARD_STATS` keys and `EPISODE_STATS`).
  """

  out: SampleOutput
  rewards: np.ndarray
  turn_rewards: np.ndarray
  turns: np.ndarray
  tool_calls: np.ndarray
  failures: np.ndarray
  stats: dict[str, Any]


class Turns:
  """The `respond` callback of a set of rows: steps their environments, keeps their records.

  Rows are reset by `reset` (the environment's first answer); the partial-rollout
  pool (`rollout.episode_pool`) resets the rows of each admitted group and keeps
  the records of the others across loop steps.
  """

  def __init__(self, ep: Episodes, rows: int, max_turns: int):
    self.ep = ep
    self.rewards = np.zeros(rows, np.float64)
    self.turn_rewards = np.zeros((rows, max(max_turns, 1)), np.float64)
    self.failures = np.zeros(rows, np.int32)
    self.tool_calls = np.zeros(rows, np.int32)
    self.dead = np.zeros(rows, bool)
    self.states: list[Any] = [None] * rows
    self.cut = 0
    self.obs_tokens = 0
    self.timeouts = 0
    self.env_s = 0.0  # seconds the environments took to answer

  def clear(self) -> None:
    """Zeroes the counters of cut observations, observation tokens, timeouts and env seconds."""
    self.cut = self.obs_tokens = self.timeouts = 0
    self.env_s = 0.0

  def reset(self, rows: Sequence[int] | np.ndarray, examples: Sequence[dict[str, Any]]) -> None:
    """Starts the episodes of `rows` on `examples` (one each)."""
    begin = time.perf_counter()
    first = self.ep.runner.reset(list(examples))
    self.env_s += time.perf_counter() - begin
    for i, r in zip(rows, first, strict=True):
      for records in (self.rewards, self.turn_rewards, self.failures, self.tool_calls, self.dead):
        records[i] = 0
      self.states[i] = r.state
      self._record(i, r, 0)

  def _record(self, i: int, r: environments.EnvResult, turn: int) -> None:
    if r.failure:
      self.failures[i] += 1
      self.timeouts += r.failure == "timeout"
      self.dead[i] = True
      return
    self.rewards[i] += r.reward
    self.turn_rewards[i, min(turn, self.turn_rewards.shape[1] - 1)] += r.reward
    calls = (r.info or {}).get("tool_calls")
    if isinstance(calls, int | float) and not isinstance(calls, bool):
      self.tool_calls[i] = int(calls)

  def __call__(self, turn: int, rows: np.ndarray, actions: list[np.ndarray], final: bool):
    ids = [int(r) for r in rows]
    live = [r for r in ids if not self.dead[r]]
    actions_of = {r: a.tolist() for r, a in zip(ids, actions, strict=True)}
    texts = {r: self.ep.fmt.action_text(a) for r, a in actions_of.items()}
    begin = time.perf_counter()
    results = self.ep.runner.step([self.states[r] for r in live], [texts[r] for r in live])
    self.env_s += time.perf_counter() - begin
    replies: dict[int, tuple[np.ndarray, bool]] = {}
    for r, res in zip(live, results, strict=True):
      self._record(r, res, turn)
      done = bool(res.done) or final or bool(res.failure)
      self.states[r] = res.state
      obs = np.zeros(0, np.int32)
      if not done:
        obs_ids = self.ep.fmt.reply(actions_of[r], res.observation)
        if len(obs_ids) > self.ep.observation_tokens:
          self.cut += 1
          obs_ids = obs_ids[: self.ep.observation_tokens]
        obs = np.asarray(obs_ids, np.int32)
        self.obs_tokens += len(obs_ids)
      replies[r] = (obs, done)
    return [replies.get(r, (np.zeros(0, np.int32), True)) for r in ids]


def play(
  ep: Episodes,
  params,
  prompts: dict[str, Any],
  key: jax.Array,
  *,
  task: tasks.Task,
  split: str,
  group_size: int,
  greedy: bool = False,
  update_params: Callable[[int], Any] | None = None,
) -> Played:
  """Plays one episode per row: G prompts x `group_size` trajectories.

  Args:
    ep: the run's `Episodes`.
    params: the whole model state to sample with.
    prompts: `prompt_tokens` [G, P], `prompt_lengths` [G] and `index` [G].
    key: the sampling key.
    task, split: where the prompts' source examples are (`index`): their
      environments' input.
    group_size: K trajectories per prompt.
    greedy: decode greedily (evaluation) instead of the behaviour sampler.
    update_params: `turn -> params | None`, asked before every turn but the
      first: newer parameters the episodes continue under
      (`MultiTurnSampler`).
  """
  t0 = time.perf_counter()
  examples = data.examples(task, split, np.asarray(prompts["index"]).tolist())
  rows = [ex for ex in examples for _ in range(group_size)]
  sampler = ep.make_sampler(group_size, greedy)
  turns_cb = Turns(ep, len(rows), sampler.max_turns)
  turns_cb.reset(range(len(rows)), rows)
  out, info = sampler(
    params,
    prompts["prompt_tokens"],
    prompts["prompt_lengths"],
    key,
    turns_cb,
    update_params=update_params,
  )
  turns = np.asarray(info.turns, np.int32)
  rows_all = np.arange(len(rows))
  stats = episode_stats(ep, turns_cb, rows_all, turns, time.perf_counter() - t0)
  rewards, turn_rewards = trajectory_rewards(turns_cb, rows_all, turns)
  calls = turns_cb.tool_calls
  return Played(out, rewards, turn_rewards, turns, calls, turns_cb.failures, stats)


def trajectory_rewards(turns_cb: Turns, rows: np.ndarray, turns: np.ndarray):
  """`(rewards [R], turn_rewards [R, max_turns])` of `rows` that took `turns` [R] turns.

  Turns a trajectory did not take are NaN in `turn_rewards` (`advantages.per_turn`).
  """
  rewards = turns_cb.rewards[rows].astype(np.float32)
  per_turn = turns_cb.turn_rewards[rows]
  taken = np.arange(per_turn.shape[1])[None, :] < np.maximum(turns[:, None], 1)
  return rewards, np.where(taken, per_turn, np.nan).astype(np.float32)


def episode_stats(ep: Episodes, turns_cb: Turns, rows: np.ndarray, turns, seconds: float):
  """Host statistics (`scoring.REWARD_STATS`, `EPISODE_STATS`) of the finished `rows`.

  The counters of observations and timeouts are `turns_cb`'s since its last
  `clear` (the calls of this batch or loop step).
  """
  rewards = turns_cb.rewards[rows]
  solved = rewards > 0.5
  calls = turns_cb.tool_calls[rows]
  failures = turns_cb.failures[rows]
  b = max(len(rows), 1)
  counts = ep.runner.stats()
  return {
    "reward_failures": int(failures.sum()),
    "reward_timeouts": int(turns_cb.timeouts),
    "reward_worker_restarts": int(counts.get("restarts", 0)),
    "reward_time_s": seconds,
    "episode/turns": float(np.mean(turns)) if len(rows) else 0.0,
    "episode/solved": float(solved.mean()) if len(rows) else 0.0,
    "episode/tool_calls": float(calls.sum() / b),
    "episode/tool_calls_per_solved": float(calls[solved].mean()) if solved.any() else 0.0,
    "episode/observation_tokens": turns_cb.obs_tokens / b,
    "episode/observations_cut": int(turns_cb.cut),
    "episode/env_failures": int(failures.sum()),
    "episode/env_s": float(turns_cb.env_s),
  }


@dataclasses.dataclass(frozen=True, eq=False)
class WholeEpisodes(Stateless, Rollout):
  """Multi-turn episodes played to their end within the step (`protocol.Rollout`, host).

  Each row plays one episode against the task's environment in the verifier
  workers (`play`); the environment's rewards come with the rows
  (`Finished.rewards`: [B], or [B, max_turns] under turn credit). With
  `latest` (async mode) an episode continues under parameters published
  while it runs: every policy token records the version that drew it, and
  with `rollout.score_old` is scored at that version (`protocol.pi_old`).

  Attributes:
    ep: the run's `Episodes`.
    task: the task (the prompts' source examples are the environments' input).
    group_size: K trajectories per prompt.
    score_old: the learner's scorer of log pi_old, or None.
  """

  ep: Episodes
  task: tasks.Task
  group_size: int
  score_old: Callable | None = None
  traced = False
  prefetch = False

  def with_sampler(self, sampler) -> Rollout:
    raise protocol.own_sampler("multi-turn episodes (multiturn.max_turns)")

  def advance(self, rstate, params, version, prompts, step, key, latest=None):
    """Plays the step's episodes from `params` at `version` (newer `latest()` ones mid-way)."""
    del step
    if jax.process_count() > 1:
      raise ValueError("multiturn.max_turns: multi-turn episodes run in one process")
    used = [(params, int(version))]
    turn_version = [int(version)]

    def update(turn: int):
      del turn  # every row takes turn t together: the version of turn t is appended here
      newer = None
      p, v = latest()
      if int(v) > used[-1][1]:
        used.append((p, int(v)))
        newer = p
      turn_version.append(used[-1][1])
      return newer

    played = play(
      self.ep,
      params,
      prompts,
      key,
      task=self.task,
      split="train",
      group_size=self.group_size,
      update_params=update if latest is not None else None,
    )
    out = played.out
    if len(used) == 1:
      versions = np.full(out.tokens.shape, int(version), np.int32)
    else:
      turn = np.asarray(types.turn_ids(out.mask))
      versions = np.asarray(turn_version, np.int32)[np.minimum(turn, len(turn_version) - 1)]
    if self.score_old is not None:
      old = pi_old(self.score_old, used, prompts, out, jnp.asarray(versions))
      out = out._replace(old_logprobs=old)
    rewards = played.turn_rewards if self.ep.credit == "turn" else played.rewards
    stats = dict(played.stats)
    stats["sampler/decode_waste"] = protocol.decode_waste(out.mask)
    if latest is not None:
      stats["episode/parameter_updates"] = len(used) - 1
    fin = Finished(prompts, out, jnp.asarray(versions), rewards=jnp.asarray(rewards))
    return rstate, fin, stats


def describe(played: Played, tokenizer: Any, row: int) -> str:
  """One trajectory as JSON text (for logs and debugging): its tokens decoded per segment."""
  out = played.out
  n = int(out.lengths[row])
  ids, mask = np.asarray(out.tokens[row, :n]), np.asarray(out.mask[row, :n]) > 0
  segments, start = [], 0
  for t in range(1, n + 1):
    if t == n or mask[t] != mask[start]:
      role = "policy" if mask[start] else "environment"
      segments.append({role: tokenizer.decode(ids[start:t].tolist())})
      start = t
  return json.dumps({"reward": float(played.rewards[row]), "turns": segments})
