"""The pure, sharded train step: ``(state, batch, key) -> (state, metrics)``.

`train_step(graphdef, optimizer, options, state, batch, key)` consumes one
``TrainBatch``. It splits the batch into ``num_minibatches`` optimizer steps
(repeated for ``num_epochs``, reshuffled each epoch), and each optimizer step
into micro-batches (`batch_splits.cut`) whose gradients `optimizer_step`
accumulates in a loop from zero accumulators (one forward/backward program,
compiled once). Per micro-batch it recomputes the
current log-probs (and reference log-probs when the loss needs them) and
differentiates the policy loss's ``loss_sum``; the summed gradient is divided
once by the summed ``loss_count``, so accumulation is exact:

  grad = (sum_i grad loss_sum_i) / (sum_i loss_count_i).

Proximal anchor (decoupled PPO, Hilton et al., arXiv:2110.00641): the
parameters the call starts from, taken from the state inside the jit (no
copy). With one optimizer step per batch they are the current parameters, so
the proximal log-probs are ``stop_gradient(logp)`` and cost no forward pass.

``TrainBatch.weights`` multiply the token mask per sequence (0 drops a row).
An optimizer step is skipped (params and optimizer state kept, the skip
counted in ``TrainState`` and in the metrics) when its batch is empty or
anything it computes is non-finite: the loss, the gradient norm, the new
parameters or the new optimizer state. ``version`` counts optimizer steps
(skipped ones included); staleness metrics are ``version - batch.versions``
over valid tokens at the start of the call.

Adapter dropout (`LoraConfig.dropout` = p > 0, `models.lora_ops`): only the
current-policy forward of the loss runs ``(alpha / r) dropout_p(x) A B``; the
reference and proximal log-probs (and the scorer, sampler and evaluation) run
without it. Its key is ``fold_in(key, DROPOUT_FOLD)``, folded with the
optimizer step's index and then the micro-batch's (or chunk's) index, so
micro-batches draw distinct masks and a run is a pure function of its keys.
With p = 0 no key is derived: the program is the one without dropout.

Metrics are typed reductions (`reductions.Mean`/`Sum`/`Max`/`Min`): the type
says how micro-batches and optimizer steps combine, and `results` divides once.

The pieces: `step_options` (the static settings), `batch_splits` (the
micro-batches, or the chunks that move the loss), `scorer` (the log-probs),
`micro_batch_loss` (one micro-batch's loss and metrics) and `optimizer_step`
(gradient accumulation and the skip).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from offpolicy_jax import losses, models
from offpolicy_jax import reductions as red
from offpolicy_jax.learn import batch_splits, critic, diagnostics
from offpolicy_jax.learn.critic import CriticSpec
from offpolicy_jax.learn.optimizer_step import optimizer_step
from offpolicy_jax.learn.scorer import step_logprobs
from offpolicy_jax.learn.step_options import StepOptions, check_options
from offpolicy_jax.learn.train_state import TrainState, state_shardings
from offpolicy_jax.models import lora_ops
from offpolicy_jax.scale import sharding
from offpolicy_jax.types import TrainBatch

# The train-step key's fold that seeds adapter dropout (the epoch shuffles split the key itself).
DROPOUT_FOLD = 1


def _staleness(state: TrainState, batch: TrainBatch) -> dict[str, jax.Array]:
  valid = batch.mask > 0
  stale = jnp.where(valid, state.version - batch.versions, 0)
  return {
    "staleness_mean": stale.sum() / jnp.maximum(valid.sum(), 1),
    "staleness_max": stale.max(),
  }


def train_step(
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  options: StepOptions,
  state: TrainState,
  batch: TrainBatch,
  key: jax.Array,
  ref_params: Any = None,
  proximal_params: Any = None,
  base: Any = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """U = num_minibatches * num_epochs optimizer steps on `batch`.

  Args:
    graphdef: the model's ``GraphDef`` (``nnx.split(model)[0]``).
    optimizer: optax transformation (see :func:`make_optimizer`).
    options: static settings.
    state: the train state.
    batch: ``B`` rows, ``B`` divisible by ``num_minibatches`` and the micro-batches.
    key: PRNG key of the epoch shuffles and the adapters' dropout (module docstring).
    ref_params: reference parameters, required when the loss has ``needs_ref``.
    proximal_params: an explicit proximal anchor; None uses the parameters the
      call starts from (the decoupled-PPO default).
    base: with low-rank adapters, the frozen base weights (`models.lora`):
      `state.params`, `ref_params` and the anchor are then adapters over it.

  Returns:
    ``(state, metrics)``: metrics are scalars: token-weighted means, ``*_max``
    / ``*_min`` extremes, and the counts ``skipped`` (optimizer steps that kept
    the old params), ``nonfinite``, ``num_skipped`` (running total), ``tokens``.
  """
  rows = batch.tokens.shape[0]
  stale = _staleness(state, batch)
  anchor = proximal_params
  if anchor is None and options.spec.needs_proximal and options.updates > 1:
    anchor = state.params  # the call's starting parameters, held by the trace (no copy)
  dkey = _dropout_key(graphdef, state.params, base, key)
  step_keys = lora_ops.fold_range(dkey, options.updates)  # one per optimizer step, or None
  m = batch_splits.micro_batches(options, rows)
  gae: dict[str, Any] = {}
  if options.critic is not None and options.critic.reward_norm:
    stats, batch, gae = critic.normalized_rewards(options.critic, state.reward_stats, batch)
    state = state._replace(reward_stats=stats)
  if options.critic is not None and options.critic.estimator == "gae":
    values_of = lambda b: _scored(graphdef, options, state.params, base, b, m, "values")
    ref = None  # the reference's log-probs of the batch, once, for the rewards' KL penalty
    if options.critic.kl_coef > 0:
      ref = jax.lax.stop_gradient(_scored(graphdef, options, ref_params, base, batch, m, "logp"))
      gae["critic/ref_kl"] = red.results({"k": critic.ref_kl(batch, ref)})["k"]
    batch = critic.with_gae(options.critic, batch, values_of, lambda _: ref)
  args = (graphdef, optimizer, options, ref_params, anchor, base)

  def one_step(st, mb, k):  # the one call of an optimizer step, on minibatch `mb`
    cut = batch_splits.cut(mb, m, options)
    return optimizer_step(st, cut, *args, k)

  if options.updates == 1:
    state, metrics = one_step(state, batch, None if step_keys is None else step_keys[0])
  else:
    mb_rows = rows // options.num_minibatches
    unit = options.unit
    keys = jax.random.split(key, options.num_epochs)
    perms = jax.vmap(lambda k: jax.random.permutation(k, rows // unit))(keys)
    if unit > 1:  # whole groups move together
      perms = (perms[..., None] * unit + jnp.arange(unit)[None, None]).reshape(-1, rows)
    order = perms.reshape(options.updates, mb_rows)

    def scan_step(st, xs):
      return one_step(st, jax.tree.map(lambda x: x[xs[0]], batch), xs[1])

    state, per_step = jax.lax.scan(scan_step, state, (order, step_keys))
    metrics = red.reduce(per_step)
  out = {**critic.explained_variance(red.results(metrics)), **stale, **gae}
  out |= diagnostics.mismatch_terms(batch)
  out["num_skipped"] = state.num_skipped
  out["version"] = state.version
  return state._replace(step=state.step + 1), out


def _scored(
  graphdef, options: StepOptions, params, base, batch: TrainBatch, m: int, field: str
) -> jax.Array:
  """The value head's values or the log-probs ([B, N], `field` of `Scored`) of `batch` at
  `params`, micro-batch by micro-batch.

  The batch is cut like the call's micro-batches (``num_minibatches * m`` of
  them, whole groups with a shared prefix), so no forward holds more rows than
  the step's own.
  """
  n, unit = options.num_minibatches * m, options.unit
  full = models.lora.join(base, params)

  def one(mb):
    out = getattr(step_logprobs(graphdef, options, full, mb, full=True), field)
    if out is None:
      raise ValueError("critic: the model has no value head (ModelConfig.value_head)")
    return out

  scored = jax.lax.map(one, batch_splits.split_micro(batch, n, unit))
  return batch_splits.join_micro(scored, unit)


def _dropout_key(graphdef, params, base, key) -> jax.Array | None:
  """The call's adapter-dropout key, or None when the model has no adapter dropout.

  Decided from the model's config at trace time (merging emits no operation).
  """
  lc = nnx.merge(graphdef, models.lora.join(base, params)).config.lora
  return None if lc is None or lc.dropout == 0 else jax.random.fold_in(key, DROPOUT_FOLD)


def _checked(fn: Callable, options: StepOptions) -> Callable:
  def checked_step(state, batch, key, ref_params=None, proximal_params=None, base=None):
    if options.needs_ref and ref_params is None:
      raise ValueError("ref_params: the loss's or the critic's kl_coef > 0 needs reference params")
    return fn(state, batch, key, ref_params, proximal_params, base)

  return checked_step


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
  group_size: int = 1,
  shared_prefix: bool = False,
  skip_zero_advantage: bool = False,
  skip_chunks: int = 4,
  truncated: bool = False,
  top_k: int = 0,
  critic: CriticSpec | None = None,
  mesh: Mesh | None = None,
  donate: bool = True,
  jit: bool = True,
  **loss_overrides: Any,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
  """`train_step` with its static arguments bound, jitted with mesh shardings.

  Args:
    graphdef, optimizer: as for :func:`train_step`.
    loss: loss preset name or ``losses.LossSpec``.
    num_micro_batches, micro_batch_size, num_minibatches, num_epochs,
      temperature, group_size, shared_prefix, skip_zero_advantage,
      skip_chunks, truncated, top_k, critic: the fields of :class:`StepOptions`.
    mesh: mesh for explicit in/out shardings (params/opt state by logical
      names, batch rows over ``(data, fsdp)``); None runs on one device.
    donate: donate the input ``TrainState``.
    jit: jit the step (False runs eagerly, for debugging).
    **loss_overrides: overrides for ``losses.get_spec``.

  Returns:
    ``step(state, batch, key, ref_params=None, proximal_params=None, base=None)
    -> (state, metrics)`` (``base``: the frozen weights under adapters, never donated).

  Raises:
    ValueError: naming the field for inconsistent sizes or missing params.
  """
  spec = losses.get_spec(loss, **loss_overrides) if isinstance(loss, str) else loss
  if loss_overrides and not isinstance(loss, str):
    spec = spec.replace(**loss_overrides)
  options = StepOptions(
    spec,
    num_micro_batches,
    micro_batch_size,
    num_minibatches,
    num_epochs,
    temperature,
    group_size,
    shared_prefix,
    skip_zero_advantage,
    skip_chunks,
    truncated,
    top_k,
    critic=critic,
  )
  check_options(options)

  def step(state, batch, key, ref_params=None, proximal_params=None, base=None):
    return train_step(
      graphdef, optimizer, options, state, batch, key, ref_params, proximal_params, base
    )

  if not jit:
    return _checked(step, options)
  cache: dict[tuple[bool, bool], tuple[Callable, Any]] = {}

  def jitted(state, batch, key, ref_params=None, proximal_params=None, base=None):
    sig = (ref_params is None, proximal_params is None, base is None)
    if sig not in cache:
      cache[sig] = _jit_for(step, state, batch, ref_params, proximal_params, base, mesh, donate)
    fn, in_sh = cache[sig]
    args = (state, batch, key, ref_params, proximal_params, base)
    if in_sh is None:
      return fn(*args)
    # No-op for arrays already placed as expected; moves host data and snapshots
    # (with several processes, host values must be the same on every process).
    pairs = zip(args[1:], in_sh[1:], strict=True)
    placed = [a if a is None else sharding.put(a, s) for a, s in pairs]
    with jax.set_mesh(mesh):  # activation constraints (sharding.constrain) see the mesh
      return fn(state, *placed)

  return _checked(jitted, options)


def _jit_for(step, state, batch, ref_params, proximal_params, base, mesh, donate):
  """The jitted `step` for one argument signature, with its input shardings (or None)."""
  kw: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
  if mesh is None:
    return jax.jit(step, **kw), None
  state_sh = state_shardings(state, mesh)
  rep = sharding.replicated(mesh)
  in_sh = (
    state_sh,
    sharding.batch_shardings(batch, mesh),
    rep,
    None if ref_params is None else state_sh.params,
    None if proximal_params is None else state_sh.params,
    None if base is None else sharding.tree_shardings(base, mesh),
  )
  return jax.jit(step, in_shardings=in_sh, out_shardings=(state_sh, rep), **kw), in_sh
