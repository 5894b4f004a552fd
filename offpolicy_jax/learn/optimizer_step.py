"""One optimizer step: gradients accumulated over micro-batches, skipped when empty or non-finite.

The micro-batches are scanned with ``lax.scan`` from zero accumulators (or,
skipping zero-advantage rows, the chunks that move the loss,
`learn.batch_splits`); the summed gradient is divided once by the summed
``loss_count`` (`learn.train_step` explains why that is exact).
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from offpolicy_jax import reductions as red
from offpolicy_jax.learn import batch_splits
from offpolicy_jax.learn.batch_splits import chunks_per_micro_batch
from offpolicy_jax.learn.batch_splits import split_micro as _split_micro
from offpolicy_jax.learn.micro_batch_loss import micro_batch_loss
from offpolicy_jax.learn.train_state import TrainState, all_finite, keep_if
from offpolicy_jax.models import lora_ops
from offpolicy_jax.types import TrainBatch


def _gradients(
  params, batch: TrainBatch, m: int, graphdef, options, ref_params, anchor, base, key=None
):
  """Summed gradients and merged metrics over `m` micro-batches (scan from zeros).

  `key`: the optimizer step's dropout key; micro-batch i uses ``fold_in(key, i)``.
  """
  if options.skips_rows:
    return _gradients_skipping(params, batch, m, graphdef, options, ref_params, anchor, base, key)
  micro = _split_micro(batch, m, options.unit)
  grad_fn = jax.grad(micro_batch_loss, has_aux=True)
  args = (graphdef, options, ref_params, anchor, base)
  init = _zero_accumulators(params, micro, args)

  def body(acc, xs):
    g, metrics = grad_fn(params, xs[0], *args, xs[1])
    return (jax.tree.map(jnp.add, acc[0], g), red.merge(acc[1], metrics)), None

  (grads, metrics), _ = jax.lax.scan(body, init, (micro, lora_ops.fold_range(key, m)))
  return grads, metrics


def _zero_accumulators(params, micro: TrainBatch, args):
  """Zero gradients and the identity of each metric, the scan's starting carry.

  The metrics' shapes come from the loss's forward alone: the gradient's aux
  output is the loss's, and tracing the backward pass here as well doubled
  the train step's trace time.
  """
  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(lambda: micro_batch_loss(params, first, *args)[1])
  return jax.tree.map(jnp.zeros_like, params), red.identity(shapes)


def _gradients_skipping(
  params, batch: TrainBatch, m: int, graphdef, options, ref_params, anchor, base, key=None
):
  """`_gradients` with the rows whose advantages are all 0 left out (`batch_splits`).

  Chunk i of the rows that run uses the dropout key ``fold_in(key, i)``.
  """
  grad_fn = jax.grad(micro_batch_loss, has_aux=True)
  args = (graphdef, options, ref_params, anchor, base)
  micro_rows = batch.tokens.shape[0] // m
  chunks = m * chunks_per_micro_batch(options, micro_rows, batch_splits.batch_shards())
  return batch_splits.gradients(
    lambda p, mb, i: grad_fn(p, mb, *args, lora_ops.fold(key, i)),
    lambda micro: _zero_accumulators(params, micro, args),
    params,
    batch,
    chunks=chunks,
    unit=options.unit,
    spec=options.spec,
  )


def optimizer_step(
  state: TrainState,
  mb: TrainBatch,
  m: int,
  graphdef,
  optimizer,
  options,
  ref_params,
  anchor,
  base=None,
  key=None,
) -> tuple[TrainState, dict[str, Any]]:
  """One optimizer step on minibatch `mb`, skipped when empty or non-finite.

  `key`: the step's adapter-dropout key, or None (no dropout).
  """
  g_sum, metrics = _gradients(state.params, mb, m, graphdef, options, ref_params, anchor, base, key)
  count = metrics["loss"].weight
  grads = jax.tree.map(lambda g: g / jnp.where(count > 0, count, 1.0), g_sum)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  loss_value = red.results({"loss": metrics["loss"]})["loss"]
  finite = jnp.isfinite(loss_value) & jnp.isfinite(grad_norm) & all_finite((params, opt_state))
  # The flags leave the conditional as its outputs: each use of `finite` outside it would
  # get its own fused copy of the predicate's term per leaf (`train_state.keep_if`).
  new = (params, opt_state, jnp.int32(0), jnp.int32(0))
  params, opt_state, skipped, nonfinite = keep_if(
    finite & (count > 0),
    new,
    (state.params, state.opt_state, jnp.int32(1), (~finite).astype(jnp.int32)),
  )
  state = TrainState(
    params=params,
    opt_state=opt_state,
    step=state.step,
    version=state.version + 1,
    num_skipped=state.num_skipped + skipped,
  )
  metrics["loss_count"] = red.mean(count)
  metrics["grad_norm"] = red.mean(grad_norm)
  metrics["skipped"] = red.Sum(skipped)
  metrics["nonfinite"] = red.Sum(nonfinite)
  return state, metrics
