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

Three jitted pieces, each compiled once per shape, driven by a host loop
(`MultiTurnSampler.__call__`):

  start   prefill the G prompts once (their cache is shared by K rows each);
  turn    every live row decodes (one `lax.while_loop`) until its turn ends:
          a `turn_end` sequence within the turn, EOS, `turn_tokens` tokens in
          the turn, or the row's total budget; the loop exits once every live
          row has ended its turn. Each token records log mu and the kept-set
          size exactly as `sampling.make_sampler` does (its module docstring:
          the log-prob contract);
  extend  each row's observation tokens are written into its own suffix
          cache at its own slots in one pass (`Decoder.extend_shared`),
          instead of re-prefilling the prompt and the whole history.

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
from flax import nnx

from offpolicy_jax import types
from offpolicy_jax.models import KVCache
from offpolicy_jax.sampling.continuous import row_keys
from offpolicy_jax.sampling.sampler import DECODE_BLOCK, SampleOutput, check_options, select_token

# Why an episode ended (`EpisodeInfo.end_reason`).
END_ENV = 0  # the environment answered done
END_EOS = 1  # the policy emitted EOS
END_TURNS = 2  # max_turns policy turns were taken
END_BUDGET = 3  # the row's suffix budget (max_new_tokens or max_lengths) was used up
END_REASONS = ("env", "eos", "turns", "budget")
HISTORY = ("extend", "reprefill")

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


