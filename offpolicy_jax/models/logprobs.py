"""Memory-light teacher-forced log-probabilities and entropies.

  log pi(y_t | x, y_<t) = z_t[y_t] / tau - logsumexp(z_t / tau),
  H_t = -sum_v p_t(v) log p_t(v),  p_t = softmax(z_t / tau)

The decoder trunk runs once; the [D] -> [V] output projection and the float32
log-softmax run chunk by chunk over T under `lax.map` (rematerialised in the
backward pass), so at most one [B, chunk, V] float32 block of logits exists at
a time, forward or backward.

Truncated scoring (the log-prob contract, docs/science.md s7). A sampler with
top-k / top-p draws y_t from q_t = p_t / Z_t on a kept set S_t, Z_t = p_t(S_t).
Given `kept` m_t = |S_t| (recorded by the sampler, `SampleOutput.kept`) the
learner scores

  log q_t(y_t) = log p_t(y_t) - log Z_t,
  Z_t = C_{m-1} + min(p_(m), p_t(y_t)),

with p_(j) the j-th largest probability and C_j = p_(1) + ... + p_(j): the
mass of y_t and the m - 1 most likely other tokens. S_t is always the m_t most
likely tokens (top-k keeps a prefix of the sorted vocabulary, ties included;
top-p keeps a prefix), so at the behaviour's parameters Z_t is the sampler's
kept mass and log q_t is the recorded log mu_t (float32: within 1e-5).

Why a recorded count and not a recomputed set or a threshold: the learner's
logits differ from the sampler's by float noise (another kernel, the KV
cache; bf16 sampling), and both a recomputed top-p set and a recorded
threshold logit can lose or gain a near-threshold token with a large
probability, changing Z_t by that probability. The sum of the m largest
probabilities is continuous in the logits: noise that reorders two tokens
near the boundary changes Z_t by their (near-zero) difference. Away from the
behaviour's parameters, q is the tempered softmax truncated to its own m_t
most likely tokens with y_t kept (finite and continuous in theta); the next
sampler's top-p rule may keep a different number, which its own record
carries. The entropy stays that of the untruncated p_t.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from offpolicy_jax.models import value
from offpolicy_jax.models.decoder import Decoder

DEFAULT_CHUNK = 128


class Scored(NamedTuple):
  """What one teacher-forced pass gives (`sequence_logprobs(..., full=True)`).

  Attributes:
    logp, entropy: float32 [B, N], zero where the mask is 0.
    stats: the experts' `moe.RouterStats` over the real prompt and valid
      response tokens, per block, or None for a dense model.
    values: float32 [B, N] the value head's V(s_t) at the state before each
      response token (`models.value`), zero where the mask is 0, or None for a
      model without one.
  """

  logp: jax.Array
  entropy: jax.Array
  stats: Any = None
  values: jax.Array | None = None


def _scored(model, h, tokens, mask, temperature, chunk, kept, top_k, stats, full: bool, hidden):
  """`hidden(decoder) -> [B, N, D]`: a decoder's states at the response's scoring positions
  (the separate critic's forward, `models.value`); `h` is the policy's."""
  logp, entropy = _token_logp_entropy(model, h, tokens, temperature, chunk, kept, top_k)
  m = (jnp.asarray(mask) > 0).astype(jnp.float32)
  if not full:
    return logp * m, entropy * m
  v = value.values_of(model, h, hidden)
  return Scored(logp * m, entropy * m, stats, None if v is None else v * m)


def log_kept_mass(logp_v: jax.Array, logp_y: jax.Array, kept: jax.Array, top_k: int = 0):
  """log Z: the log-mass of y and the m - 1 most likely other tokens (module docstring).

  Args:
    logp_v: float32 [..., V] normalised log-probs log p.
    logp_y: float32 [...] log p(y) of the scored token.
    kept: int [...] m, the kept set's size (clipped to [1, V]; 0 on padding).
    top_k: the sampler's top-k (0 = off). The kept set then lies within the
      top_k largest values and their ties, so only those are sorted, and a
      count beyond top_k counts ties of the top_k-th value.

  Returns:
    float32 [...] log Z <= 0 (0 when m = V).
  """
  v = logp_v.shape[-1]
  width = min(top_k, v) if top_k else v
  top = jax.lax.top_k(logp_v, width)[0]  # descending
  m = jnp.clip(kept, 1, v)[..., None]
  others = m - 1
  s0 = top[..., :1]
  cum = jnp.cumsum(jnp.exp(top - s0), axis=-1)  # C_j / p_(1), j = 1..width
  upto = jnp.minimum(others, width)
  c = jnp.where(upto > 0, jnp.take_along_axis(cum, jnp.maximum(upto - 1, 0), axis=-1), 0.0)
  c = c + jnp.maximum(others - width, 0) * jnp.exp(top[..., -1:] - s0)  # ties beyond top_k
  log_c = jnp.where(c > 0, s0 + jnp.log(jnp.where(c > 0, c, 1.0)), -jnp.inf)
  p_m = jnp.take_along_axis(top, jnp.minimum(m, width) - 1, axis=-1)
  return jnp.logaddexp(log_c, jnp.minimum(p_m, logp_y[..., None]))[..., 0]


def _chunked(x_bt, n_chunks, chunk):
  b, t = x_bt.shape[:2]
  x = jnp.pad(x_bt, ((0, 0), (0, n_chunks * chunk - t)) + ((0, 0),) * (x_bt.ndim - 2))
  return x.reshape(b, n_chunks, chunk, *x_bt.shape[2:]).swapaxes(0, 1)


def _token_logp_entropy(model, h_btd, targets_bt, temperature, chunk, kept_bt=None, top_k=0):
  b, t, _ = h_btd.shape
  chunk = max(1, min(chunk, t))
  n_chunks = -(-t // chunk)
  h = _chunked(h_btd, n_chunks, chunk)
  y = _chunked(targets_bt, n_chunks, chunk)
  kept = None if kept_bt is None else _chunked(jnp.asarray(kept_bt, jnp.int32), n_chunks, chunk)

  def one(args):
    h_c, y_c, kept_c = args
    logits = model.logits_from_hidden(h_c) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, y_c[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    if kept_c is not None:
      logp = logp - log_kept_mass(logp_all, logp, kept_c, top_k)
    return logp, entropy

  # Rematerialise each chunk's logits in the backward pass: only [B, chunk, D] is saved.
  logp, entropy = jax.lax.map(jax.checkpoint(one), (h, y, kept))
  logp = logp.swapaxes(0, 1).reshape(b, -1)[:, :t]
  entropy = entropy.swapaxes(0, 1).reshape(b, -1)[:, :t]
  return logp, entropy


def logprobs(
  model: Decoder,
  tokens: ArrayLike,
  targets: ArrayLike,
  mask: ArrayLike,
  temperature: float = 1.0,
  chunk_size: int = DEFAULT_CHUNK,
  kept: ArrayLike | None = None,
  top_k: int = 0,
):
  """Per-position log-prob of `targets` given `tokens`, and the entropy.

  Position t scores targets[b, t] under the next-token distribution after
  tokens[b, :t+1]; the mask is also the attention mask (left padding is exact).

  Args:
    model: the decoder.
    tokens: int32 [B, T] input tokens.
    targets: int32 [B, T] next tokens to score.
    mask: [B, T] 1 on real tokens.
    temperature: tau, logits are divided by it before the log-softmax.
    chunk_size: positions per chunk of the output projection.
    kept: int [B, T] the sampler's kept-set sizes (`SampleOutput.kept`):
      score the truncated distribution it drew from (module docstring);
      None scores the full tempered softmax.
    top_k: the sampler's top-k (0 = off), which bounds the kept set.

  Returns:
    (logp, entropy), float32 [B, T] each, zero where mask is 0.
  """
  mask = jnp.asarray(mask)
  h, _ = model.hidden_states(jnp.asarray(tokens), attention_mask=mask)
  targets = jnp.asarray(targets, jnp.int32)
  logp, entropy = _token_logp_entropy(model, h, targets, temperature, chunk_size, kept, top_k)
  m = (mask > 0).astype(jnp.float32)
  return logp * m, entropy * m


def sequence_logprobs(
  model: Decoder,
  prompt_tokens: ArrayLike,
  prompt_mask: ArrayLike,
  tokens: ArrayLike,
  mask: ArrayLike,
  temperature: float = 1.0,
  chunk_size: int = DEFAULT_CHUNK,
  kept: ArrayLike | None = None,
  top_k: int = 0,
  dropout_key: jax.Array | None = None,
  full: bool = False,
  recorded=None,
  replay: bool = False,
):
  """Teacher-forced log-probs and entropies of response tokens after a left-padded prompt.

  Equals the sampler's behaviour log-probs at the same parameters (float32):
  without truncation as is, with top-k / top-p given the sampler's `kept`.

  Args:
    model: the decoder.
    prompt_tokens: int32 [B, P] left-padded prompts.
    prompt_mask: [B, P] 1 on real prompt tokens.
    tokens: int32 [B, N] response tokens.
    mask: [B, N] 1 on valid response tokens.
    temperature: tau applied to the logits.
    chunk_size: response positions per chunk of the output projection.
    kept: int [B, N] the sampler's kept-set sizes (`SampleOutput.kept`):
      score the truncated distribution it drew from (module docstring);
      None scores the full tempered softmax.
    top_k: the sampler's top-k (0 = off), which bounds the kept set.
    dropout_key: the adapters' input dropout key (`models.lora_ops`; the
      train step's current-policy forward only); None runs without dropout.
    full: return a `Scored`, with the experts' router statistics and the
      value head's values (None where the model has none).
    recorded: the experts the sampler recorded, (prompts' [B, P, L, k],
      responses' [B, N, L, k]) (`sampling.SampleOutput`), or None: the stats
      then count how often the learner's own routing agrees with them.
    replay: route along `recorded` (routing replay, R3; `models.moe`).

  Returns:
    (logp, entropy), float32 [B, N] each, zero where mask is 0; with `full`,
    a `Scored`.
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  tokens = jnp.asarray(tokens, jnp.int32)
  p = prompt_tokens.shape[1]
  n = tokens.shape[1]
  mask = jnp.asarray(mask)
  full_tokens = jnp.concatenate([prompt_tokens, tokens], axis=1)
  # Response tokens after the first invalid one never influence valid ones (causal).
  full_mask = jnp.concatenate([jnp.asarray(prompt_mask) > 0, jnp.ones(tokens.shape, bool)], axis=1)
  router_mask = jnp.concatenate([jnp.asarray(prompt_mask) > 0, mask > 0], axis=1)
  rec = None if recorded is None else jnp.concatenate(recorded, axis=1)
  args = (full_tokens, None, full_mask, None, None, dropout_key, router_mask, rec, replay)
  h, _, routed = model.routed(*args)
  stats = None if routed is None else routed.stats
  hidden = lambda m: m.hidden_states(full_tokens, None, full_mask)[0][:, p - 1 : p - 1 + n]
  h = h[:, p - 1 : p - 1 + n]
  return _scored(model, h, tokens, mask, temperature, chunk_size, kept, top_k, stats, full, hidden)


def shared_prefix_logprobs(
  model: Decoder,
  prompt_tokens: ArrayLike,
  prompt_mask: ArrayLike,
  tokens: ArrayLike,
  mask: ArrayLike,
  group_size: int,
  temperature: float = 1.0,
  chunk_size: int = DEFAULT_CHUNK,
  kept: ArrayLike | None = None,
  top_k: int = 0,
  dropout_key: jax.Array | None = None,
  full: bool = False,
  recorded=None,
  replay: bool = False,
):
  """`sequence_logprobs` for K responses per prompt, each prompt run once per group.

  Rows are group-major (row ``g * K + k`` answers prompt ``g``). The prompt's
  keys and values are computed once per group and attended to by its K
  responses (`Decoder.shared_prefix_hidden_states`), so the prompt costs
  1/K of what it costs in `sequence_logprobs`; the results agree with it
  within float tolerance.

  Args:
    model: the decoder.
    prompt_tokens: int32 [G, P] left-padded prompts, one per group.
    prompt_mask: [G, P] 1 on real prompt tokens.
    tokens: int32 [G*K, N] response tokens.
    mask: [G*K, N] 1 on valid response tokens.
    group_size: K.
    temperature: tau applied to the logits.
    chunk_size: response positions per chunk of the output projection.
    kept: int [G*K, N] the sampler's kept-set sizes (`SampleOutput.kept`):
      score the truncated distribution it drew from (module docstring);
      None scores the full tempered softmax.
    top_k: the sampler's top-k (0 = off), which bounds the kept set.
    dropout_key: as for `sequence_logprobs`.
    full: as for `sequence_logprobs` (the router counts each prompt K times).
    recorded: as for `sequence_logprobs`, the prompts' experts per group [G, P, L, k].
    replay: as for `sequence_logprobs`.

  Returns:
    (logp, entropy), float32 [G*K, N] each, zero where mask is 0; with `full`,
    a `Scored`.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)

  def hidden(m, routed=False, *args):
    h_p, h_s, stats = m.shared_prefix_routed(prompt_tokens, prompt_mask, tokens, group_size, *args)
    # Position t scores token t: the first from the prompt's last state, the rest
    # from the response's own states.
    first = jnp.repeat(h_p[:, -1:], group_size, axis=0)
    h = jnp.concatenate([first, h_s[:, :-1]], axis=1)
    return (h, stats) if routed else h

  h, stats = hidden(model, True, dropout_key, mask, recorded, replay)
  return _scored(model, h, tokens, mask, temperature, chunk_size, kept, top_k, stats, full, hidden)
