"""Jitted KV-cache sampler returning exact behaviour log-probabilities.

Each step draws y_t ~ mu_t and records log mu_t(y_t), where mu_t is the
distribution actually sampled from:

  z = logits / temperature
  top-k: keep z_v >= (k-th largest z)            (top_k = 0: keep all)
  top-p: keep the smallest prefix of tokens sorted by softmax(z) whose mass
         reaches top_p (nucleus sampling, Holtzman et al., arXiv:1904.09751)
  mu_t = softmax(z restricted to the kept set)   (renormalised)

With top_p = 1 and top_k = 0, log mu_t equals `models.sequence_logprobs(...,
temperature)`. temperature = 0 means greedy decoding (argmax); the distribution is
then a point mass, and the recorded log-probs are the untempered model
log-probs log softmax(logits)(y_t) instead.

The log-prob contract (docs/science.md s7). Each token also records m_t = |S_t|,
the size of the kept set it was drawn from (V without truncation). The kept
set is always the m_t most likely tokens, so the learner rebuilds
log mu_t(y_t) = log p_t(y_t) - log Z_t from its own logits and m_t alone
(`models.logprobs`, `kept`); see there why a count and not a threshold.
`behavior_logp="full"` records instead log p_t(y_t) = log softmax(z)(y_t),
the untruncated tempered log-prob: truncation is then part of the
environment, and the learner scores the full tempered softmax.

Prompts are left-padded [G, P]; each prompt is prefilled once and its keys and
values are shared, not copied, by its K = group_size samples at every decode
step (rows are group-major: row g*K + k). Tokens after
EOS (or a stop sequence) are 0 and masked out; the mask is 1 up to and
including the EOS token.
"""

import functools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from offpolicy_jax import types
from offpolicy_jax.models import layout, moe


class SampleOutput(NamedTuple):
  """Sampler output (rows group-major, B = G * K).

  Attributes:
    tokens: int32 [B, N] sampled tokens, 0 after EOS.
    logprobs: float32 [B, N] log mu(y_t) of each sampled token, 0 where masked.
    mask: float32 [B, N] 1 up to and including EOS.
    lengths: int32 [B] number of valid tokens.
    kept: int32 [B, N] size m of the kept (top-k / top-p) set each token was
      drawn from (V without truncation), 0 where masked.
    old_logprobs: float32 [B, N] the learner's log-probs of the tokens at the
      sampling parameters (`rollout.protocol.pi_old` with `rollout.score_old`), or
      None: not scored.
    prompt_experts: int [G, P, L, k] the experts the prefill routed each prompt
      token to in each block (`make_sampler(record_routing=True)` with a model
      with experts: routing replay, `models.moe`), or None.
    experts: int [B, N, L, k] the experts each response token was routed to
      when it was fed back (the token's own hidden state), or None.
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  kept: jax.Array
  old_logprobs: jax.Array | None = None
  prompt_experts: jax.Array | None = None
  experts: jax.Array | None = None


BEHAVIOR_LOGP = ("sampled", "full")
# Cache slots per span of the decode attention (`make_sampler`'s `decode_block`).
DECODE_BLOCK = 32


def _truncate(z_bv, top_k, top_p):
  """Masks logits outside the top-k / top-p set with -inf (static k, p)."""
  if top_k and top_k < z_bv.shape[-1]:
    kth = jax.lax.top_k(z_bv, top_k)[0][:, -1:]
    z_bv = jnp.where(z_bv >= kth, z_bv, -jnp.inf)
  if top_p < 1.0:
    order = jnp.argsort(-z_bv, axis=-1)
    z_sorted = jnp.take_along_axis(z_bv, order, axis=-1)
    probs = jax.nn.softmax(z_sorted, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p
    keep = (
      jnp.zeros_like(keep_sorted).at[jnp.arange(z_bv.shape[0])[:, None], order].set(keep_sorted)
    )
    z_bv = jnp.where(keep, z_bv, -jnp.inf)
  return z_bv


class Sampler(Protocol):
  """A behaviour sampler (`make_sampler`, `continuous.make_continuous_sampler`): K responses
  to each of G prompts, `(params, prompt_tokens [G, P], prompt_lengths [G], key) ->
  SampleOutput` with B = G * K rows."""

  def __call__(self, params, prompt_tokens, prompt_lengths, key) -> SampleOutput: ...


class Draw(NamedTuple):
  """One decode step's draw: token [B] int32, its recorded log-prob [B] f32, kept-set size [B]."""

  token: jax.Array
  logp: jax.Array
  kept: jax.Array


