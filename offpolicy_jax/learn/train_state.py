"""The trainer's state and optimizer: `TrainState`, `make_optimizer`, `init_train_state`.

`TrainState.version` counts optimizer steps, skipped ones included, so it
follows the lag schedule of docs/science.md s5: version ``k`` is "the parameters
after ``k`` optimizer steps". The step that updates it is in `train_step.py`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from offpolicy_jax.models import layout
from offpolicy_jax.scale import sharding


class TrainState(NamedTuple):
  """Everything the train step updates.

  Attributes:
    params: NNX parameter state (``nnx.split(model)[1]``).
    opt_state: optax state of ``params``.
    step: int32 [] train-step calls (batches consumed).
    version: int32 [] optimizer steps taken, skipped ones included; version
      ``k`` = "after ``k`` optimizer steps" (the lag schedule's unit).
    num_skipped: int32 [] optimizer steps skipped (non-finite or empty).
    reward_stats: float32 [3] the running statistics of the critic's reward
      normalisation (`critic.normalized_rewards`), or None without it.
  """

  params: Any
  opt_state: Any
  step: jax.Array
  version: jax.Array
  num_skipped: jax.Array
  reward_stats: Any = None


def make_optimizer(
  learning_rate: float,
  *,
  warmup_steps: int = 0,
  total_steps: int | None = None,
  schedule: str = "constant",
  weight_decay: float = 0.0,
  max_grad_norm: float | None = 1.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  moment_dtype: str = "float32",
  head_learning_rate: float | None = None,
  separate_critic: bool = False,
) -> optax.GradientTransformation:
  """Global-norm clipping followed by AdamW on a warmup + constant/cosine schedule.

  Weight decay applies to parameters with two or more dimensions only.

  Args:
    learning_rate: peak learning rate.
    warmup_steps: linear warmup from 0 over this many optimizer steps.
    total_steps: length of the cosine decay (``schedule="cosine"``).
    schedule: ``constant`` or ``cosine``.
    weight_decay: decoupled weight decay (AdamW, Loshchilov & Hutter,
      arXiv:1711.05101).
    max_grad_norm: global-norm clip; None or 0 disables it.
    b1, b2, eps: Adam constants.
    moment_dtype: ``float32`` or ``bfloat16``: the dtype both Adam moments are
      kept in between steps (`stored_as`; bfloat16 halves the optimizer's
      memory; the update itself is computed in float32).
    head_learning_rate: the critic's rate (its value head's, and a separate
      critic's whole); None: the policy's.
    separate_critic: the parameters hold a separate critic (`models.value`),
      whose gradient is clipped by its own global norm (the policy's by its).

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: naming the field for invalid settings.
  """
  if learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0, got {learning_rate}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
  if schedule not in ("constant", "cosine"):
    raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
  if schedule == "cosine" and (total_steps is None or total_steps <= warmup_steps):
    raise ValueError(f"total_steps must exceed warmup_steps for cosine, got {total_steps}")

  def adamw(peak: float) -> optax.GradientTransformation:
    if schedule == "cosine":
      lr: Any = optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps, total_steps)
    elif warmup_steps:
      lr = optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup_steps), optax.constant_schedule(peak)],
        [warmup_steps],
      )
    else:
      lr = peak
    # Matrices only (not norms or biases), whether blocks are stacked over layers or not.
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, p: layout.weight_ndim(path, p) >= 2, params
    )
    return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)

  adam = adamw(learning_rate)
  if head_learning_rate is not None:  # the critic's value head (`models.value`) at its own rate
    if not head_learning_rate > 0 or not learning_rate > 0:
      raise ValueError(
        f"head_learning_rate: both rates must be > 0, got {head_learning_rate} and {learning_rate}"
      )
    adam = optax.chain(adam, _scale_head(head_learning_rate / learning_rate))
  if moment_dtype not in ("float32", "bfloat16"):
    raise ValueError(f"moment_dtype must be 'float32' or 'bfloat16', got {moment_dtype!r}")
  if moment_dtype != "float32":
    adam = stored_as(jnp.dtype(moment_dtype), adam)
  if max_grad_norm and separate_critic:  # each model's gradient clipped on its own
    clip = optax.clip_by_global_norm(max_grad_norm)
    labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "critic" if in_critic(path) else "policy", params
    )
    return optax.chain(optax.multi_transform({"policy": clip, "critic": clip}, labels), adam)
  if max_grad_norm:
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adam)
  return adam


def in_critic(path) -> bool:
  """Whether a parameter's path is the critic's: a value head's or a separate critic's."""
  return any(getattr(entry, "key", None) in ("value_head", "critic") for entry in path)


def _scale_head(k: float) -> optax.GradientTransformation:
  """Multiplies the critic's updates (`models.value`: its value head, or a separate critic
  whole) by `k`, the others' by 1.

  After AdamW this is AdamW at `k` times the rate for the head, its decoupled
  weight decay included: Adam's step does not depend on the gradient's scale,
  so each parameter's moments are the same either way. Not
  `optax.multi_transform` with two AdamWs: the same update, but a second,
  masked optimizer state that checkpoints would have to store.
  """

  def update(updates, state, params=None):
    del params
    scaled = jax.tree_util.tree_map_with_path(lambda p, u: u * k if in_critic(p) else u, updates)
    return scaled, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def stored_as(dtype: Any, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` with its floating-point state kept in `dtype` between steps, computed in float32.

  optax's Adam takes a dtype for its first moment only (`mu_dtype`); this keeps
  both moments (and any other float state) in `dtype`, so bfloat16 halves an
  Adam state's memory. Each update reads the state as float32, runs `inner` and
  rounds the new state to `dtype`. With bfloat16's 8-bit mantissa an increment
  below about 0.4% of the moment is lost to rounding: the second moment's
  (1 - b2) * g^2 needs b2 <= 0.99 (the config's default) to keep moving.
  """

  def cast(tree: Any, to: Any) -> Any:
    floating = lambda x: jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
    return jax.tree.map(lambda x: x.astype(to) if floating(x) else x, tree)

  def init(params):
    return cast(inner.init(params), dtype)

  def update(updates, state, params=None):
    new_updates, new_state = inner.update(updates, cast(state, jnp.float32), params)
    return new_updates, cast(new_state, dtype)

  return optax.GradientTransformation(init, update)


def init_train_state(
  params: Any,
  optimizer: optax.GradientTransformation,
  *,
  mesh: Mesh | None = None,
  version: int = 0,
  reward_stats: bool = False,
) -> TrainState:
  """Creates a ``TrainState``, sharded over ``mesh`` by logical names when given.

  Args:
    params: NNX parameter state.
    optimizer: the optax transformation.
    mesh: optional mesh; parameters and optimizer state are placed by
      :func:`offpolicy_jax.sharding.tree_shardings`.
    version: initial version.
    reward_stats: keep running reward statistics (zero at the start).

  Returns:
    The initial :class:`TrainState` (holding a copy of ``params``).
  """
  # A copy, so donating the state never deletes the caller's arrays.
  params = jax.tree.map(jnp.copy, params)
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
    opt_sh = sharding.tree_shardings(jax.eval_shape(optimizer.init, params), mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
    rep = sharding.replicated(mesh)
    zero = lambda v: sharding.put(jnp.asarray(v, jnp.int32), rep)
    stats = sharding.put(jnp.zeros((3,), jnp.float32), rep) if reward_stats else None
  else:
    opt_state = optimizer.init(params)
    zero = lambda v: jnp.asarray(v, jnp.int32)
    stats = jnp.zeros((3,), jnp.float32) if reward_stats else None
  return TrainState(params, opt_state, zero(0), zero(version), zero(0), stats)


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
  """``NamedSharding`` tree of a ``TrainState`` (params/opt state by logical names)."""
  rep: Any = sharding.replicated(mesh)  # a pytree of shardings mirrors the state
  return TrainState(
    params=sharding.tree_shardings(state.params, mesh),
    opt_state=sharding.tree_shardings(state.opt_state, mesh),
    step=rep,
    version=rep,
    num_skipped=rep,
    reward_stats=None if state.reward_stats is None else rep,
  )


def all_finite(tree: Any) -> jax.Array:
  """Whether every floating-point leaf of ``tree`` is finite (no NaN, no +-inf).

  One reduction per leaf, traced into the caller's jit (no host sync); integer
  leaves (optimizer step counts) are ignored.

  Args:
    tree: a pytree of arrays, e.g. ``(params, opt_state)``.

  Returns:
    bool [] array.
  """
  # x * 0 is 0 where x is finite and NaN where it is NaN or +-inf, so the sum over every
  # leaf is finite exactly when every element is (sums of zeros are exact). One sum per
  # leaf and one scalar test compile faster than a boolean `all` per leaf: qwen2.5-0.5b's
  # train step 18.3-18.7 s against 20.5-22.4 s (docs/results/compile_time.md).
  zeros = [
    jnp.sum(x * 0).astype(jnp.float32)
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
  return jnp.isfinite(sum(zeros, jnp.float32(0)))


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the scalar `ok` holds, else `old` (pytrees of one structure).

  One `lax.cond`, not a `jnp.where` per leaf: XLA fused the whole predicate
  (a term per leaf, `all_finite`) into every leaf's select, quadratic in the
  leaves: most of a 24-layer train step's compile time (754 s of 0.5B on CPU,
  `benchmarks/compile_time.py`, docs/speed.md).
  """
  return jax.lax.cond(ok, lambda: new, lambda: old)
