"""Multi-turn rollouts, token in / token out: policy turns interleaved with environment turns.

A trajectory is ONE row: its group's left-padded prompt (prefilled once per
group and shared by its K rows, as in `sampling.sampler`) followed by a
suffix of N slots holding, in order,

  policy turn 0 tokens, observation 0 tokens, policy turn 1 tokens, ...

The environment's answers enter the row as tokens, never as text: past turns
are not decoded and re-encoded, so the trained tokens are exactly the sampled
ones. The train step already scores the response causally over every suffix
slot (`models.sequence_logprobs` / `models.shared_prefix_logprobs`); the
observation slots get mask 0, log-prob 0 and kept 0, so they carry no loss,
ratio or token count, while the policy tokens after them are conditioned on
them exactly as when they were sampled.

Three jitted pieces, each compiled once per shape (start, turn, extend:
`sampling.turn_pieces`), are driven by a host loop (`MultiTurnSampler.__call__`).

Between turn and extend the host calls the environment,

  respond(turn, rows, actions, final) -> [(observation_tokens, done), ...]

once for the rows that can go on (final False) and once for the rows whose
episode ends whatever the environment says (final True: EOS, the last of
`max_turns`, or the budget used up); `rows` int [R] are the rows whose turn
just ended, `actions` their turns' token ids. An observation is truncated to
`observation_tokens` and to the row's remaining budget minus one slot (so a
row that goes on always has room for at least one more policy token); a row
with fewer than two free slots ends (final), and an empty observation ends
the episode, so consecutive turns are always separated by observation tokens
(`types.turn_ids`, the runs of policy tokens, are the turns); the
observation of a row whose episode ends (final, or done) is not appended.
Done rows cost no more decode steps: they are masked, and the loop of a turn
runs only as long as its longest live turn.

Keys. The token at suffix slot t of sample k of prompt g is drawn with
``sampling.continuous.row_keys(key, id_g, k, t)``: a row's tokens do not depend
on the other rows, on which rows are live or on the batch, so a group sampled
alone (same key and `prompt_ids`) gives the same tokens.

Exactness. Every policy token's behaviour log-prob is the teacher-forced
log-prob of the whole trajectory (prompt + suffix, observations included) at
the parameters that drew it (within float32 tolerance; `tests/test_multiturn.py`).
The parameters may change between turns (`update_params`, e.g. a newer
version under lag): the prompts' and rows' caches are then recomputed under
the new parameters before the next turn (`reencode`, one forward over every
row's history), never reused across versions: keys and values of older
parameters would make the next tokens' log-probs belong to no single version
(the argument of `sampling.partial`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax.sampling.sampler import SampleOutput
from offpolicy_jax.sampling.turn_pieces import MultiTurnState, TurnPieces

# Why an episode ended (`EpisodeInfo.end_reason`).
END_ENV = 0  # the environment answered done
END_EOS = 1  # the policy emitted EOS
END_TURNS = 2  # max_turns policy turns were taken
END_BUDGET = 3  # the row's suffix budget (max_new_tokens or max_lengths) was used up
END_REASONS = ("env", "eos", "turns", "budget")

# respond(turn, rows [R], actions (R arrays of token ids), final) -> R (observation, done) pairs.
Respond = Callable[[int, np.ndarray, list, bool], Sequence[tuple[np.ndarray, bool]]]


class EpisodeInfo(NamedTuple):
  """Per-trajectory record of a multi-turn rollout (rows as in `SampleOutput`).

  Attributes:
    turns: int32 [B] policy turns taken (>= 1).
    turn_ids: int32 [B, N] turn index (0-based) of each suffix slot: of the
      turn a policy token belongs to, and for an observation token of the
      turn it answers (so ids never decrease along a row); 0 on unfilled slots.
      The `turn_ids` of `losses.policy_loss` (`st_ppo`'s turn-level ratios).
    observation_mask: float32 [B, N] 1 on observation tokens.
    end_reason: int32 [B] why the episode ended, an index into `END_REASONS`
      (`END_ENV`, `END_EOS`, `END_TURNS`, `END_BUDGET`).
    observation_truncated: bool [B] some observation of the row was cut
      (to `observation_tokens` or to the remaining budget).
  """

  turns: jax.Array
  turn_ids: jax.Array
  observation_mask: jax.Array
  end_reason: jax.Array
  observation_truncated: jax.Array


class Rows(NamedTuple):
  """Host records of the rows of a multi-turn rollout (`MultiTurnSampler.advance` updates them).

  Attributes:
    limit: int32 [R] each row's suffix budget.
    done: bool [R] the episode has ended.
    reason: int32 [R] why it ended (`END_REASONS`; END_TURNS until it does).
    cut: bool [R] some observation of the row was truncated.
  """

  limit: np.ndarray
  done: np.ndarray
  reason: np.ndarray
  cut: np.ndarray

  @classmethod
  def fresh(cls, limit) -> Rows:
    limit = np.asarray(limit, np.int32)
    b = limit.shape[0]
    return cls(limit, np.zeros(b, bool), np.full(b, END_TURNS, np.int32), np.zeros(b, bool))


class MultiTurnSampler(TurnPieces):
  """Samples multi-turn trajectories, one row each (module docstring).

  Call: ``sampler(params, prompt_tokens [G, P], prompt_lengths [G], key, respond,
  max_lengths=None, prompt_ids=None) -> (SampleOutput, EpisodeInfo)``, rows
  group-major (row g * K + k). `SampleOutput`: tokens [B, N] (policy and
  observation tokens), logprobs (log mu of policy tokens, 0 elsewhere), mask
  (1 on policy tokens only), lengths (filled suffix slots, policy +
  observation), kept (0 off policy tokens). `max_lengths` int [B] caps each
  row's suffix (1 <= cap, clipped to N); `prompt_ids` int [G] are the ids the
  keys fold in (default 0..G-1). `update_params(turn) -> params | None`, called
  before every turn but the first, swaps in newer parameters mid-episode
  (None keeps the current ones): the caches are then recomputed under them
  (`reencode`), so every policy token's log-prob is exact under the
  parameters that drew it. All rows take turn t together, so the parameters
  of a policy token are those in effect at its `EpisodeInfo.turn_ids`.

  The jitted pieces are public for callers that drive the loop themselves:
  ``start(params, prompt_tokens, prompt_lengths, limit) -> MultiTurnState``,
  ``turn(params, state, key, ids_b, samples_b, quota_b) -> state`` (at most quota_b [R]
  tokens per row), ``advance(...)`` (the host loop of turns, below),
  ``extend(params, state, observations [B, O], counts [B], done [B]) -> state`` and
  ``reencode(params, state) -> state`` (the caches and logits under new parameters).
  Each instance compiles its own pieces: build one per run, not per call.
  """

  def _limits(self, max_lengths, b: int) -> np.ndarray:
    n = self.max_new_tokens
    if max_lengths is None:
      return np.full((b,), n, np.int32)
    limit = np.asarray(max_lengths)
    if limit.shape != (b,):
      raise ValueError(f"max_lengths must have shape ({b},) (G * K rows), got {limit.shape}")
    if np.any(limit < 1):
      raise ValueError(f"max_lengths must be >= 1, got {limit.tolist()}")
    return np.minimum(limit, n).astype(np.int32)

  @staticmethod
  def _observation(turn: int, row: int, answer, vocab: int) -> tuple[np.ndarray, bool]:
    """(tokens, done) of one `respond` answer, checked."""
    if not isinstance(answer, tuple | list) or len(answer) != 2:
      raise ValueError(
        f"respond (turn {turn}, row {row}) must answer (observation_tokens, done), got {answer!r}"
      )
    obs = np.asarray(answer[0])
    if obs.ndim != 1 or (obs.size and not np.issubdtype(obs.dtype, np.integer)):
      raise ValueError(
        f"respond (turn {turn}, row {row}): observation must be a 1-D array of token ids, "
        f"got dtype {obs.dtype} shape {obs.shape}"
      )
    if obs.size and (obs.min() < 0 or obs.max() >= vocab):
      raise ValueError(
        f"respond (turn {turn}, row {row}): observation token ids must be in [0, {vocab}), "
        f"got {obs.tolist()}"
      )
    return obs.astype(np.int32), bool(answer[1])

  def __call__(
    self,
    params,
    prompt_tokens,
    prompt_lengths,
    key: jax.Array,
    respond: Respond,
    max_lengths=None,
    prompt_ids=None,
    update_params: Callable[[int], object] | None = None,
  ) -> tuple[SampleOutput, EpisodeInfo]:
    """Samples K trajectories per prompt, calling `respond` after every turn (class docstring)."""
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    g, k = prompt_tokens.shape[0], self.group_size
    b = g * k
    limit = self._limits(max_lengths, b)
    ids = np.arange(g) if prompt_ids is None else np.asarray(prompt_ids, np.int32)
    if ids.shape != (g,):
      raise ValueError(f"prompt_ids must have shape ({g},), got {ids.shape}")
    ids_b = jnp.asarray(np.repeat(ids, k), jnp.int32)
    samples_b = jnp.asarray(np.tile(np.arange(k), g), jnp.int32)
    st = self.start(params, prompt_tokens, prompt_lengths, limit)
    rec = Rows.fresh(limit)
    st = self.advance(params, st, key, ids_b, samples_b, respond, rec, update_params=update_params)
    return _outputs(st, rec.reason, rec.cut)

  def advance(
    self,
    params,
    st: MultiTurnState,
    key: jax.Array,
    ids_b,
    samples_b,
    respond: Respond,
    rec: Rows,
    *,
    budget: int = 0,
    update_params: Callable[[int], object] | None = None,
  ) -> MultiTurnState:
    """Plays the rows not done until each is done or has decoded `budget` tokens here.

    Rounds of `turn`, `respond` and `extend`: in each round every row not done
    and within its budget decodes (the rest of) its turn; the rows whose turn
    ended are answered, grouped by their turn index, and their observations
    appended. `budget` 0 plays every episode to its end (then all rows take
    turn t in round t, and `update_params(t)` is asked before every round but
    the first). With a budget, a row that has used it pauses, possibly
    mid-turn, and a later call continues it (partial rollouts,
    `rollout.episode_pool`). `rec` (host records of the rows) is updated in place.
    """
    if budget > 0 and update_params is not None:
      raise ValueError(
        "advance: update_params needs whole episodes (budget 0): with a budget, rows are at "
        "different turns (new parameters go to the next call instead)"
      )
    b = rec.done.shape[0]
    vocab = st.logits.shape[1]
    quota = self.max_new_tokens if budget <= 0 else int(budget)
    used = np.zeros((b,), np.int64)
    pos = np.asarray(jax.device_get(st.pos))
    for round_ in itertools.count():
      active = ~rec.done & (used < quota)
      if not active.any():
        return st
      if round_ and update_params is not None:
        new_params = update_params(round_)
        if new_params is not None:
          params = new_params
          st = self.reencode(params, st)
      before = pos
      st = self.turn(params, st, key, ids_b, samples_b, np.where(active, quota - used, 0))
      pos, start, eos, tokens, ended, turns = jax.device_get(
        (st.pos, st.turn_start, st.eos, st.tokens, st.ended, st.turn)
      )
      used += pos - before
      # A row needs two free slots to go on (an observation token and a policy token):
      # with one, its next turn would follow its last one with no observation between.
      out_of_room = pos >= rec.limit - 1
      final = eos | out_of_room | (turns >= self.max_turns)
      obs = np.zeros((b, self.observation_tokens), np.int32)
      counts = np.zeros((b,), np.int32)
      rows = np.flatnonzero(active & ended)
      for is_final in (False, True):
        for turn in np.unique(turns[rows] - 1):
          sel = rows[(final[rows] == is_final) & (turns[rows] - 1 == turn)]
          if not sel.size:
            continue
          actions = [tokens[r, start[r] : pos[r]] for r in sel]
          answers = self._ask(respond, int(turn), sel, actions, is_final, vocab)
          for r, (o, env_done) in zip(sel, answers, strict=True):
            if is_final or env_done or o.size == 0:  # an empty observation ends the episode too
              rec.done[r] = True
              rec.reason[r] = _end_reason(eos[r], env_done or o.size == 0, out_of_room[r])
              continue
            c = min(o.size, self.observation_tokens, int(rec.limit[r] - pos[r] - 1))
            rec.cut[r] |= c < o.size
            obs[r, :c] = o[:c]
            counts[r] = c
      st = self.extend(params, st, obs, counts, rec.done.copy())
      pos = pos + counts
    raise AssertionError("unreachable")

  def _ask(self, respond, turn, rows, actions, final, vocab) -> list[tuple[np.ndarray, bool]]:
    """`respond`'s answers for `rows`, checked: [(observation tokens, done)]."""
    answers = list(respond(turn, rows, actions, final))
    if len(answers) != rows.size:
      raise ValueError(
        f"respond (turn {turn}) must answer each of its {rows.size} rows, got {len(answers)}"
      )
    return [
      self._observation(turn, int(r), answer, vocab)
      for r, answer in zip(rows, answers, strict=True)
    ]


def _end_reason(eos: bool, env_done: bool, budget: bool) -> int:
  """`EpisodeInfo.end_reason` of an ending row: EOS, else the environment, the budget, max_turns."""
  if eos:
    return END_EOS
  if env_done:
    return END_ENV
  return END_BUDGET if budget else END_TURNS


def _outputs(st: MultiTurnState, reason, cut) -> tuple[SampleOutput, EpisodeInfo]:
  sample = SampleOutput(
    tokens=st.tokens,
    logprobs=jnp.where(st.policy, st.logprobs, 0.0),
    mask=st.policy.astype(jnp.float32),
    lengths=st.pos,
    kept=jnp.where(st.policy, st.kept, 0),
  )
  info = EpisodeInfo(
    turns=st.turn,
    turn_ids=st.turn_ids,
    observation_mask=st.observation.astype(jnp.float32),
    end_reason=jnp.asarray(reason),
    observation_truncated=jnp.asarray(cut),
  )
  return sample, info
