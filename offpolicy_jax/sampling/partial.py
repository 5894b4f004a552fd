"""Partial rollouts (APRIL): generations paused at a per-step token budget and resumed.

With a budget of ``b`` decode steps per loop step, the sampler no longer runs
every response to its end. A pool of in-flight groups (`PartialState`) is
carried from step to step; each step

  admit    the step's G new prompt groups take free slots,
  advance  every unfinished row decodes at most b tokens under the step's
           behaviour parameters theta_v, recording per token
           y_t ~ mu_v(. | x, y_<t),  logp_t = log mu_v(y_t | x, y_<t),  version_t = v,
  emit     groups whose K rows have all finished (EOS or max_new_tokens) leave
           the pool for the replay buffer; their slots become free (`emit`,
           its metrics `emit_stats`; `rollout.partial.Partial` is the rollout
           built on these programs).

A response may thus span several parameter versions, and every token keeps
the version and the behaviour log-prob of the parameters that sampled it, so
the losses see per-token behaviour versions (``TrainBatch.versions`` [B, N]).
After Zhou et al., "APRIL: Active Partial Rollouts in Reinforcement Learning to
Tame Long-tail Generation" (arXiv:2509.18521), which ends a rollout phase once
enough responses have finished and recycles the unfinished ones; here a fixed
per-step token budget ends it, which keeps every shape static.

Continuation by re-prefill. Here a resumed row is re-prefilled: prompt and
generated tokens run through theta_v before decoding, so each new token's
log-prob is exactly ``models.sequence_logprobs`` under theta_v at that position
(the trainer can recompute it from a snapshot of version v). Keeping the KV
cache instead would save the prefill (one forward over about P + N tokens per
row per step) but condition the new tokens on keys and values computed by
older parameters: the recorded log-probs then belong to no single parameter
version, and behaviour corrections mix that mismatch with staleness
(docs/science.md s5). Re-prefill costs compute; it keeps the behaviour policy exact.

Layout. Unfinished rows that entered at the same step are at the same length,
rows of different ages are not. Each step, a row's context (left-padded
prompt, then its generated tokens) is right-aligned into a window of
``W = P + (L - 1) * b`` slots, ``L = ceil(N / b)``, so every row's next token
goes to the same cache slot and decoding runs in lockstep (left padding is
exact: positions are ``cumsum(mask) - 1``).

Capacity. A group finishes within L advances (L * b >= N), so with ``S = L * G``
slots and G admissions per step at most ``(L - 1) * G`` groups are in flight
before an admission: no prompt is ever turned away. At most ``L * G`` groups
wait in the replay buffer between emission and training (FIFO, one use), so
its capacity must be at least L batches (`steps_to_finish`).

Keys. Decode step i of the loop step with key ``k`` draws with
``fold_in(k, i)`` over the [S * K, V] logits, as `sampling.make_sampler` does:
with ``b >= N`` (L = 1, S = G) the partial sampler returns exactly the
ordinary sampler's tokens for the same key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offpolicy_jax import types
from offpolicy_jax.models import layout
from offpolicy_jax.sampling.sampler import SampleOutput, select_token
from offpolicy_jax.scale import sharding


class PartialState(NamedTuple):
  """The in-flight pool: S group slots of K rows each (rows group-major, R = S * K).

  Attributes:
    prompts: dict of [S, ...] arrays, the admitted prompt fields
      (``prompt_tokens`` [S, P] left-padded, ``prompt_lengths`` [S], task fields).
    tokens: int32 [R, N] generated tokens (0 after the end).
    logprobs: float32 [R, N] behaviour log-prob of each generated token.
    kept: int32 [R, N] size of the top-k / top-p set it was drawn from
      (`SampleOutput.kept`).
    old_logprobs: float32 [R, N] the learner's log-prob of each token at the
      parameters that sampled it (`rollout.protocol.pi_old`; the behaviour log-prob when
      not scored).
    versions: int32 [R, N] parameter version that sampled each token.
    mask: bool [R, N] generated (valid) tokens.
    lengths: int32 [R] tokens generated so far.
    done: bool [R] the row has finished (EOS or N tokens).
    active: bool [S] the slot holds a group not yet emitted.
    admitted: int32 [S] loop step at which the slot's group entered.
  """

  prompts: dict[str, jax.Array]
  tokens: jax.Array
  logprobs: jax.Array
  kept: jax.Array
  old_logprobs: jax.Array
  versions: jax.Array
  mask: jax.Array
  lengths: jax.Array
  done: jax.Array
  active: jax.Array
  admitted: jax.Array


class PartialSampler(NamedTuple):
  """A run's partial-rollout sampler: `advance` (from `make_advance`) and the pool's size.

  Attributes:
    advance: `advance(params, state, version, key) -> PartialState`.
    slots: S, group slots of the pool (`steps_to_finish` * G).
    group_size: K.
    max_new_tokens: N.
  """

  advance: Callable
  slots: int
  group_size: int
  max_new_tokens: int

  def init(self, prompts: dict[str, Any]) -> PartialState:
    """An empty pool for prompt batches shaped like `prompts` (dict of [G, ...])."""
    return init(
      prompts, slots=self.slots, group_size=self.group_size, max_new_tokens=self.max_new_tokens
    )


def steps_to_finish(max_new_tokens: int, budget: int) -> int:
  """L = ceil(N / b): advances after which every row has finished."""
  if budget < 1:
    raise ValueError(f"budget must be >= 1, got {budget}")
  return -(-max_new_tokens // budget)


def init(prompts: dict[str, Any], *, slots: int, group_size: int, max_new_tokens: int):
  """An empty pool of `slots` groups shaped like `prompts` (a dict of [G, ...] arrays)."""
  r, n = slots * group_size, max_new_tokens
  empty = {
    k: jnp.zeros((slots, *np.shape(v)[1:]), jnp.asarray(v).dtype) for k, v in prompts.items()
  }
  return PartialState(
    prompts=empty,
    tokens=jnp.zeros((r, n), jnp.int32),
    logprobs=jnp.zeros((r, n), jnp.float32),
    kept=jnp.zeros((r, n), jnp.int32),
    old_logprobs=jnp.zeros((r, n), jnp.float32),
    versions=jnp.zeros((r, n), jnp.int32),
    mask=jnp.zeros((r, n), bool),
    lengths=jnp.zeros((r,), jnp.int32),
    done=jnp.zeros((r,), bool),
    active=jnp.zeros((slots,), bool),
    admitted=jnp.zeros((slots,), jnp.int32),
  )


def shard(state: PartialState, mesh: jax.sharding.Mesh) -> PartialState:
  """Places a pool on `mesh`: leading axis over ``(data, fsdp)`` if it divides, else replicated."""
  n = sharding.axis_size(mesh, sharding.BATCH_AXES)

  def one(x):
    split = x.ndim and x.shape[0] % n == 0
    return sharding.batch_sharding(mesh, x.ndim) if split else sharding.replicated(mesh)

  return sharding.put(state, jax.tree.map(one, state))


def admit(
  state: PartialState, prompts: dict[str, jax.Array], step
) -> tuple[PartialState, jax.Array]:
  """Puts the G groups of `prompts` into the first G free slots, in order (traceable).

  Returns:
    ``(state, dropped)``: the pool and the number of groups that found no free
    slot (0 whenever the pool has `steps_to_finish` * G slots; see the module
    docstring).
  """
  k = state.tokens.shape[0] // state.active.shape[0]
  g = next(iter(prompts.values())).shape[0]
  free = ~state.active
  rank = jnp.cumsum(free) - 1
  take = free & (rank < g)
  src = jnp.where(take, rank, 0)

  def fill(old, new):
    new = jnp.asarray(new, old.dtype)[src]
    return jnp.where(take.reshape(-1, *([1] * (old.ndim - 1))), new, old)

  rows = jnp.repeat(take, k)
  reset = lambda x: jnp.where(rows.reshape(-1, *([1] * (x.ndim - 1))), jnp.zeros_like(x), x)
  state = PartialState(
    prompts={name: fill(state.prompts[name], prompts[name]) for name in state.prompts},
    tokens=reset(state.tokens),
    logprobs=reset(state.logprobs),
    kept=reset(state.kept),
    old_logprobs=reset(state.old_logprobs),
    versions=reset(state.versions),
    mask=reset(state.mask),
    lengths=reset(state.lengths),
    done=reset(state.done),
    active=state.active | take,
    admitted=jnp.where(take, jnp.asarray(step, jnp.int32), state.admitted),
  )
  return state, (g - take.sum()).astype(jnp.int32)


def _context(state: PartialState, group_size: int, generated: int):
  """Rows' prompt + generated tokens right-aligned into W slots: (tokens, mask) [R, W].

  W = P + `generated`: the prompt's width and the most tokens a row can have
  generated before its last call.
  """
  p = state.prompts["prompt_tokens"].shape[1]
  w = p + generated
  prompt = jnp.repeat(state.prompts["prompt_tokens"], group_size, axis=0)
  lengths_p = jnp.repeat(state.prompts["prompt_lengths"], group_size, axis=0)
  prompt_mask = types.prompt_mask(lengths_p, p)
  full = jnp.concatenate([prompt, state.tokens], axis=1)
  full_mask = jnp.concatenate([prompt_mask, state.mask], axis=1)
  shift = jnp.maximum(w - p - state.lengths, 0)
  src = jnp.arange(w)[None, :] - shift[:, None]
  ok = src >= 0
  src = jnp.maximum(src, 0)
  ctx = jnp.where(ok, jnp.take_along_axis(full, src, axis=1), 0)
  ctx_mask = ok & jnp.take_along_axis(full_mask, src, axis=1)
  return ctx, ctx_mask


def make_advance(
  graphdef: nnx.GraphDef,
  *,
  max_new_tokens: int,
  budget: int,
  group_size: int,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  eos_id: int | Sequence[int] | None = None,
  behavior_logp: str = "sampled",
):
  """Builds `advance(params, state, version, key) -> PartialState` (pure, traceable).

  Every unfinished row of an active slot is re-prefilled under `params` and
  decodes at most ``min(budget, N)`` tokens (see the module docstring); the
  tokens record `version` and their exact log-probs under the sampling
  distribution (temperature, top-k, top-p as in `sampling.make_sampler`).

  Args:
    graphdef: `nnx.split(model)[0]` of a `models.Decoder`.
    max_new_tokens: N, the response length.
    budget: b >= 1, decode steps per call.
    group_size: K, rows per slot.
    temperature, top_p, top_k, eos_id, behavior_logp: as for `sampling.make_sampler`.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  n = max_new_tokens
  b = min(budget, n)
  lag_steps = steps_to_finish(n, b)
  eos_ids = () if eos_id is None else tuple(int(t) for t in np.atleast_1d(eos_id))
  temperature, top_p = float(temperature), float(top_p)

  def advance(params, state: PartialState, version, key) -> PartialState:
    model = layout.for_decoding(nnx.merge(graphdef, params))
    ctx, ctx_mask = _context(state, group_size, (lag_steps - 1) * b)
    r, w = ctx.shape
    kv_mask = jnp.concatenate([ctx_mask, jnp.ones((r, b), bool)], axis=1)
    cache = model.init_cache(r, w + b)
    h, cache = model.hidden_states(ctx, attention_mask=kv_mask, cache=cache, cache_index=0)
    logits = model.logits_from_hidden(h[:, -1])
    version = jnp.asarray(version, jnp.int32)
    live0 = jnp.repeat(state.active, group_size) & ~state.done
    cols = jnp.arange(n)[None, :]

    def cond(carry):
      i, live = carry[0], carry[3]
      return (i < b) & jnp.any(live)

    def body(carry):
      i, cache, logits, live, rows = carry
      tokens, logps, olds, kept, versions, mask, lengths = rows
      draw = select_token(
        logits, jax.random.fold_in(key, i), temperature, top_k, top_p, behavior_logp
      )
      token = draw.token
      at = (cols == lengths[:, None]) & live[:, None]
      tokens = jnp.where(at, token[:, None], tokens)
      logps = jnp.where(at, draw.logp[:, None], logps)
      olds = jnp.where(at, draw.logp[:, None], olds)
      kept = jnp.where(at, draw.kept[:, None], kept)
      versions = jnp.where(at, version, versions)
      mask = mask | at
      ended = lengths + 1 >= n
      if eos_ids:
        ended = ended | jnp.isin(token, jnp.asarray(eos_ids, jnp.int32))
      lengths = lengths + live.astype(jnp.int32)
      live = live & ~ended
      h, cache = model.hidden_states(
        jnp.where(live, token, 0)[:, None], attention_mask=kv_mask, cache=cache, cache_index=w + i
      )
      logits = model.logits_from_hidden(h[:, 0])
      return i + 1, cache, logits, live, (tokens, logps, olds, kept, versions, mask, lengths)

    rows = (
      state.tokens,
      state.logprobs,
      state.old_logprobs,
      state.kept,
      state.versions,
      state.mask,
      state.lengths,
    )
    carry = (jnp.int32(0), cache, logits, live0, rows)
    _, _, _, live, rows = jax.lax.while_loop(cond, body, carry)
    tokens, logps, olds, kept, versions, mask, lengths = rows
    done = state.done | (live0 & ~live)
    return state._replace(
      tokens=tokens,
      logprobs=logps,
      old_logprobs=olds,
      kept=kept,
      versions=versions,
      mask=mask,
      lengths=lengths,
      done=done,
    )

  return advance