def select_token(logits_bv, key, temperature, top_k, top_p, behavior_logp="sampled") -> Draw:
  """Draws one token per row from the tempered, truncated softmax.

  Args:
    logits_bv: float32 [B, V] logits.
    key: PRNG key, or a [B] array of keys, one per row (`sampling.continuous`).
    temperature: softmax temperature (0: greedy, the untempered log-prob is recorded).
    top_k, top_p: truncation (static; 0 and 1 are off).
    behavior_logp: "sampled" records log mu(token) under the truncated,
      renormalised distribution drawn from; "full" the untruncated tempered
      log softmax(logits / temperature)(token).

  Returns:
    `Draw(token, logp, kept)`, kept the size of the set drawn from (V without truncation).
  """
  v = logits_bv.shape[-1]
  full_v = jnp.full(logits_bv.shape[:1], v, jnp.int32)
  if temperature == 0.0:
    token = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return Draw(token, _take(jax.nn.log_softmax(logits_bv, axis=-1), token), full_v)
  z = logits_bv / temperature
  truncates = bool(top_k and top_k < v) or top_p < 1.0
  z_kept = _truncate(z, top_k, top_p) if truncates else z
  logp_all = jax.nn.log_softmax(z_kept, axis=-1)
  token = _inverse_cdf(key, logp_all)
  kept = jnp.sum(jnp.isfinite(z_kept), axis=-1, dtype=jnp.int32) if truncates else full_v
  if behavior_logp == "full" and truncates:
    logp_all = jax.nn.log_softmax(z, axis=-1)
  return Draw(token, _take(logp_all, token), kept)


def _take(x_bv, index_b):
  return jnp.take_along_axis(x_bv, index_b[:, None], axis=-1)[:, 0]


def _inverse_cdf(key, logp_bv):
  """One draw per row from softmax: the first token whose running mass reaches u * total.

  One uniform per row instead of `jax.random.categorical`'s Gumbel noise over
  the whole vocabulary (a threefry hash of B x V words at every decode step, the
  largest non-matmul cost of the loop). u is in (0, 1], so a token of
  probability 0 (cut by top-k / top-p) is never drawn. A [B] array of keys
  draws row b's u from key b alone.
  """
  cdf = jnp.cumsum(jnp.exp(logp_bv), axis=-1)
  if jnp.ndim(key):
    u = 1.0 - jax.vmap(jax.random.uniform)(key)[:, None]
  else:
    u = 1.0 - jax.random.uniform(key, (logp_bv.shape[0], 1))
  token = jnp.sum(cdf < u * cdf[:, -1:], axis=-1)
  return jnp.minimum(token, logp_bv.shape[-1] - 1).astype(jnp.int32)


def _hits_stop(tokens_bn, i, stop_sequences):
  """True for rows whose generated tokens end at step i with a stop sequence."""
  hit = jnp.zeros(tokens_bn.shape[0], bool)
  for seq in stop_sequences:
    n = len(seq)
    padded = jnp.pad(tokens_bn, ((0, 0), (n, 0)), constant_values=-1)
    window = jax.lax.dynamic_slice_in_dim(padded, i + 1, n, axis=1)
    hit = hit | jnp.all(window == jnp.asarray(seq, jnp.int32)[None, :], axis=1)
  return hit


