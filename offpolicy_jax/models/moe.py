"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): top-k routing, dropless dispatch.

  p_t        = softmax(x_t W_router)                       float32 [E]
  S_t        = top-k(p_t)                                   the token's k experts
  w_te       = p_te (/ sum_{e' in S_t} p_te' if norm_topk_prob),   e in S_t
  y_t        = sum_{e in S_t} w_te * W_down_e (silu(x_t W_gate_e) * x_t W_up_e)

Dropless: every (token, expert) pair is computed, whatever the load. The T*k
pairs are sorted by expert and each expert's contiguous rows go through its
weights with one grouped matmul (`jax.lax.ragged_dot`, a grouped GEMM on
GPU/TPU), so no capacity factor drops or pads tokens and a token's output
never depends on the other tokens of the batch: the sampler's one-token
steps and the learner's teacher-forced pass compute the same function.

Experts are stacked ``[E, ...]`` with logical axis ``expert`` (`scale.sharding`).

Routing replay (R3, "Stabilizing MoE RL by Aligning Training and Inference
Routers", arXiv:2510.11370): the sampler records each token's k experts in
every block (`MoE.forward` returns them) and the learner, given them back as
`recorded` with `replay`, routes each token to those experts, mixing them
with the weights its own router gives them (so the router still learns).
Given `recorded`, `RouterStats.agree` counts the tokens whose own top-k set
is the recorded one, replayed or not.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax.models.config import ModelConfig
from offpolicy_jax.models.layers import param
from offpolicy_jax.scale.sharding import EXPERT

# `ragged_dot_general` dimension numbers of an expert's weight gradient:
# dW_e = x_e^T g_e, contracting over the rows of group e (ragged rows of both sides).
_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((0,), (0,)), ((), ())),
  lhs_ragged_dimensions=[0],
  rhs_group_dimensions=[],
)


def _batched_at_0(fn):
  """`fn` whose `vmap` batches every operand on axis 0 first (broadcasting the unbatched).

  JAX batches `ragged_dot` only when all its operands are batched on axis 0;
  the study's seeds share a LoRA run's frozen experts (unbatched weights).
  """
  f = jax.custom_batching.custom_vmap(fn)

  @f.def_vmap
  def _rule(axis_size, in_batched, *args):
    full = [a if b else _broadcast(a, axis_size) for a, b in zip(args, in_batched, strict=True)]
    return jax.vmap(fn)(*full), True

  return f


def _broadcast(a, n: int):
  return jnp.broadcast_to(a, (n, *jnp.shape(a)))


_ragged_dot = _batched_at_0(lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes))
_ragged_weight_grad = _batched_at_0(
  lambda x, g, sizes: jax.lax.ragged_dot_general(x, g, sizes, _WEIGHT_GRAD)
)


@jax.custom_vjp
def grouped_matmul(x_rd: jax.Array, w_edf: jax.Array, sizes_e: jax.Array) -> jax.Array:
  """Rows of group e times `w[e]`: [R, D] x [E, D, F] -> [R, F] (rows sorted by group).

  `jax.lax.ragged_dot` with its own gradient: JAX's transposition of
  `ragged_dot` does not batch under `vmap` (the study's seeds), while the
  ragged-contraction form written here does; every operand is batched on
  axis 0 before the ragged products (`_batched_at_0`), so any of them may be
  shared across a `vmap`.
  """
  return _ragged_dot(x_rd, w_edf, sizes_e)


def _grouped_fwd(x_rd, w_edf, sizes_e):
  return grouped_matmul(x_rd, w_edf, sizes_e), (x_rd, w_edf, sizes_e)


def _grouped_bwd(res, g_rf):
  x_rd, w_edf, sizes_e = res
  dx = _ragged_dot(g_rf, jnp.swapaxes(w_edf, 1, 2), sizes_e)
  dw = _ragged_weight_grad(x_rd, g_rf, sizes_e)
  return dx.astype(x_rd.dtype), dw.astype(w_edf.dtype), None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


def index_dtype(num_experts: int):
  """The integer dtype recorded expert indices are stored in: uint8 up to 256 experts."""
  return jnp.uint8 if num_experts <= 256 else jnp.int16