def finished(state: PartialState) -> jax.Array:
  """bool [S]: active slots whose K rows have all finished."""
  k = state.tokens.shape[0] // state.active.shape[0]
  return state.active & state.done.reshape(-1, k).all(axis=1)


def as_output(state: PartialState) -> SampleOutput:
  """The pool's rows as a `SampleOutput` (tokens, behaviour log-probs, mask, lengths, kept)."""
  return SampleOutput(
    state.tokens,
    state.logprobs,
    state.mask.astype(jnp.float32),
    state.mask.sum(1).astype(jnp.int32),
    state.kept,
    state.old_logprobs,
  )


def emit(state: PartialState) -> tuple[SampleOutput, jax.Array, jax.Array, PartialState]:
  """The pool's rows with the groups that finished, and the pool without them.

  Returns:
    `(out, keep, order, state)`: every slot's rows (`as_output`); bool [S], the
    groups whose K rows have all ended (`finished`); int32 [S], those groups by
    admission step, then slot, then the rest (their buffer order); and the
    pool with their slots free for the next admissions.
  """
  keep = finished(state)
  order = jnp.argsort(jnp.where(keep, state.admitted, jnp.iinfo(jnp.int32).max), stable=True)
  return as_output(state), keep, order, state._replace(active=state.active & ~keep)


