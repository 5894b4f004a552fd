"""One optimizer step: gradients accumulated over micro-batches, skipped when empty or non-finite.

The micro-batches (`batch_splits.cut`) are scanned with ``lax.scan`` from
zero accumulators (one micro-batch: a loop whose trip count XLA cannot see;
skipping zero-advantage rows: a loop over the chunks that move the loss);
neither loop is differentiated (the gradient is taken inside). The summed
gradient is divided once by the summed ``loss_count`` (`learn.train_step`
explains why that is exact).
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from offpolicy_jax import reductions as red
from offpolicy_jax.learn.batch_splits import Cut
from offpolicy_jax.learn.micro_batch_loss import micro_batch_loss
from offpolicy_jax.learn.train_state import TrainState, all_finite, in_critic, keep_if
from offpolicy_jax.models import lora_ops
from offpolicy_jax.scale import sharding
from offpolicy_jax.types import TrainBatch


def _gradients(params, cut: Cut, graphdef, options, ref_params, anchor, base, key=None):
  """Summed gradients and merged metrics over the chunks of `cut` that run.

  `key`: the optimizer step's dropout key; chunk i uses ``fold_in(key, i)``.
  """
  grad_fn = jax.grad(micro_batch_loss, has_aux=True)
  args = (graphdef, options, ref_params, anchor, base)
  init = _zero_accumulators(params, cut.chunks, args)
  skipping = cut.whole is not None
  if not skipping and cut.n > 1:  # every micro-batch runs: a scan

    def body(acc, xs):
      g, metrics = grad_fn(params, xs[0], *args, xs[1])
      return (jax.tree.map(jnp.add, acc[0], g), red.merge(acc[1], metrics)), None

    (grads, metrics), _ = jax.lax.scan(body, init, (cut.chunks, lora_ops.fold_range(key, cut.n)))
    return grads, metrics

  def run(i, acc):  # the first `n` chunks (n traced when skipping)
    g, metrics = grad_fn(params, _chunk(cut.chunks, i), *args, lora_ops.fold(key, i))
    return jax.tree.map(jnp.add, acc[0], g), red.merge(acc[1], metrics)

  n = cut.n
  if not skipping:
    # One micro-batch. XLA inlines a loop of one known trip into the program
    # around it, which then compiled ~1.4x slower (qwen2.5-0.5b train step,
    # docs/results/compile_time.md); a trip count it cannot see keeps the loop.
    n = jax.lax.optimization_barrier(jnp.int32(n))
  grads, metrics = jax.lax.fori_loop(0, n, run, init)
  if cut.whole is None:
    return grads, metrics
  # The loss's count and these metrics are the whole minibatch's, not the chunks' that ran.
  metrics["loss"] = red.Mean(metrics["loss"].total, cut.loss_count)
  return grads, {**metrics, **cut.whole}


def _chunk(chunks: TrainBatch, i) -> TrainBatch:
  """Chunk `i` (traced) of stacked chunks, its rows kept over the batch's devices."""

  def take(x):
    rows = x[i]
    return sharding.constrain(rows, (sharding.BATCH,) + (None,) * (rows.ndim - 1))

  return jax.tree.map(take, chunks)


def _zero_accumulators(params, chunks: TrainBatch, args):
  """Zero gradients and the identity of each metric, the loop's starting carry.

  The metrics' shapes come from the loss's forward alone: the gradient's aux
  output is the loss's, and tracing the backward pass here as well doubled
  the train step's trace time.
  """
  first = jax.tree.map(lambda x: x[0], chunks)
  shapes = jax.eval_shape(lambda: micro_batch_loss(params, first, *args)[1])
  return jax.tree.map(jnp.zeros_like, params), red.identity(shapes)


def optimizer_step(
  state: TrainState,
  cut: Cut,
  graphdef,
  optimizer,
  options,
  ref_params,
  anchor,
  base=None,
  key=None,
) -> tuple[TrainState, dict[str, Any]]:
  """One optimizer step on a minibatch cut into micro-batches, skipped when empty or non-finite.

  `cut`: the minibatch's micro-batches or chunks (`batch_splits.cut`);
  `key`: the step's adapter-dropout key, or None (no dropout).
  """
  g_sum, metrics = _gradients(state.params, cut, graphdef, options, ref_params, anchor, base, key)
  count = metrics["loss"].weight
  grads = jax.tree.map(lambda g: g / jnp.where(count > 0, count, 1.0), g_sum)
  warming = _critic_warming_up(options, state)
  if warming is not None:  # the critic alone trains: the policy's gradient never reaches Adam
    grads = only_critic(grads, warming)
    metrics["critic/warmup"] = red.Max(warming.astype(jnp.float32))
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  if warming is not None:  # nor does its weight decay
    updates = only_critic(updates, warming)
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
  state = state._replace(
    params=params,
    opt_state=opt_state,
    version=state.version + 1,
    num_skipped=state.num_skipped + skipped,
  )
  metrics["loss_count"] = red.mean(count)
  metrics["grad_norm"] = red.mean(grad_norm)
  metrics["skipped"] = red.Sum(skipped)
  metrics["nonfinite"] = red.Sum(nonfinite)
  return state, metrics


def _critic_warming_up(options, state: TrainState) -> jax.Array | None:
  """Whether this loop step is in the critic's warm-up (`CriticSpec.warmup_steps`), traced;
  None without one."""
  spec = options.critic
  if spec is None or not spec.warmup_steps:
    return None
  return state.step < spec.warmup_steps


def only_critic(tree: Any, warming: jax.Array) -> Any:
  """`tree` (gradients or updates of the parameters) with the policy's leaves zero while
  `warming`: the critic's (its value head, or a separate critic) kept."""
  keep = lambda path, x: x if in_critic(path) else jnp.where(warming, jnp.zeros_like(x), x)
  return jax.tree_util.tree_map_with_path(keep, tree)