class MultiTurnState(NamedTuple):
  """Device state carried between the jitted pieces (R = G * K rows, N suffix slots).

  Attributes:
    prompt_tokens: int32 [G, P] the left-padded prompts.
    prompt_mask: bool [G, P] their real tokens.
    prefix: the prompts' cache, [G, N_kv, P, H] per layer.
    suffix: the rows' own cache, [R, N_kv, N, H] per layer.
    logits: float32 [R, V] each row's next-token logits.
    limit: int32 [R] the row's suffix budget (<= N).
    pos: int32 [R] filled suffix slots (the next token's slot).
    turn_start: int32 [R] slot of the current turn's first token.
    turn: int32 [R] policy turns completed.
    done: bool [R] the episode has ended.
    ended: bool [R] the row's current turn has ended (or the row is done).
    eos: bool [R] the row emitted EOS.
    tokens, logprobs, kept: [R, N] policy and observation tokens; log mu and
      the kept-set size of policy tokens (0 elsewhere).
    policy: bool [R, N] policy tokens.
    observation: bool [R, N] observation tokens.
    turn_ids: int32 [R, N] (`EpisodeInfo.turn_ids`).
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  prefix: KVCache
  suffix: KVCache
  logits: jax.Array
  limit: jax.Array
  pos: jax.Array
  turn_start: jax.Array
  turn: jax.Array
  done: jax.Array
  ended: jax.Array
  eos: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  kept: jax.Array
  policy: jax.Array
  observation: jax.Array
  turn_ids: jax.Array


def _ends_turn(tokens_bn, rows_b, steps_b, starts_b, seqs):
  """True for rows whose tokens end at `steps_b` with one of `seqs` lying within the turn."""
  hit = jnp.zeros(rows_b.shape, bool)
  for seq in seqs:
    cols = steps_b[:, None] - len(seq) + 1 + jnp.arange(len(seq))[None, :]
    window = tokens_bn[rows_b[:, None], jnp.maximum(cols, 0)]
    match = (window == jnp.asarray(seq, jnp.int32)[None, :]) & (cols >= starts_b[:, None])
    hit = hit | jnp.all(match, axis=1)
  return hit


class MultiTurnSampler:
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

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    *,
    max_new_tokens: int,
    turn_tokens: int,
    max_turns: int,
    observation_tokens: int,
    group_size: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_id: int | Sequence[int] | None = None,
    turn_end: Sequence[Sequence[int]] = (),
    behavior_logp: str = "sampled",
    decode_block: int = DECODE_BLOCK,
    history: str = "extend",
  ):
    """Builds the sampler.

    Args:
      graphdef: `nnx.split(model)[0]` of a `models.Decoder`.
      max_new_tokens: N, the suffix budget of a trajectory (policy + observation tokens).
      turn_tokens: most tokens of one policy turn.
      max_turns: most policy turns of an episode.
      observation_tokens: O, most tokens of one observation (longer ones are cut).
      group_size: K, trajectories per prompt.
      temperature, top_p, top_k, behavior_logp: as for `sampling.make_sampler`.
      eos_id: token id (or ids) that ends the episode (kept, a policy token), or None.
      turn_end: token sequences that end a policy turn (kept, policy tokens),
        matched within the turn, e.g. the tokenizer's ids of "\\n".
      decode_block: spans of the decode and extension attention over the
        filled slots (`sampling.make_sampler`; 0: the whole cache).
      history: "extend" appends each observation to the cache
        (`Decoder.extend_shared`); "reprefill" re-encodes the prompts and each
        row's whole history instead (the reference the benchmark compares
        against; the same tokens, more compute).
    """
    check_options(
      max_new_tokens=max_new_tokens,
      group_size=group_size,
      temperature=temperature,
      top_p=top_p,
      top_k=top_k,
      behavior_logp=behavior_logp,
      decode_block=decode_block,
    )
    for name, value in (
      ("turn_tokens", turn_tokens),
      ("max_turns", max_turns),
      ("observation_tokens", observation_tokens),
    ):
      if int(value) < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if history not in HISTORY:
      raise ValueError(f"history must be one of {HISTORY}, got {history!r}")
    seqs = tuple(tuple(int(t) for t in s) for s in turn_end)
    if any(not s for s in seqs):
      raise ValueError(f"turn_end sequences must be non-empty, got {turn_end!r}")
    self.graphdef = graphdef
    self.max_new_tokens = int(max_new_tokens)
    self.turn_tokens = int(turn_tokens)
    self.max_turns = int(max_turns)
    self.observation_tokens = int(observation_tokens)
    self.group_size = int(group_size)
    self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
    self.eos_ids = () if eos_id is None else tuple(int(t) for t in np.atleast_1d(eos_id))
    self.turn_end = seqs
    self.behavior_logp = behavior_logp
    self.decode_block = int(decode_block)
    self.history = history
    self.start = jax.jit(self._start)
    self.turn = jax.jit(self._turn, donate_argnums=(1,))
    self.extend = jax.jit(self._extend, donate_argnums=(1,))
    self.reencode = jax.jit(self._reencode, donate_argnums=(1,))

  def _start(self, params, prompt_tokens, prompt_lengths, limit) -> MultiTurnState:
    """Prefills the prompts once per group; every row starts its first turn."""
    model = nnx.merge(self.graphdef, params)
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    g, p = prompt_tokens.shape
    b, n = g * self.group_size, self.max_new_tokens
    prompt_mask = types.prompt_mask(prompt_lengths, p)
    h, prefix = model.hidden_states(
      prompt_tokens, attention_mask=prompt_mask, cache=model.init_cache(g, p), cache_index=0
    )
    zeros = lambda dtype: jnp.zeros((b, n), dtype)
    row = lambda dtype: jnp.zeros((b,), dtype)
    return MultiTurnState(
      prompt_tokens=prompt_tokens,
      prompt_mask=prompt_mask,
      prefix=prefix,
      suffix=model.init_cache(b, n),
      logits=jnp.repeat(model.logits_from_hidden(h[:, -1]), self.group_size, axis=0),
      limit=jnp.asarray(limit, jnp.int32),
      pos=row(jnp.int32),
      turn_start=row(jnp.int32),
      turn=row(jnp.int32),
      done=row(bool),
      ended=row(bool),
      eos=row(bool),
      tokens=zeros(jnp.int32),
      logprobs=zeros(jnp.float32),
      kept=zeros(jnp.int32),
      policy=zeros(bool),
      observation=zeros(bool),
      turn_ids=zeros(jnp.int32),
    )

  def _turn(self, params, st: MultiTurnState, key, ids_b, samples_b, quota_b) -> MultiTurnState:
    """Every row not done decodes its policy turn, at most `quota_b` [R] tokens in this call.

    A row that reaches its quota before its turn ends is paused mid-turn: its
    `ended` stays False and the next call continues the same turn (same
    `turn_start` and turn id). `turn` counts the turns that ended.
    """
    model = nnx.merge(self.graphdef, params)
    b, n = st.tokens.shape
    rows = jnp.arange(b)
    eos_ids = jnp.asarray(self.eos_ids, jnp.int32)
    quota_b = jnp.asarray(quota_b, jnp.int32)
    pos0 = st.pos

    def live_rows(st: MultiTurnState) -> jax.Array:
      return ~st.ended & (st.pos - pos0 < quota_b)

    def body(st: MultiTurnState) -> MultiTurnState:
      live = live_rows(st)
      keys = row_keys(key, ids_b, samples_b, st.pos)
      draw = select_token(
        st.logits, keys, self.temperature, self.top_k, self.top_p, self.behavior_logp
      )
      col = jnp.minimum(st.pos, n - 1)
      dst = jnp.where(live, rows, b)  # out of range: dropped
      at = lambda x, v: x.at[dst, col].set(v, mode="drop")
      tokens = at(st.tokens, draw.token)
      eos = live & jnp.isin(draw.token, eos_ids) if self.eos_ids else jnp.zeros_like(live)
      ended = (st.pos + 1 >= st.limit) | (st.pos + 1 - st.turn_start >= self.turn_tokens) | eos
      if self.turn_end:
        ended = ended | _ends_turn(tokens, rows, st.pos, st.turn_start, self.turn_end)
      # A done row writes its slot 0 (never read again); a row whose turn ended
      # writes its next slot, which its next token or observation overwrites
      # before anything reads it.
      index = jnp.where(st.done, 0, col)
      h, suffix = model.decode_shared(
        jnp.where(live, draw.token, 0),
        st.prefix,
        st.suffix,
        st.prompt_mask,
        index,
        self.decode_block,
      )
      logits = jnp.where(live[:, None], model.logits_from_hidden(h), st.logits)
      return st._replace(
        suffix=suffix,
        logits=logits,
        pos=st.pos + live.astype(jnp.int32),
        ended=st.ended | (live & ended),
        eos=st.eos | eos,
        tokens=tokens,
        logprobs=at(st.logprobs, draw.logp),
        kept=at(st.kept, draw.kept),
        policy=at(st.policy, True),
        turn_ids=at(st.turn_ids, st.turn),
      )

    # A new turn starts where the last one ended; a turn paused mid-way keeps its start.
    start = jnp.where(st.ended | st.done, st.pos, st.turn_start)
    st = st._replace(ended=st.done, turn_start=start)
    st = jax.lax.while_loop(lambda st: jnp.any(live_rows(st)), body, st)
    return st._replace(turn=st.turn + (st.ended & ~st.done).astype(jnp.int32))

  def _extend(self, params, st: MultiTurnState, obs_bo, counts_b, done_b) -> MultiTurnState:
    """Appends each row's observation (its first counts[b] tokens) and marks done rows."""
    model = nnx.merge(self.graphdef, params)
    b, n = st.tokens.shape
    obs_bo = jnp.asarray(obs_bo, jnp.int32)
    counts_b = jnp.asarray(counts_b, jnp.int32)
    steps = jnp.arange(obs_bo.shape[1])[None, :]
    cols = jnp.where(steps < counts_b[:, None], st.pos[:, None] + steps, n)  # n: dropped
    rows = jnp.arange(b)[:, None]
    at = lambda x, v: x.at[rows, cols].set(v, mode="drop")
    answered = jnp.broadcast_to((st.turn - 1)[:, None], obs_bo.shape)

    def run(suffix_logits):
      suffix, logits = suffix_logits
      if self.history == "extend":
        # Rows without an observation write nothing; slot 0 keeps their span short.
        index = jnp.where(counts_b > 0, st.pos, 0)
        h, suffix = model.extend_shared(
          obs_bo, counts_b, st.prefix, suffix, st.prompt_mask, index, self.decode_block
        )
      else:
        h, suffix, _ = self._encode(model, st, at(st.tokens, obs_bo), st.pos + counts_b)
      new = model.logits_from_hidden(h)
      return suffix, jnp.where((counts_b > 0)[:, None], new, logits)

    suffix, logits = jax.lax.cond(jnp.any(counts_b > 0), run, lambda x: x, (st.suffix, st.logits))
    return st._replace(
      suffix=suffix,
      logits=logits,
      pos=st.pos + counts_b,
      done=st.done | jnp.asarray(done_b, bool),
      tokens=at(st.tokens, obs_bo),
      observation=at(st.observation, True),
      turn_ids=at(st.turn_ids, answered),
    )

  def _encode(self, model, st: MultiTurnState, tokens_bn, filled_b):
    """The prompts and every row's first `filled_b` suffix tokens encoded from scratch.

    As a system that re-prefills the conversation: the prompts, then the
    rows' first max(filled) suffix slots rounded up to `decode_block` (one
    static width per `lax.switch` branch), into a fresh cache.

    Returns:
      (h [R, D] at each row's last filled slot (for filled 0: the prompt's last
      token), suffix cache, prefix cache).
    """
    g, p = st.prompt_tokens.shape
    h_p, prefix = model.hidden_states(
      st.prompt_tokens, attention_mask=st.prompt_mask, cache=model.init_cache(g, p), cache_index=0
    )
    b, n = tokens_bn.shape
    block = self.decode_block or n
    spans = [*range(block, n, block), n]

    def branch(span):
      def run():
        return model.extend_shared(
          tokens_bn[:, :span],
          filled_b,
          prefix,
          model.init_cache(b, n),
          st.prompt_mask,
          jnp.zeros((b,), jnp.int32),
          self.decode_block,
        )

      return run

    index = jnp.clip((jnp.max(filled_b) - 1) // block, 0, len(spans) - 1)
    h, suffix = jax.lax.switch(index, [branch(s) for s in spans])
    first = jnp.repeat(h_p[:, -1], self.group_size, axis=0)
    return jnp.where((filled_b > 0)[:, None], h, first), suffix, prefix

  def _reencode(self, params, st: MultiTurnState) -> MultiTurnState:
    """The caches and next-token logits of every row recomputed under `params`.

    Between turns, for parameters that changed mid-episode (a newer version):
    the tokens that follow are then drawn from, and their log-probs are
    exact under, the new parameters given the whole trajectory so far, with
    no key or value computed by older parameters left in the caches.
    """
    model = nnx.merge(self.graphdef, params)
    h, suffix, prefix = self._encode(model, st, st.tokens, st.pos)
    return st._replace(prefix=prefix, suffix=suffix, logits=model.logits_from_hidden(h))

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