class Routing(NamedTuple):
  """One block's routing of T tokens.

  Attributes:
    experts: int32 [T, k] the chosen experts, in decreasing probability.
    weights: float32 [T, k] their mixing weights.
    probs: float32 [T, E] the router's softmax over all experts.
  """

  experts: jax.Array
  weights: jax.Array
  probs: jax.Array


def route(logits_te: jax.Array, k: int, normalize: bool, experts=None) -> Routing:
  """Top-k routing of router logits [T, E]; with `experts` [T, k], those experts instead.

  Given experts (routing replay), their weights are the router's current
  probabilities of them, renormalised as configured.
  """
  probs = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
  if experts is None:
    weights, experts = jax.lax.top_k(probs, k)
  else:
    experts = jnp.asarray(experts, jnp.int32)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(experts.astype(jnp.int32), weights, probs)


class RouterStats(NamedTuple):
  """Sums over tokens of a block's routing: what the load-balancing loss and diagnostics read.

  A decoder's stats stack its blocks on a leading axis ([L, E], [L]); the
  methods reduce over every leading axis.

  Attributes:
    chosen: float32 [..., E] how often each expert was among a token's k.
    probs: float32 [..., E] the router's probabilities of each expert, summed.
    tokens: float32 [...] tokens counted.
    agree: float32 [...] of them, those whose own top-k set is the recorded one
      (0 without a recorded routing).
  """

  chosen: jax.Array
  probs: jax.Array
  tokens: jax.Array
  agree: jax.Array

  @classmethod
  def of(cls, routing: Routing, mask_t=None, own=None, recorded=None) -> "RouterStats":
    """The sums over the tokens with `mask_t` [T] (all if None).

    With `own` and `recorded` [T, k] (the router's own top-k and the sampler's
    choice), `agree` counts the tokens where the two sets are equal.
    """
    t, e = routing.probs.shape
    m = jnp.ones((t,), jnp.float32) if mask_t is None else jnp.asarray(mask_t, jnp.float32)
    chosen = jnp.sum(jax.nn.one_hot(routing.experts, e, dtype=jnp.float32), axis=1)  # [T, E]
    agree = jnp.zeros((), jnp.float32)
    if recorded is not None:
      same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(recorded, axis=-1), axis=-1)
      agree = m @ same.astype(jnp.float32)
    return cls(m @ chosen, m @ routing.probs, jnp.sum(m), agree)

  def __add__(self, other):  # stats of two token sets together
    return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))

  def loss(self) -> jax.Array:
    """Switch-style auxiliary loss E * sum_e f_e P_e over every block's tokens at once."""
    e = self.chosen.shape[-1]
    n = jnp.maximum(jnp.sum(self.tokens), 1.0)
    chosen, probs = self.chosen.reshape(-1, e).sum(0), self.probs.reshape(-1, e).sum(0)
    return e * jnp.sum((chosen / n) * (probs / n))

  def max_load(self) -> jax.Array:
    """The busiest expert's share of a block's chosen slots times E, the largest block's
    (1 when balanced, E / k when one expert is in every token's k)."""
    e = self.chosen.shape[-1]
    chosen = self.chosen.reshape(-1, e)
    return jnp.max(jnp.max(chosen, axis=-1) * e / jnp.maximum(jnp.sum(chosen, axis=-1), 1.0))

  def agreement(self) -> jax.Array:
    """Per block [...], the share of counted tokens whose own top-k is the recorded one."""
    return self.agree / jnp.maximum(self.tokens, 1.0)


class Routed(NamedTuple):
  """A decoder forward's routing (`models.decoder.Decoder.routed`).

  Attributes:
    stats: `RouterStats` of every block stacked [L, ...], or None (not asked for).
    experts: int32 [B, T, L, k] the experts each token took in each block.
  """

  stats: RouterStats | None
  experts: jax.Array


def by_layer(experts_btlk):
  """Recorded experts [B, T, L, k] as per-layer inputs [L, B, T, k] (None stays None)."""
  return None if experts_btlk is None else jnp.moveaxis(jnp.asarray(experts_btlk), 2, 0)