def emit_stats(state: PartialState, keep: jax.Array, dropped) -> dict[str, jax.Array]:
  """Metrics of one step's emission from `state` (the pool before `emit`).

  Returns:
    ``partial_emitted_groups`` (finished groups handed to the buffer),
    ``partial_inflight_groups`` (left in the pool), ``partial_dropped_prompts``
    (groups refused for want of a slot; 0 by construction) and
    ``partial_mixed_rows`` (fraction of emitted rows whose tokens come from more
    than one parameter version).
  """
  k = state.tokens.shape[0] // keep.shape[0]
  valid = state.mask > 0
  big = jnp.iinfo(jnp.int32).max
  oldest = jnp.where(valid, state.versions, big).min(axis=1)
  newest = jnp.where(valid, state.versions, -1).max(axis=1)
  rows = jnp.repeat(keep, k) & valid.any(axis=1)
  mixed = (rows & (newest > oldest)).sum() / jnp.maximum(rows.sum(), 1)
  return {
    "partial_emitted_groups": keep.sum().astype(jnp.int32),
    "partial_inflight_groups": (state.active & ~keep).sum().astype(jnp.int32),
    "partial_dropped_prompts": jnp.asarray(dropped, jnp.int32),
    "partial_mixed_rows": mixed.astype(jnp.float32),
  }
