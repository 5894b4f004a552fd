"""Memory-light teacher-forced log-probabilities and entropies.

  log pi(y_t | x, y_<t) = z_t[y_t] / tau - logsumexp(z_t / tau),
  H_t = -sum_v p_t(v) log p_t(v),  p_t = softmax(z_t / tau)

The decoder trunk runs once; the [D] -> [V] output projection and the float32
log-softmax run chunk by chunk over T under `lax.map` (rematerialised in the
backward pass), so at most one [B, chunk, V] float32 block of logits exists at
a time, forward or backward.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from offpolicy_jax.models.decoder import Decoder

DEFAULT_CHUNK = 128


def _token_logp_entropy(model, h_btd, targets_bt, temperature, chunk):
  b, t, d = h_btd.shape
  chunk = max(1, min(chunk, t))
  n_chunks = -(-t // chunk)
  pad = n_chunks * chunk - t
  h = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
  y = jnp.pad(targets_bt, ((0, 0), (0, pad)))
  h = h.reshape(b, n_chunks, chunk, d).swapaxes(0, 1)
  y = y.reshape(b, n_chunks, chunk).swapaxes(0, 1)

  def one(args):
    h_c, y_c = args
    logits = model.logits_from_hidden(h_c) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, y_c[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy

  # Rematerialise each chunk's logits in the backward pass: only [B, chunk, D] is saved.
  logp, entropy = jax.lax.map(jax.checkpoint(one), (h, y))
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

  Returns:
    (logp, entropy), float32 [B, T] each, zero where mask is 0.
  """
  mask = jnp.asarray(mask)
  h, _ = model.hidden_states(jnp.asarray(tokens), attention_mask=mask)
  logp, entropy = _token_logp_entropy(
    model, h, jnp.asarray(targets, jnp.int32), temperature, chunk_size
  )
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
):
  """Teacher-forced log-probs and entropies of response tokens after a left-padded prompt.

  Equals the sampler's behaviour log-probs at the same parameters when top_p=1
  and top_k=0 (float32).

  Args:
    model: the decoder.
    prompt_tokens: int32 [B, P] left-padded prompts.
    prompt_mask: [B, P] 1 on real prompt tokens.
    tokens: int32 [B, N] response tokens.
    mask: [B, N] 1 on valid response tokens.
    temperature: tau applied to the logits.
    chunk_size: response positions per chunk of the output projection.

  Returns:
    (logp, entropy), float32 [B, N] each, zero where mask is 0.
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  tokens = jnp.asarray(tokens, jnp.int32)
  p = prompt_tokens.shape[1]
  n = tokens.shape[1]
  mask = jnp.asarray(mask)
  full_tokens = jnp.concatenate([prompt_tokens, tokens], axis=1)
  # Response tokens after the first invalid one never influence valid ones (causal).
  full_mask = jnp.concatenate([jnp.asarray(prompt_mask) > 0, jnp.ones(tokens.shape, bool)], axis=1)
  h, _ = model.hidden_states(full_tokens, attention_mask=full_mask)
  h = h[:, p - 1 : p - 1 + n]
  logp, entropy = _token_logp_entropy(model, h, tokens, temperature, chunk_size)
  m = (mask > 0).astype(jnp.float32)
  return logp * m, entropy * m


def shared_prefix_logprobs(
  model: Decoder,
  prompt_tokens: ArrayLike,
  prompt_mask: ArrayLike,
  tokens: ArrayLike,
  mask: ArrayLike,
  group_size: int,
  temperature: float = 1.0,
  chunk_size: int = DEFAULT_CHUNK,
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

  Returns:
    (logp, entropy), float32 [G*K, N] each, zero where mask is 0.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  h_p, h_s = model.shared_prefix_hidden_states(
    jnp.asarray(prompt_tokens, jnp.int32), prompt_mask, tokens, group_size
  )
  # Position t scores token t: the first from the prompt's last state, the rest
  # from the response's own states.
  first = jnp.repeat(h_p[:, -1:], group_size, axis=0)
  h = jnp.concatenate([first, h_s[:, :-1]], axis=1)
  logp, entropy = _token_logp_entropy(model, h, tokens, temperature, chunk_size)
  m = (jnp.asarray(mask) > 0).astype(jnp.float32)
  return logp * m, entropy * m