def load_balancing_loss(routing: Routing, mask_t=None) -> jax.Array:
  """Switch-style auxiliary loss E * sum_e f_e P_e over the tokens with `mask_t` (all if None).

  f_e is the fraction of tokens that have expert e among their k (summed over
  the k slots) and P_e the mean router probability of e (Fedus et al.,
  arXiv:2101.03961; the `load_balancing_loss_func` of transformers' Mixtral /
  Qwen3-MoE, over every block's tokens at once): k when the load is balanced,
  up to E when every token goes to the same k experts.
  """
  return RouterStats.of(routing, mask_t).loss()


class MoE(nnx.Module):
  """A block's mixture of E SwiGLU experts with a linear top-k router (module docstring)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    pd = jnp.dtype(config.param_dtype)
    self.config = config
    d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
    self.dtype = jnp.dtype(config.dtype)
    self.router = param(rngs.params(), (d, e), ("embed", None), pd)
    self.gate_proj = param(rngs.params(), (e, d, f), (EXPERT, "embed", "mlp"), pd)
    self.up_proj = param(rngs.params(), (e, d, f), (EXPERT, "embed", "mlp"), pd)
    self.down_proj = param(rngs.params(), (e, f, d), (EXPERT, "mlp", "embed"), pd)

  def routing(self, x_td: jax.Array, experts=None) -> Routing:
    """The routing of tokens [T, D]; `experts` [T, k] replays a recorded choice."""
    c = self.config
    return route(self._logits(x_td), c.num_experts_per_tok, c.norm_topk_prob, experts)

  def _logits(self, x_td):
    w = self.router[...].astype(self.dtype)
    return jnp.einsum("td,de->te", x_td, w, preferred_element_type=jnp.float32)

  def __call__(self, x_btd: jax.Array, key=None) -> jax.Array:
    """y [B, T, D] (`key`, the adapters' dropout key, is unused: experts carry no adapters)."""
    return self.forward(x_btd)[0]

  def forward(self, x_btd: jax.Array, mask_bt=None, recorded=None, replay: bool = False):
    """`(y [B, T, D], stats, experts [B, T, k] int32)`: the block's output and routing.

    Args:
      x_btd: the block's normalised input.
      mask_bt: [B, T] tokens the `RouterStats` count; None: no stats (None returned).
      recorded: int [B, T, k] experts the sampler chose (routing replay), or None.
      replay: route along `recorded` (R3) instead of the router's own top-k.
    """
    b, t, d = x_btd.shape
    c = self.config
    x_td = x_btd.reshape(b * t, d)
    logits = self._logits(x_td)
    own = route(logits, c.num_experts_per_tok, c.norm_topk_prob)
    rec = None if recorded is None else jnp.reshape(recorded, (b * t, -1)).astype(jnp.int32)
    routing = own
    if replay:
      if rec is None:
        raise ValueError("replay: routing replay needs the recorded experts")
      routing = route(logits, c.num_experts_per_tok, c.norm_topk_prob, rec)
    stats = None
    if mask_bt is not None:
      stats = RouterStats.of(routing, jnp.reshape(mask_bt, (b * t,)), own.experts, rec)
    out = self.mix(x_td, routing).reshape(b, t, d)
    return out, stats, routing.experts.reshape(b, t, -1)

  def mix(self, x_td: jax.Array, routing: Routing) -> jax.Array:
    """The experts' weighted outputs [T, D] for a given routing, dropless (module docstring)."""
    dt = self.dtype
    e, k = self.config.num_experts, self.config.num_experts_per_tok
    flat = routing.experts.reshape(-1)  # [T*k], pair p = token p // k
    order = jnp.argsort(flat, stable=True)
    rows = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(x_td, rows, axis=0)
    gate = grouped_matmul(xs, self.gate_proj[...].astype(dt), sizes)
    up = grouped_matmul(xs, self.up_proj[...].astype(dt), sizes)
    ys = grouped_matmul(jax.nn.silu(gate) * up, self.down_proj[...].astype(dt), sizes)
    ys = ys * routing.weights.reshape(-1)[order][:, None].astype(dt)
    return jnp.zeros_like(x_td).at[rows].add(ys)
