"""The pure, sharded train step: ``(state, batch, key) -> (state, metrics)``.

One jitted call consumes one ``TrainBatch``. It splits the batch into
``num_minibatches`` optimizer steps (repeated for ``num_epochs``, reshuffled
each epoch), and each optimizer step into ``num_micro_batches`` micro-batches
scanned with ``lax.scan``. Per micro-batch it recomputes the current
log-probs (and proximal / reference log-probs when the loss needs them) and
differentiates the policy loss's ``loss_sum``; the summed gradient is divided
once by the summed ``loss_count``, so accumulation is exact:

  grad = (sum_i grad loss_sum_i) / (sum_i loss_count_i).

``TrainBatch.weights`` multiply the token mask per sequence (0 drops a row).
An optimizer step is skipped (params and optimizer state kept, the skip
counted in ``TrainState`` and in the metrics) when its batch is empty or
anything it computes is non-finite: the loss, the gradient norm, the new
parameters or the new optimizer state. Checking the new parameters covers the
update (finite params plus a non-finite update are non-finite), e.g. Adam with
``learning_rate=inf``, whose loss and gradient are finite. ``version`` counts
optimizer steps (skipped ones included, so it follows the lag schedule of
SCIENCE.md s5); staleness metrics are ``version - batch.versions`` over valid
tokens at the start of the call.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from offpolicy_jax import losses, models, sharding
from offpolicy_jax.types import TrainBatch


class TrainState(NamedTuple):
  """Everything the train step updates.

  Attributes:
    params: NNX parameter state (``nnx.split(model)[1]``).
    opt_state: optax state of ``params``.
    step: int32 [] train-step calls (batches consumed).
    version: int32 [] optimizer steps taken, skipped ones included; version
      ``k`` = "after ``k`` optimizer steps" (the lag schedule's unit).
    num_skipped: int32 [] optimizer steps skipped (non-finite or empty).
  """

  params: Any
  opt_state: Any
  step: jax.Array
  version: jax.Array
  num_skipped: jax.Array


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

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: naming the field for invalid settings.
  """
  if learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0, got {learning_rate}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
  if schedule == "constant":
    lr = (
      optax.join_schedules(
        [
          optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
          optax.constant_schedule(learning_rate),
        ],
        [warmup_steps],
      )
      if warmup_steps
      else learning_rate
    )
  elif schedule == "cosine":
    if total_steps is None or total_steps <= warmup_steps:
      raise ValueError(f"total_steps must exceed warmup_steps for cosine, got {total_steps}")
    lr = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, total_steps)
  else:
    raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
  decay_mask = lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)
  adam = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
  if max_grad_norm:
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adam)
  return adam


