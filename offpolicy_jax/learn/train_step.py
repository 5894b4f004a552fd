"""The pure, sharded train step: ``(state, batch, key) -> (state, metrics)``.

`train_step(graphdef, optimizer, options, state, batch, key)` consumes one
``TrainBatch``. It splits the batch into ``num_minibatches`` optimizer steps
(repeated for ``num_epochs``, reshuffled each epoch), and each optimizer step
into micro-batches scanned with ``lax.scan`` from zero accumulators (one
forward/backward program, compiled once). Per micro-batch it recomputes the
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
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from offpolicy_jax import losses, models, types
from offpolicy_jax import reductions as red
from offpolicy_jax.learn import batch_splits, diagnostics
from offpolicy_jax.learn.batch_splits import chunks_per_micro_batch
from offpolicy_jax.learn.batch_splits import micro_batches as _micro_batches
from offpolicy_jax.learn.batch_splits import split_micro as _split_micro
from offpolicy_jax.learn.train_state import TrainState, all_finite, state_shardings
from offpolicy_jax.models import lora_ops
from offpolicy_jax.scale import sharding
from offpolicy_jax.types import TrainBatch

# The train-step key's fold that seeds adapter dropout (the epoch shuffles split the key itself).
DROPOUT_FOLD = 1


class StepOptions(NamedTuple):
  """Static settings of the train step (hashable, so a jit static argument).

  Attributes:
    spec: the policy loss.
    num_micro_batches: gradient-accumulation micro-batches per optimizer step.
    micro_batch_size: rows per micro-batch; overrides ``num_micro_batches``.
    num_minibatches: optimizer steps per epoch over the batch.
    num_epochs: passes over the batch, reshuffled each epoch.
    temperature: sampling temperature the log-probs are computed at.
    group_size: K, rows per prompt; batches are group-major (row ``g * K + k``).
    shared_prefix: run each group's prompt once and let its K responses attend
      to it (`models.shared_prefix_logprobs`); micro-batches and minibatch
      shuffles then move whole groups.
    skip_zero_advantage: leave rows whose advantages are all 0 out of the
      forward and backward passes when the loss makes that exact
      (``spec.zero_advantage_inert``; ignored otherwise).
    skip_chunks: with skipping, each micro-batch is cut into this many chunks
      (fewer where they do not divide) and only chunks holding rows that move
      the loss run.
    truncated: score the top-k / top-p truncated distribution the sampler drew
      from, given each token's kept-set size ``TrainBatch.behavior_kept``
      (`models.logprobs`); False scores the full tempered softmax (no
      truncation, or ``rollout.behavior_logp = "full"``).
    top_k: the sampler's top-k (0 = off), which bounds the kept set when truncated.
  """

  spec: losses.LossSpec
  num_micro_batches: int = 1
  micro_batch_size: int | None = None
  num_minibatches: int = 1
  num_epochs: int = 1
  temperature: float = 1.0
  group_size: int = 1
  shared_prefix: bool = False
  skip_zero_advantage: bool = False
  skip_chunks: int = 4
  truncated: bool = False
  top_k: int = 0

  @property
  def updates(self) -> int:
    """Optimizer steps per batch, U."""
    return self.num_minibatches * self.num_epochs

  @property
  def unit(self) -> int:
    """Rows that stay together in micro-batches and shuffles: a group with a shared prefix."""
    return self.group_size if self.shared_prefix else 1

  @property
  def skips_rows(self) -> bool:
    """Whether zero-advantage rows are left out (asked for, and exact for the loss)."""
    return self.skip_zero_advantage and self.spec.zero_advantage_inert


def check_options(options: StepOptions) -> None:
  """Raises ValueError naming the field for invalid settings."""
  for name in ("num_micro_batches", "num_minibatches", "num_epochs", "group_size", "skip_chunks"):
    if getattr(options, name) < 1:
      raise ValueError(f"{name} must be >= 1, got {getattr(options, name)}")
  if options.top_k < 0:
    raise ValueError(f"top_k must be >= 0, got {options.top_k}")
  if options.micro_batch_size is not None and options.micro_batch_size < 1:
    raise ValueError(f"micro_batch_size must be >= 1, got {options.micro_batch_size}")


def token_logprobs(
  graphdef: nnx.GraphDef,
  params,
  mb: TrainBatch,
  temperature: float,
  shared_group: int = 0,
  *,
  truncated: bool = False,
  top_k: int = 0,
  dropout_key: jax.Array | None = None,
):
  """Teacher-forced log-probs and entropies [B, N] of `mb`'s responses under `params`.

  With ``shared_group = K > 0`` the rows are groups of K sharing a prompt and
  each prompt runs once (`models.shared_prefix_logprobs`). With `truncated`
  the log-probs are those of the top-k / top-p truncated distribution of
  ``mb.behavior_kept`` tokens (`StepOptions.truncated`). `dropout_key` turns
  on the adapters' input dropout (the train step's current policy only).
  """
  model = nnx.merge(graphdef, params)
  kept = mb.behavior_kept if truncated else None
  if shared_group:
    return models.shared_prefix_logprobs(
      model,
      mb.prompt_tokens[::shared_group],
      mb.prompt_mask[::shared_group],
      mb.tokens,
      mb.mask,
      shared_group,
      temperature,
      kept=kept,
      top_k=top_k,
      dropout_key=dropout_key,
    )
  return models.sequence_logprobs(
    model,
    mb.prompt_tokens,
    mb.prompt_mask,
    mb.tokens,
    mb.mask,
    temperature,
    kept=kept,
    top_k=top_k,
    dropout_key=dropout_key,
  )


def make_scorer(graphdef: nnx.GraphDef, options: StepOptions):
  """Jitted `score(params, prompt_tokens [G, P], prompt_lengths [G], out) -> logp [G*K, N]`.

  The learner's log-probs of a sampled rollout `out` (`sampling.SampleOutput`)
  at `params`, scored as the train step scores (temperature, truncation,
  shared prefix): at the sampling parameters, log pi_old (SCIENCE.md s7).
  """
  shared = options.group_size if options.shared_prefix else 0

  def score(params, prompt_tokens, prompt_lengths, out):
    zeros = jnp.zeros(out.tokens.shape[:1], jnp.float32)
    batch = types.pack_groups(
      prompt_tokens,
      prompt_lengths,
      out.tokens,
      out.mask,
      out.logprobs,
      jnp.zeros(out.tokens.shape, jnp.int32),
      zeros,
      zeros,
      out.kept,
    )
    logp, _ = token_logprobs(
      graphdef,
      params,
      batch,
      options.temperature,
      shared,
      truncated=options.truncated,
      top_k=options.top_k,
    )
    return logp

  return jax.jit(score)


def _typed(loss_metrics: dict[str, jax.Array]) -> dict[str, Any]:
  """The loss's per-micro-batch metrics as typed reductions.

  The loss reports token means over its valid tokens and `*_max`/`*_min`
  extremes; the means are weighted by those tokens so that they combine exactly.
  """
  n = loss_metrics["valid_tokens"]
  out: dict[str, Any] = {}
  for k, v in loss_metrics.items():
    if k in ("valid_tokens", "loss_sum"):
      continue
    out[k] = (
      red.Max(v) if k.endswith("_max") else red.Min(v) if k.endswith("_min") else red.mean(v, n)
    )
  return out


def _behavior_ratio(logp, mb: TrainBatch) -> dict[str, Any]:
  """Mean, max and min of w = pi / mu over valid tokens (when the loss's ratio is not to mu)."""
  valid = mb.mask > 0
  log_ratio = jnp.where(valid, logp - mb.behavior_logp, 0.0)
  m = valid.astype(jnp.float32)
  return {
    "behavior_ratio_mean": red.Mean((jnp.exp(log_ratio) * m).sum(), m.sum()),
    "behavior_ratio_max": red.Max(jnp.exp(jnp.max(jnp.where(valid, log_ratio, -jnp.inf)))),
    "behavior_ratio_min": red.Min(jnp.exp(jnp.min(jnp.where(valid, log_ratio, jnp.inf)))),
  }


def micro_batch_loss(
  params, mb: TrainBatch, graphdef, options: StepOptions, ref_params, anchor, base=None, key=None
):
  """``(loss_sum, typed metrics)`` of one micro-batch; differentiate the first output.

  Args:
    params: the parameters being trained (with `base`, the adapters).
    mb: a micro-batch.
    graphdef: the model's graph.
    options: static settings.
    ref_params: reference parameters (KL to reference), or None.
    anchor: proximal parameters, or None for ``stop_gradient(logp)`` (the
      current parameters are the anchor).
    base: frozen base weights the parameters adapt (`models.lora`), or None.
      Not differentiated: gradients and optimizer state cover `params` only.
    key: the micro-batch's adapter-dropout key (None: no dropout); only the
      current policy's forward uses it.
  """
  spec, o = options.spec, options
  shared = options.group_size if options.shared_prefix else 0
  sg = jax.lax.stop_gradient
  score = lambda p, key=None: token_logprobs(
    graphdef,
    models.lora.join(base, p),
    mb,
    o.temperature,
    shared,
    truncated=o.truncated,
    top_k=o.top_k,
    dropout_key=key,
  )
  logp, ent = score(params, key)
  extra = {}
  if spec.needs_ref:
    extra["ref_logp"] = sg(score(ref_params)[0])
  if spec.needs_proximal:
    extra["proximal_logp"] = sg(logp) if anchor is None else sg(score(anchor)[0])
  if spec.needs_old:
    extra["old_logp"] = mb.old_logp
  if spec.entropy_coef > 0:
    extra["entropy"] = ent
  if spec.level == "turn_geo":  # a multi-turn row's turns are its runs of policy tokens
    extra["turn_ids"] = types.turn_ids(mb.mask)
  out = losses.policy_loss(
    spec,
    logp=logp,
    behavior_logp=mb.behavior_logp,
    advantages=mb.advantages,
    mask=mb.mask * mb.weights[:, None],
    **extra,
  )
  m = (mb.mask > 0).astype(jnp.float32)
  metrics = _typed(out.metrics)
  metrics["loss"] = red.Mean(sg(out.loss_sum), out.loss_count)
  metrics["entropy"] = red.Mean((sg(ent) * m).sum(), m.sum())
  metrics["tokens"] = red.Sum(m.sum())
  if spec.ratio != "behavior":
    metrics.update(_behavior_ratio(sg(logp), mb))
  metrics.update(diagnostics.policy_terms(logp, mb))
  return out.loss_sum, metrics


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
  init = _zero_accumulators(grad_fn, params, micro, args)

  def body(acc, xs):
    g, metrics = grad_fn(params, xs[0], *args, xs[1])
    return (jax.tree.map(jnp.add, acc[0], g), red.merge(acc[1], metrics)), None

  (grads, metrics), _ = jax.lax.scan(body, init, (micro, lora_ops.fold_range(key, m)))
  return grads, metrics


def _zero_accumulators(grad_fn, params, micro: TrainBatch, args):
  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(lambda: grad_fn(params, first, *args)[1])
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
    lambda micro: _zero_accumulators(grad_fn, params, micro, args),
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
  ok = finite & (count > 0)
  keep = lambda new, old: jnp.where(ok, new, old)
  state = TrainState(
    params=jax.tree.map(keep, params, state.params),
    opt_state=jax.tree.map(keep, opt_state, state.opt_state),
    step=state.step,
    version=state.version + 1,
    num_skipped=state.num_skipped + (~ok).astype(jnp.int32),
  )
  metrics["loss_count"] = red.mean(count)
  metrics["grad_norm"] = red.mean(grad_norm)
  metrics["skipped"] = red.Sum((~ok).astype(jnp.int32))
  metrics["nonfinite"] = red.Sum((~finite).astype(jnp.int32))
  return state, metrics


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
  m = _micro_batches(options, rows)
  stale = _staleness(state, batch)
  anchor = proximal_params
  if anchor is None and options.spec.needs_proximal and options.updates > 1:
    anchor = state.params  # the call's starting parameters, held by the trace (no copy)
  args = (m, graphdef, optimizer, options, ref_params, anchor, base)
  dkey = _dropout_key(graphdef, state.params, base, key)
  if options.updates == 1:
    state, metrics = optimizer_step(state, batch, *args, lora_ops.fold(dkey, 0))
  else:
    mb_rows = rows // options.num_minibatches
    unit = options.unit
    keys = jax.random.split(key, options.num_epochs)
    perms = jax.vmap(lambda k: jax.random.permutation(k, rows // unit))(keys)
    if unit > 1:  # whole groups move together
      perms = (perms[..., None] * unit + jnp.arange(unit)[None, None]).reshape(-1, rows)
    order = perms.reshape(options.updates, mb_rows)

    def scan_step(st, xs):
      return optimizer_step(st, jax.tree.map(lambda x: x[xs[0]], batch), *args, xs[1])

    state, per_step = jax.lax.scan(scan_step, state, (order, lora_ops.fold_range(dkey, len(order))))
    metrics = red.reduce(per_step)
  out = {**red.results(metrics), **stale, **diagnostics.mismatch_terms(batch)}
  out["num_skipped"] = state.num_skipped
  out["version"] = state.version
  return state._replace(step=state.step + 1), out


def _dropout_key(graphdef, params, base, key) -> jax.Array | None:
  """The call's adapter-dropout key, or None when the model has no adapter dropout.

  Decided from the model's config at trace time (merging emits no operation).
  """
  lc = nnx.merge(graphdef, models.lora.join(base, params)).config.lora
  return None if lc is None or lc.dropout == 0 else jax.random.fold_in(key, DROPOUT_FOLD)


def _checked(fn: Callable, spec: losses.LossSpec) -> Callable:
  def checked_step(state, batch, key, ref_params=None, proximal_params=None, base=None):
    if spec.needs_ref and ref_params is None:
      raise ValueError("ref_params: the loss has kl_coef > 0 and needs reference params")
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
      skip_chunks, truncated, top_k: the fields of :class:`StepOptions`.
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
  )
  check_options(options)

  def step(state, batch, key, ref_params=None, proximal_params=None, base=None):
    return train_step(
      graphdef, optimizer, options, state, batch, key, ref_params, proximal_params, base
    )

  if not jit:
    return _checked(step, spec)
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

  return _checked(jitted, spec)


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