def check_options(
  *, max_new_tokens, group_size, temperature, top_p, top_k, behavior_logp, decode_block
) -> None:
  """Raises ValueError naming a sampling option out of range (`make_sampler`'s arguments)."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0, got {top_k}")
  if decode_block < 0:
    raise ValueError(f"decode_block must be >= 0, got {decode_block}")
  if behavior_logp not in BEHAVIOR_LOGP:
    raise ValueError(f"behavior_logp must be one of {BEHAVIOR_LOGP}, got {behavior_logp!r}")


def make_sampler(
  graphdef: nnx.GraphDef,
  *,
  max_new_tokens: int,
  group_size: int = 1,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  eos_id: int | Sequence[int] | None = None,
  stop_sequences: Sequence[Sequence[int]] | None = None,
  behavior_logp: str = "sampled",
  decode_block: int = DECODE_BLOCK,
  record_routing: bool = False,
  greedy_first: bool = False,
):
  """Builds a jitted `fn(params, prompt_tokens[G,P], prompt_lengths[G], key) -> SampleOutput`.

  The function compiles once per (G, P) shape. Decoding runs under
  `lax.while_loop` and exits early once every row has finished. An optional
  `max_lengths` int32 [G * K] caps each row's response length (<= N).

  Args:
    graphdef: `nnx.split(model)[0]` of a `models.Decoder`.
    max_new_tokens: N, response length.
    group_size: K, samples per prompt (B = G * K, group-major).
    temperature: softmax temperature; 0 for greedy decoding.
    top_p: nucleus mass in (0, 1].
    top_k: keep the k most likely tokens (0 = all).
    eos_id: token id (or ids, e.g. Llama 3 instruct) that ends a response (kept, masked
      in), or None.
    stop_sequences: token-id sequences that also end a response (kept, masked in);
      matched against generated tokens only.
    behavior_logp: what `logprobs` records: "sampled" (log mu, the truncated
      distribution drawn from) or "full" (the untruncated tempered log-prob).
    decode_block: decode step i attends to its rows' own keys 0..i only, read
      in spans of this many cache slots (0: all N slots at every step; the
      same numbers either way; at most `attention_ops.MAX_SPANS` spans).
    record_routing: with a model with experts, record every prompt and
      response token's experts (`SampleOutput.prompt_experts`, `.experts`).
    greedy_first: the first response of every group is decoded greedily
      (argmax, its untempered log-prob recorded), the rest as above: ReMax's
      baseline drawn in the same batch (`advantages.GREEDY_FIRST`).

  Returns:
    The jitted sampling function; `params` is the state from `nnx.split(model)`.
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
  stops = tuple(tuple(int(t) for t in s) for s in (stop_sequences or ()) if len(s))
  eos_ids = () if eos_id is None else tuple(int(t) for t in np.atleast_1d(eos_id))
  n, k_rep = max_new_tokens, group_size
  temperature, top_p = float(temperature), float(top_p)

  def sample(params, prompt_tokens, prompt_lengths, key, max_lengths=None):
    model = layout.for_decoding(nnx.merge(graphdef, params))
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    g, p = prompt_tokens.shape
    b = g * k_rep
    prompt_mask = types.prompt_mask(prompt_lengths, p)
    # The prompts' cache is filled once and read once per group at every step;
    # each of the B rows has its own cache for the tokens it generates.
    h, prefix, routed = model.routed(
      prompt_tokens, attention_mask=prompt_mask, cache=model.init_cache(g, p), cache_index=0
    )
    logits = jnp.repeat(model.logits_from_hidden(h[:, -1]), k_rep, axis=0)
    cache = model.init_cache(b, n)
    record = record_routing and routed is not None
    c = model.config
    index = moe.index_dtype(c.num_experts)
    prompt_experts = routed.experts.astype(index) if record else None
    experts = jnp.zeros((b, n, c.num_layers, c.num_experts_per_tok), index) if record else None

    def cond(carry):
      i, done = carry[0], carry[4]
      return (i < n) & ~jnp.all(done)

    def body(carry):
      i, cache, logits, out, done = carry
      tokens, logps, kept, valid, experts = out
      draw = select_token(
        logits, jax.random.fold_in(key, i), temperature, top_k, top_p, behavior_logp
      )
      if greedy_first:  # row 0 of every group: the argmax
        greedy = select_token(logits, key, 0.0, 0, 1.0)
        first = jnp.arange(b) % k_rep == 0
        draw = jax.tree.map(lambda a, x: jnp.where(first, a, x), greedy, draw)
      token = jnp.where(done, 0, draw.token)
      tokens = tokens.at[:, i].set(token)
      logps = logps.at[:, i].set(jnp.where(done, 0.0, draw.logp))
      kept = kept.at[:, i].set(jnp.where(done, 0, draw.kept))
      valid = valid.at[:, i].set(~done)
      finished = (
        jnp.isin(token, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros_like(done)
      )
      if stops:
        finished = finished | _hits_stop(tokens, i, stops)
      if max_lengths is not None:
        finished = finished | (i + 1 >= max_lengths)
      done = done | finished
      h, cache, step_experts = model.decode_shared_routed(
        token, prefix, cache, prompt_mask, i, decode_block
      )
      if record:
        experts = experts.at[:, i].set(step_experts.astype(experts.dtype))
      logits = model.logits_from_hidden(h)
      return i + 1, cache, logits, (tokens, logps, kept, valid, experts), done

    zeros = lambda dtype: jnp.zeros((b, n), dtype)
    out = (zeros(jnp.int32), zeros(jnp.float32), zeros(jnp.int32), zeros(bool), experts)
    carry = (jnp.int32(0), cache, logits, out, jnp.zeros((b,), bool))
    _, _, _, (tokens, logps, kept, valid, experts), _ = jax.lax.while_loop(cond, body, carry)
    mask = valid.astype(jnp.float32)
    lengths = valid.sum(axis=1).astype(jnp.int32)
    return SampleOutput(tokens, logps, mask, lengths, kept, None, prompt_experts, experts)

  return jax.jit(sample)


_cached_sampler = functools.lru_cache(maxsize=32)(make_sampler)


def generate(
  model,
  prompt_tokens: ArrayLike,
  prompt_lengths: ArrayLike,
  *,
  key: jax.Array,
  max_new_tokens: int,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  eos_id: int | Sequence[int] | None = None,
  stop_sequences: Sequence[Sequence[int]] | None = None,
) -> SampleOutput:
  """Samples one response per left-padded prompt (see the module docstring).

  Args:
    model: a `models.Decoder`.
    prompt_tokens: int32 [B, P] left-padded prompts.
    prompt_lengths: int32 [B] number of real prompt tokens (>= 1).
    key: PRNG key.
    max_new_tokens: N.
    temperature: softmax temperature; 0 for greedy.
    top_p: nucleus mass.
    top_k: top-k truncation (0 = off).
    eos_id: end-of-sequence id (or ids) or None.
    stop_sequences: extra token-id sequences that end a response.

  Returns:
    SampleOutput with tokens, logprobs, mask [B, N] and lengths [B].
  """
  graphdef, params = nnx.split(model)
  stops = None if not stop_sequences else tuple(tuple(int(t) for t in s) for s in stop_sequences)
  fn = _cached_sampler(
    graphdef,
    max_new_tokens=max_new_tokens,
    group_size=1,
    temperature=float(temperature),
    top_p=float(top_p),
    top_k=int(top_k),
    eos_id=None if eos_id is None else tuple(int(t) for t in np.atleast_1d(eos_id)),
    stop_sequences=stops,
  )
  return fn(params, prompt_tokens, prompt_lengths, key)