def init_train_state(
  params: Any,
  optimizer: optax.GradientTransformation,
  *,
  mesh: Mesh | None = None,
  version: int = 0,
) -> TrainState:
  """Creates a ``TrainState``, sharded over ``mesh`` by logical names when given.

  Args:
    params: NNX parameter state.
    optimizer: the optax transformation.
    mesh: optional mesh; parameters and optimizer state are placed by
      :func:`offpolicy_jax.sharding.tree_shardings`.
    version: initial version.

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
  else:
    opt_state = optimizer.init(params)
    zero = lambda v: jnp.asarray(v, jnp.int32)
  return TrainState(params, opt_state, zero(0), zero(version), zero(0))


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
  """``NamedSharding`` tree of a ``TrainState`` (params/opt state by logical names)."""
  rep: Any = sharding.replicated(mesh)  # a pytree of shardings mirrors the state
  return TrainState(
    params=sharding.tree_shardings(state.params, mesh),
    opt_state=sharding.tree_shardings(state.opt_state, mesh),
    step=rep,
    version=rep,
    num_skipped=rep,
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
  oks = [
    jnp.isfinite(x).all()
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
  return jnp.stack(oks).all() if oks else jnp.array(True)


def _split_micro(batch: TrainBatch, m: int) -> TrainBatch:
  # Strided split (row r goes to micro-batch r % m) keeps every micro-batch
  # spread over all data-parallel devices.
  def split(x):
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def _token_stats(logp, ent, batch: TrainBatch) -> dict[str, jax.Array]:
  """Exact sums/maxima over valid tokens of one micro-batch."""
  valid = batch.mask > 0
  m = valid.astype(jnp.float32)
  log_ratio = jnp.where(valid, logp - batch.behavior_logp, 0.0)
  ratio = jnp.exp(log_ratio)
  return {
    "tokens": m.sum(),
    "entropy_sum": (ent * m).sum(),
    # KL(mu || pi) from samples of mu: k1 = -log r, k3 = r - 1 - log r, r = pi/mu.
    "kl_k1_sum": (-log_ratio * m).sum(),
    "kl_k3_sum": ((ratio - 1.0 - log_ratio) * m).sum(),
    "ratio_sum": (ratio * m).sum(),
    "ratio_max": jnp.max(jnp.where(valid, ratio, -jnp.inf)),
    "ratio_min": jnp.min(jnp.where(valid, ratio, jnp.inf)),
  }


_SUMMED = ("skipped", "nonfinite", "valid_tokens", "loss_sum")


def _reduce(name: str, values: jax.Array) -> jax.Array:
  """Combines a metric over micro-batches or optimizer steps (leading axis)."""
  if name.endswith("_max"):
    return values.max(0)
  if name.endswith("_min"):
    return values.min(0)
  return values.sum(0) if name in _SUMMED else values.mean(0)


def _merge_stats(a, b):
  return {
    k: jnp.maximum(a[k], b[k])
    if k.endswith("_max")
    else jnp.minimum(a[k], b[k])
    if k.endswith("_min")
    else a[k] + b[k]
    for k in a
  }


def make_train_step(
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  loss: str | Any,
  *,
  num_micro_batches: int = 1,
  micro_batch_size: int | None = None,
  num_minibatches: int = 1,
  num_epochs: int = 1,
  temperature: float = 1.0,
  mesh: Mesh | None = None,
  donate: bool = True,
  jit: bool = True,
  **loss_overrides: Any,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
  """Builds the jitted train step.

  Args:
    graphdef: the model's ``GraphDef`` (``nnx.split(model)[0]``).
    optimizer: optax transformation (see :func:`make_optimizer`).
    loss: loss preset name or ``losses.LossSpec``.
    num_micro_batches: gradient-accumulation micro-batches per optimizer step.
    micro_batch_size: rows per micro-batch; overrides ``num_micro_batches``.
    num_minibatches: optimizer steps per epoch over the batch.
    num_epochs: passes over the batch, reshuffled with ``key`` each epoch.
    temperature: sampling temperature the log-probs are computed at.
    mesh: mesh for explicit in/out shardings (params/opt state by logical
      names, batch rows over ``(data, fsdp)``); None runs on one device.
    donate: donate the input ``TrainState``.
    jit: jit the step (False runs eagerly, for debugging).
    **loss_overrides: overrides for ``losses.get_spec``.

  Returns:
    ``train_step(state, batch, key, ref_params=None, proximal_params=None)
    -> (state, metrics)``. ``batch`` is a ``TrainBatch`` of ``B`` rows with
    ``B`` divisible by ``num_minibatches * num_micro_batches``;
    ``ref_params``/``proximal_params`` are parameter states required when
    the loss has ``needs_ref``/``needs_proximal`` (ignored otherwise).
    ``metrics`` is a dict of scalar arrays: means over optimizer steps,
    ``*_max``/``*_min`` extremes, and the counts ``skipped`` (optimizer steps
    of this call that kept the old params: empty batch or non-finite values),
    ``nonfinite`` (those with a non-finite loss, gradient norm, new params or
    new optimizer state) and ``num_skipped`` (the running total).

  Raises:
    ValueError: naming the field for inconsistent sizes or missing params.
  """
  spec = losses.get_spec(loss, **loss_overrides) if isinstance(loss, str) else loss
  if loss_overrides and not isinstance(loss, str):
    spec = spec.replace(**loss_overrides)
  for name, v in (
    ("num_micro_batches", num_micro_batches),
    ("num_minibatches", num_minibatches),
    ("num_epochs", num_epochs),
  ):
    if v < 1:
      raise ValueError(f"{name} must be >= 1, got {v}")
  if micro_batch_size is not None and micro_batch_size < 1:
    raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")

  def logprobs(params, mb):
    model = nnx.merge(graphdef, params)
    return models.sequence_logprobs(
      model, mb.prompt_tokens, mb.prompt_mask, mb.tokens, mb.mask, temperature
    )

  def loss_fn(params, mb, ref_params, prox_params):
    logp, ent = logprobs(params, mb)
    extra = {}
    if spec.needs_ref:
      extra["ref_logp"] = jax.lax.stop_gradient(logprobs(ref_params, mb)[0])
    if spec.needs_proximal:
      extra["proximal_logp"] = jax.lax.stop_gradient(logprobs(prox_params, mb)[0])
    if spec.entropy_coef > 0:
      extra["entropy"] = ent
    out = losses.policy_loss(
      spec,
      logp=logp,
      behavior_logp=mb.behavior_logp,
      advantages=mb.advantages,
      mask=mb.mask * mb.weights[:, None],
      **extra,
    )
    stats = _token_stats(jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ent), mb)
    stats["loss_count"] = out.loss_count
    stats["loss_sum"] = jax.lax.stop_gradient(out.loss_sum)
    return out.loss_sum, (stats, out.metrics)

  grad_fn = jax.grad(loss_fn, has_aux=True)

  def gradients(params, batch, ref_params, prox_params, m):
    micro = _split_micro(batch, m)
    if mesh is not None:
      micro = jax.tree.map(
        lambda x: sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2), mesh), micro
      )

    def body(acc, mb):
      g, (stats, lmetrics) = grad_fn(params, mb, ref_params, prox_params)
      g_acc, s_acc = acc
      return (jax.tree.map(jnp.add, g_acc, g), _merge_stats(s_acc, stats)), lmetrics

    first = jax.tree.map(lambda x: x[0], micro)
    rest = jax.tree.map(lambda x: x[1:], micro)
    g0, (s0, l0) = grad_fn(params, first, ref_params, prox_params)
    if m == 1:
      return g0, s0, l0
    (g, s), lm = jax.lax.scan(body, (g0, s0), rest)
    return g, s, {k: _reduce(k, jnp.concatenate([l0[k][None], lm[k]])) for k in l0}

  def opt_step(state: TrainState, mb: TrainBatch, ref_params, prox_params, m):
    g_sum, stats, lmetrics = gradients(state.params, mb, ref_params, prox_params, m)
    count = stats["loss_count"]
    safe = jnp.where(count > 0, count, 1.0)
    grads = jax.tree.map(lambda g: g / safe, g_sum)
    loss_value = stats["loss_sum"] / safe
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss_value) & jnp.isfinite(grad_norm) & all_finite((params, opt_state))
    ok = finite & (count > 0)
    keep = lambda new, old: jnp.where(ok, new, old)
    state = TrainState(
      params=jax.tree.map(keep, params, state.params),
      opt_state=jax.tree.map(keep, opt_state, state.opt_state),
      step=state.step,
      version=state.version + 1,
      num_skipped=state.num_skipped + (~ok).astype(jnp.int32),
    )
    n = jnp.maximum(stats["tokens"], 1.0)
    metrics = {k: v for k, v in lmetrics.items() if k not in ("valid_tokens", "loss_sum")}
    ratio_prefix = "ratio" if spec.ratio == "behavior" else "behavior_ratio"
    metrics.update(
      {
        "loss": loss_value,
        "loss_count": count,
        "grad_norm": grad_norm,
        "entropy": stats["entropy_sum"] / n,
        "kl_k1": stats["kl_k1_sum"] / n,
        "kl_k3": stats["kl_k3_sum"] / n,
        f"{ratio_prefix}_mean": stats["ratio_sum"] / n,
        f"{ratio_prefix}_max": stats["ratio_max"],
        f"{ratio_prefix}_min": stats["ratio_min"],
        "tokens": stats["tokens"],
        "skipped": (~ok).astype(jnp.int32),
        "nonfinite": (~finite).astype(jnp.int32),
      }
    )
    return state, metrics

  def train_step(state: TrainState, batch: TrainBatch, key, ref_params=None, prox_params=None):
    rows = batch.tokens.shape[0]
    if rows % num_minibatches:
      raise ValueError(f"num_minibatches={num_minibatches} does not divide batch rows {rows}")
    mb_rows = rows // num_minibatches
    m = num_micro_batches if micro_batch_size is None else mb_rows // micro_batch_size
    if m < 1 or mb_rows % m or (micro_batch_size is not None and mb_rows % micro_batch_size):
      raise ValueError(
        f"micro_batch_size/num_micro_batches: {mb_rows} rows per minibatch do not split "
        f"into micro-batches (num_micro_batches={num_micro_batches}, "
        f"micro_batch_size={micro_batch_size})"
      )
    valid = batch.mask > 0
    stale = jnp.where(valid, state.version - batch.versions, 0)
    stale_metrics = {
      "staleness_mean": stale.sum() / jnp.maximum(valid.sum(), 1),
      "staleness_max": stale.max(),
    }
    num_steps = num_minibatches * num_epochs
    if num_steps == 1:
      state, metrics = opt_step(state, batch, ref_params, prox_params, m)
    else:
      keys = jax.random.split(key, num_epochs)
      perms = jax.vmap(lambda k: jax.random.permutation(k, rows))(keys)
      order = perms.reshape(num_steps, mb_rows)

      def scan_step(st, idx):
        mb = jax.tree.map(lambda x: x[idx], batch)
        return opt_step(st, mb, ref_params, prox_params, m)

      state, per_step = jax.lax.scan(scan_step, state, order)
      metrics = {k: _reduce(k, v) for k, v in per_step.items()}
    metrics.update(stale_metrics)
    metrics["num_skipped"] = state.num_skipped
    metrics["version"] = state.version
    return state._replace(step=state.step + 1), metrics

  if not jit:
    return _checked(train_step, spec)

  cache: dict[tuple[bool, bool], tuple[Callable, Any]] = {}

  def jitted(state, batch, key, ref_params=None, proximal_params=None):
    sig = (ref_params is None, proximal_params is None)
    if sig not in cache:
      kw: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
      in_sh = None
      if mesh is not None:
        state_sh = state_shardings(state, mesh)
        rep = sharding.replicated(mesh)
        in_sh = (
          state_sh,
          sharding.batch_shardings(batch, mesh),
          rep,
          None if ref_params is None else state_sh.params,
          None if proximal_params is None else state_sh.params,
        )
        kw["in_shardings"] = in_sh
        kw["out_shardings"] = (state_sh, rep)
      cache[sig] = (jax.jit(train_step, **kw), in_sh)
    fn, in_sh = cache[sig]
    args = (state, batch, key, ref_params, proximal_params)
    if in_sh is not None:
      # No-op for arrays already placed as expected; moves host data and snapshots
      # (with several processes, host values must be the same on every process).
      args = (
        state,
        *(
          a if a is None else sharding.put(a, sh) for a, sh in zip(args[1:], in_sh[1:], strict=True)
        ),
      )
    return fn(*args)

  return _checked(jitted, spec)


def _checked(fn, spec):
  def train_step(state, batch, key, ref_params=None, proximal_params=None):
    if spec.needs_ref and ref_params is None:
      raise ValueError("ref_params: the loss has kl_coef > 0 and needs reference params")
    if spec.needs_proximal and proximal_params is None:
      raise ValueError(f"proximal_params: the loss uses ratio={spec.ratio!r}")
    return fn(state, batch, key, ref_params, proximal_params)

  train_step.__doc__ = fn.__doc__
  return train_step
