"""The jitted device pieces of a multi-turn rollout (`sampling.multiturn`) and the state they carry.

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

and `reencode`, the caches and next-token logits recomputed under newer
parameters between turns (`sampling.multiturn`, Exactness).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offpolicy_jax import types
from offpolicy_jax.models import KVCache, layout
from offpolicy_jax.sampling.continuous import row_keys
from offpolicy_jax.sampling.sampler import DECODE_BLOCK, check_options, select_token

HISTORY = ("extend", "reprefill")


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


class TurnPieces:
  """The options and jitted pieces of a multi-turn sampler (`sampling.multiturn.MultiTurnSampler`).

  ``start``, ``turn``, ``extend`` and ``reencode`` (jitted, module docstring);
  `MultiTurnSampler` adds the host loop that drives them.
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
    model = layout.for_decoding(nnx.merge(self.graphdef, params))
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
    model = layout.for_decoding(nnx.merge(self.graphdef, params))
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
    model = layout.for_decoding(nnx.merge(self.graphdef, params))
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
    model = layout.for_decoding(nnx.merge(self.graphdef, params))
    h, suffix, prefix = self._encode(model, st, st.tokens, st.pos)
    return st._replace(prefix=prefix, suffix=suffix, logits=model.logits_from_hidden(h))
