"""The granularity axis of a loss: which log-ratio each token sees.

``token``: ``l_t - l_mu_t``; ``seq_prod``: the sequence sum (product ratio);
``seq_geo``: the sequence mean (geometric-mean ratio, GSPO; with GMPO's
sign-aware clip in log space); ``seq_geo_token``: GSPO-token's
``sg(s_i) * pi / sg(pi)``; ``turn_geo``: the mean over each turn (ST-PPO);
``prefix_min``: the running minimum over the prefix (MinPRO).
"""

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient


def seq_sum(x_bt, valid):
  """Sum of ``x`` over the valid tokens of each row, [B, 1]."""
  return jnp.sum(jnp.where(valid, x_bt, 0.0), axis=-1, keepdims=True)


def turn_mean(x_bt, valid, turn_ids):
  """Mean of ``x`` over the valid tokens of each token's turn, [B, T].

  Tokens of a row with equal ``turn_ids`` (ints in [0, T)) form a turn;
  ``turn_ids=None`` makes each sequence one turn.
  """
  x_bt = jnp.where(valid, x_bt, 0.0)
  if turn_ids is None:
    n_b = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
    return jnp.broadcast_to(jnp.sum(x_bt, axis=-1, keepdims=True) / n_b, x_bt.shape)
  b, t = x_bt.shape
  seg = (jnp.arange(b)[:, None] * t + jnp.clip(turn_ids, 0, t - 1)).reshape(-1)
  total = jax.ops.segment_sum(x_bt.reshape(-1), seg, num_segments=b * t)
  count = jax.ops.segment_sum(valid.reshape(-1).astype(x_bt.dtype), seg, num_segments=b * t)
  return (total / jnp.maximum(count, 1.0))[seg].reshape(b, t)


def log_ratio(spec, d, a, valid, n_b, turn_ids):
  """Level axis: the log of the ratio each token sees, and GMPO's clip flags."""
  clipped = jnp.zeros_like(valid)
  if spec.level == "token":
    return d, clipped
  if spec.level == "seq_prod":
    return jnp.broadcast_to(seq_sum(d, valid), d.shape), clipped
  if spec.level == "seq_geo":
    if spec.shaping == "log_clip":
      clipped = ((a > 0) & (d > spec.eps_high)) | ((a < 0) & (d < -spec.eps_low))
      bound = jnp.where(a > 0, spec.eps_high, -spec.eps_low)
      d = jnp.where(clipped, bound, d)
    return jnp.broadcast_to(seq_sum(d, valid) / n_b, d.shape), clipped & valid
  if spec.level == "turn_geo":
    return turn_mean(d, valid, turn_ids), clipped
  if spec.level == "seq_geo_token":
    return sg(seq_sum(d, valid) / n_b) + d - sg(d), clipped
  # prefix_min: running minimum of the token log-ratio, gradient through l_t.
  return jnp.where(valid, prefix_min(jnp.where(valid, sg(d), jnp.inf)), 0.0) + d - sg(d), clipped


def prefix_min(x_bt):
  """``min_{s <= t} x_bs`` along T: one sequential pass over time on [B] rows.

  On CPU a plain scan over T is ~3x faster than ``associative_scan`` /
  ``lax.cummin`` (strided slices or a quadratic reduce-window).
  """

  def step(running_b, x_b):
    running_b = jnp.minimum(running_b, x_b)
    return running_b, running_b

  _, prefix_tb = jax.lax.scan(step, jnp.full(x_bt.shape[:-1], jnp.inf, x_bt.dtype), x_bt.T)
  return prefix_tb.T
