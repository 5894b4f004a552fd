"""Memory and step-time planner: per-device bytes of a run before anything is allocated.

`plan(config, devices=8, bytes_per_device=16 * 2**30)` builds the run's state
with `jax.eval_shape` (nothing is materialised), maps every array to its
`PartitionSpec` on an abstract `(data, fsdp, tensor)` mesh of any size through
the rules of `sharding.py`, and sums the shard shapes one device holds:

  params, optimizer state     `sharding.tree_shardings` of the parameters / `optimizer.init`
                              (with `lora.rank > 0`: base + adapters / of the adapters only)
  replay buffer               `replay.shardings` (capacity axis over data * fsdp) of
                              `components.replay_capacity` batches (partial rollouts included)
  lag snapshots               `components.snapshot_slots` * trained params (adapters with LoRA)
  reference params            trained params, when the loss has a KL to the reference policy
  KV cache                    2 * layers * rows * positions * N_kv * H * itemsize of each cache
                              the sampler allocates (`sampler_caches`), rows over data * fsdp
                              and heads over tensor of the sampler's mesh; with blocks
                              stacked over layers and decoded per layer, plus the samplers'
                              per-layer copy of the blocks' weights (`layout.for_decoding`)
  activations                 the train step's temporaries (below)

The sizes are the runtime's own (`components.replay_capacity`, `components.sizes`,
`components.step_options`, `validation.micro_batch_rows`, `disagg.sampler_shape`),
so the plan cannot drift from what runs (tests/test_planner.py compares them).
The sampler and the train step do not overlap: peak = state + max(KV cache,
activations). With `mesh.sampler_devices = k` the sampler runs on k devices of
its own ((k, 1, 1), `Plan.sampler`), which hold a copy of the parameters and
the KV cache: peak = max(state + activations, sampler params + KV cache). Not
counted: the partial-rollout pool (S * K rows of N tokens and their prompts,
small beside the KV cache) and the evaluation samplers.

Activations: where the mesh fits on this machine's devices of the target's
platform, XLA's own `memory_analysis().temp_size_in_bytes` of the train step
compiled on abstract arguments ("compiled"); otherwise, per device, with
t = micro-batch rows per device * (P + N) tokens ("analytic"; with
`train.skip_zero_advantage` the rows of one chunk of a micro-batch, with
`train.shared_prefix` P / K + N tokens per row):

  t * layers * [isz * (4 D + (4 F + 3 N H + 3 N_kv H) / tensor) + 4 * 2 (N / tensor) (P + N)]
    * 4/3                                    (XLA copies; calibrated on CPU compiles)
    with `model_scan_layers` (the stacked intermediates and their copies):  x 1.5
    scanned with `model_remat`, t * (layers * isz * D + 2 [...]) * 4/3 instead:
    each block's input and the intermediates of two blocks in the backward
    (unrolled, XLA:CPU keeps the intermediates under remat too: not counted)
  + t_chunk * V * 4 * 2                      (float32 logits and log-softmax of one chunk)
  + 2 * trained params bytes                 (accumulated and micro-batch gradients;
                                              scanned: 3, a margin kept)

Step time, a rough lower bound: the step's FLOPs over ``devices * peak
FLOP/s``, with N the parameters (base + adapters) and D tokens:

  train    per epoch, per trained token (G K (P + N_new)): 2N forward + 2N
           activation gradients + 2N weight gradients = 6N; with adapters the
           frozen base has no weight gradients: 4N (the adapters' own weight
           gradients, 2 r (in + out) per projection, are left out: negligible)
  ref      2N per trained token and epoch (a forward) when the loss has a KL to the reference
  sample   2N per sampled token (G P prefill + G K N_new decode)

N counts the parameters a token is computed with: with experts, k of each
block's E (`ModelConfig.num_active_params`). A separate critic (`critic.model`)
is in each byte row the runtime holds it in and trains at 6N_critic per token,
sampling nothing; analytic activations count the policy's forward only.

(`train_flops_per_token`; `Plan.flops_rule` says which terms a plan counts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax import config_schema, models
from offpolicy_jax.config_spec import RunSpec
from offpolicy_jax.learn import batch_splits, replay, train_state, train_step
from offpolicy_jax.models.tokenizers import CharTokenizer
from offpolicy_jax.run import components, critic_settings, model_build, validation
from offpolicy_jax.sampling import partial as partial_rollouts
from offpolicy_jax.scale import disagg, sharding
from offpolicy_jax.step import run_state

GIB = 2**30


class DeviceSpec(NamedTuple):
  """An accelerator type: memory per device, dense bf16 peak FLOP/s, JAX platform name."""

  hbm_bytes: int
  peak_flops: float
  platform: str


DEVICES: dict[str, DeviceSpec] = {
  "v4": DeviceSpec(32 * GIB, 275e12, "tpu"),
  "v5e": DeviceSpec(16 * GIB, 197e12, "tpu"),
  "v5p": DeviceSpec(95 * GIB, 459e12, "tpu"),
  "v6e": DeviceSpec(32 * GIB, 918e12, "tpu"),
  "a100-40": DeviceSpec(40 * GIB, 312e12, "gpu"),
  "a100-80": DeviceSpec(80 * GIB, 312e12, "gpu"),
  "h100-80": DeviceSpec(80 * GIB, 989e12, "gpu"),
  # Host memory is shared by the fake CPU devices; peak is a rough 100 GFLOP/s per device.
  "cpu": DeviceSpec(16 * GIB, 1e11, "cpu"),
}
STATE_ROWS = ("params", "optimizer state", "replay buffer", "lag snapshots", "reference params")
ROWS = (*STATE_ROWS, "KV cache (sampler)", "activations (train step)")


class Plan(NamedTuple):
  """Per-device memory of a run on a mesh, and its FLOPs.

  Attributes:
    bytes: per-device bytes of each entry of `ROWS`.
    mesh: `{"data": d, "fsdp": f, "tensor": t}`.
    devices: devices available (the mesh uses `prod(mesh)` of them).
    bytes_per_device: memory of one device, or None (no verdict).
    activations_source: "compiled (...)" or "analytic".
    step_flops: FLOPs of one loop step (module docstring; `flops_rule`).
    peak_flops: per-device peak FLOP/s of the device type, or None.
    notes: where the model architecture came from, if not `config.model` itself.
    sampler: the sampler's own mesh `{"data": k, ...}` (mesh.sampler_devices = k), or None.
    sampler_params_bytes: per-device bytes of the sampler's parameter copy (0: shared mesh).
    flops_rule: the terms `step_flops` counts, e.g. "4ND train + 2ND sample".
  """

  bytes: dict[str, int]
  mesh: dict[str, int]
  devices: int
  bytes_per_device: int | None
  activations_source: str
  step_flops: float
  peak_flops: float | None
  notes: tuple[str, ...]
  sampler: dict[str, int] | None = None
  sampler_params_bytes: int = 0
  flops_rule: str = ""

  @property
  def state_bytes(self) -> int:
    return sum(self.bytes[k] for k in STATE_ROWS)

  @property
  def peak_bytes(self) -> int:
    """The fullest device: state + max(KV cache, activations) (module docstring)."""
    kv, act = self.bytes[ROWS[5]], self.bytes[ROWS[6]]
    if self.sampler is not None:
      return max(self.state_bytes + act, self.sampler_params_bytes + kv)
    return self.state_bytes + max(kv, act)

  @property
  def headroom(self) -> float | None:
    """Fraction of device memory left at the peak (negative: does not fit)."""
    return 1.0 - self.peak_bytes / self.bytes_per_device if self.bytes_per_device else None


def model_config(config) -> tuple[models.ModelConfig, str]:
  """The decoder's `ModelConfig` from `config.model` (and a note saying where it came from).

  `config.model` may be a preset name, an HF directory with config.json, a
  path to a config.json, or an absent checkpoint directory whose name starts
  with a preset name (e.g. "Qwen2.5-1.5B-Instruct" -> "qwen2.5-1.5b"). A
  critic is counted as the run builds it (`run.model_build`): a value head on
  the policy, or a separate critic (`critic.model`) as `ModelConfig.critic`.
  """
  spec = RunSpec.from_config(config)
  kw: dict[str, Any] = dict(
    dtype=spec.model_dtype,
    scan_layers=spec.model_scan_layers,
    scan_decode=spec.model_scan_decode,
    remat=spec.model_remat,
  )
  separate = critic_settings.separate_critic(config)
  head = bool(critic_settings.estimator(config)) and not separate
  lc = model_build.lora_config(config)
  mc, note = _architecture(spec, spec.model, "model", lora=lc, value_head=head, **kw)
  if not separate:
    return mc, note
  name = spec.model if separate == critic_settings.FROM_POLICY else separate
  # A preset critic takes the run's vocabulary, as `model_build` builds it.
  critic, critic_note = _architecture(
    spec, name, "critic.model", vocab=mc.vocab_size, value_head=True, **kw
  )
  notes = "; ".join(n for n in (note, critic_note and f"critic: {critic_note}") if n)
  return dataclasses.replace(mc, critic=critic), notes


def _architecture(spec: RunSpec, m: str, field: str, vocab=None, **kw) -> tuple[Any, str]:
  """`model_config`'s reading of one model name `m` (config field `field`); a preset takes
  `vocab` when given (a separate critic: the policy's)."""
  path = os.path.join(m, "config.json") if os.path.isdir(m) else m
  if path.endswith(".json") and os.path.isfile(path):
    with open(path) as f:
      return models.config_from_hf(json.load(f), **kw), f"architecture from {path}"
  base = os.path.basename(os.path.normpath(m)).lower()
  match = [p for p in models.preset_names() if base.startswith(p)]
  if not match:
    raise ValueError(f"{field}: {m!r} is neither a preset, an HF directory nor a config.json")
  preset = max(match, key=len)
  if vocab is None:
    vocab = models.get_config(preset).vocab_size
    if preset == m and not spec.tokenizer:  # a fresh preset takes the tokenizer's vocabulary
      vocab = CharTokenizer().vocab_size
  note = "" if preset == m else f"architecture of preset {preset!r} ({m!r} is not on disk)"
  return models.get_config(preset, vocab_size=vocab, **kw), note


def _decode_copy_bytes(mc, params, mesh) -> int:
  """Stacked blocks decoded per layer (`layout.for_decoding`): the samplers' sliced copy of
  the blocks' weights, held beside the KV cache while they decode; else 0."""
  if not mc.scan_layers or mc.scan_decode:
    return 0
  blocks = params[models.layout.LAYERS_KEY]
  return _nbytes(blocks, sharding.tree_shardings(blocks, mesh))


def _nbytes(tree: Any, shardings: Any) -> int:
  """Bytes one device holds of `tree` (abstract arrays) placed with `shardings`."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  value = lambda x: x.get_value() if is_var(x) else x
  arrays = [value(x) for x in jax.tree.leaves(tree, is_leaf=is_var)]
  specs = [value(s) for s in jax.tree.leaves(shardings, is_leaf=is_var)]
  return sum(
    math.prod(s.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
    for a, s in zip(arrays, specs, strict=True)
  )


def _analytic_activations(config, mc, mesh, params_bytes: int) -> int:
  """The module docstring's analytic temporaries of one train step, per device."""
  sz = components.sizes(config)
  t_len = sz.max_prompt_len + sz.max_new_tokens
  shards, tp = sharding.axis_size(mesh, sharding.BATCH_AXES), mesh.shape[sharding.TENSOR]
  rows = validation.micro_batch_rows(config)
  options = components.step_options(config)
  if options.skips_rows:  # the forward runs one chunk of a micro-batch at a time
    rows //= batch_splits.chunks_per_micro_batch(options, rows, shards)
  rows = rows // shards if rows % shards == 0 else rows
  tokens: float = t_len  # per row; a shared prompt runs once per group: P / K + N
  if options.shared_prefix:
    tokens = sz.max_prompt_len / sz.group_size + sz.max_new_tokens
  isz = jnp.dtype(mc.dtype).itemsize
  n, kv, h, d, f = mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.hidden_size, mc.intermediate_size
  if mc.num_experts:  # a token's activations run through k experts (`models.moe`)
    f = mc.num_experts_per_tok * mc.moe_intermediate_size
  per_token_layer = isz * (4 * d + (4 * f + 3 * n * h + 3 * kv * h) / tp) + 8 * n / tp * t_len
  if mc.remat and mc.scan_layers:  # each block's input, and two blocks' intermediates
    kept_layers = mc.num_layers * isz * d / per_token_layer + 2
  else:  # every block's intermediates (unrolled, XLA:CPU keeps them even under remat)
    kept_layers = mc.num_layers * (1.5 if mc.scan_layers else 1)  # scanned: stacked, copied
  blocks = rows * tokens * kept_layers * per_token_layer * 4 / 3
  logits = rows * min(sz.max_new_tokens, 128) * mc.vocab_size * 4 * 2
  # Scanned: one more copy, a margin kept since the blocks are stored stacked (the CPU's
  # compiled remat step would otherwise be underestimated; docs/speed.md).
  grads = (3 if mc.scan_layers else 2) * params_bytes
  return int(blocks + logits + grads)


def _abstract_run(config, mc: models.ModelConfig):
  """`(graphdef, params, opt_state, replay buffer, optimizer, base)` from `jax.eval_shape`.

  `params` are the trained ones (the adapters with `mc.lora`; `base` the rest, else None).
  """
  graphdef, params = nnx.split(nnx.eval_shape(lambda: models.Decoder(mc, rngs=nnx.Rngs(0))))
  base = None
  if mc.lora is not None:
    base, params = models.lora.split(params)
  optimizer = components.optimizer(config)
  sizes = components.sizes(config, mc)  # with routing replay, the recorded experts too
  cap = sizes.prompts_per_step * components.replay_capacity(config)
  init = lambda: replay.init(cap, run_state.empty_batch(sizes), sizes.group_size)
  opt_state = jax.eval_shape(optimizer.init, params)
  return graphdef, params, opt_state, jax.eval_shape(init), optimizer, base


def _compiled_activations(config, mc, graphdef, params, opt_state, optimizer, sizes, base) -> int:
  """XLA's temporaries of the train step lowered on abstract arguments on a local mesh."""
  mesh = sharding.make_mesh(*sizes, devices=jax.devices()[: math.prod(sizes)])
  is_var = lambda x: isinstance(x, nnx.Variable)
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  place = lambda x, s: x.replace(sds(x.get_value(), s.get_value())) if is_var(x) else sds(x, s)
  on_mesh = lambda t: jax.tree.map(place, t, sharding.tree_shardings(t, mesh), is_leaf=is_var)
  scalar: Any = sds(jax.ShapeDtypeStruct((), jnp.int32), sharding.replicated(mesh))
  state = train_state.TrainState(on_mesh(params), on_mesh(opt_state), scalar, scalar, scalar)
  batch = run_state.empty_batch(components.sizes(config, mc))  # the recorded routing too
  batch = jax.tree.map(lambda x: sds(x, sharding.batch_sharding(mesh, x.ndim)), batch)
  options = components.step_options(config)
  fn = functools.partial(train_step.train_step, graphdef, optimizer, options)
  ref = state.params if options.needs_ref else None
  base = None if base is None else on_mesh(base)
  key = jax.random.key(0)
  with jax.set_mesh(mesh):
    lowered = jax.jit(fn, donate_argnums=0).lower(state, batch, key, ref, None, base)
    compiled = lowered.compile()
  stats = compiled.memory_analysis()
  assert stats is not None, "this backend reports no memory analysis; use activations='analytic'"
  return int(stats.temp_size_in_bytes)


def sampler_caches(config) -> tuple[tuple[int, int], ...]:
  """`(rows, positions)` of each KV cache (every layer, keys and values) the sampler allocates.

  Whole responses (`sampling.make_sampler`): the G prompts' cache, filled once
  and read by their K samples, and the G * K rows' own caches of N tokens.
  Partial rollouts (`partial.make_advance`): the S * K rows of the pool (S = L * G
  slots, L = `steps_to_finish`), each re-prefilled into W = P + (L - 1) * b
  positions plus b new ones.
  """
  g, k, p, n = components.sizes(config)[:4]
  budget = RunSpec.from_config(config).rollout.partial_budget
  if not budget:
    return ((g, p), (g * k, n))
  b = min(budget, n)
  steps = partial_rollouts.steps_to_finish(n, b)
  return ((steps * g * k, p + steps * b),)


def _kv_cache_bytes(config, mc: models.ModelConfig, sizes: tuple[int, ...]) -> int:
  """Per-device bytes of `sampler_caches` on a `sizes` mesh (rows over data * fsdp)."""
  shards, tp = sizes[0] * sizes[1], sizes[2]
  heads = mc.num_kv_heads // tp if mc.num_kv_heads % tp == 0 else mc.num_kv_heads
  total = 0
  for rows, positions in sampler_caches(config):
    rows = rows // shards if rows % shards == 0 else rows
    total += 2 * mc.num_layers * rows * positions * heads * mc.head_dim
  return total * jnp.dtype(mc.dtype).itemsize


def _sampler_side(config, params, trainer_sizes: tuple[int, int, int]):
  """`(sizes of the sampler's mesh, Plan.sampler, Plan.sampler_params_bytes)`.

  The trainer's mesh, or with `mesh.sampler_devices = k` the runtime's own
  sampler mesh (`disagg.sampler_shape`) holding a copy of the parameters.
  """
  k = RunSpec.from_config(config).mesh.sampler_devices
  if not k:
    return trainer_sizes, None, 0
  sizes = disagg.sampler_shape(k)
  mesh: Any = jax.sharding.AbstractMesh(sizes, sharding.MESH_AXES)
  axes = dict(zip(sharding.MESH_AXES, sizes, strict=True))
  return sizes, axes, _nbytes(params, sharding.tree_shardings(params, mesh))


def plan(
  config,
  *,
  devices: int,
  bytes_per_device: int | None,
  mesh_shape: tuple[int, int, int] | None = None,
  device_type: str | None = None,
  activations: str = "auto",
) -> Plan:
  """Plans the per-device memory of `config`'s run on `devices` devices (module docstring).

  Args:
    config: an experiment ConfigDict (configs/default.py lists every field).
    devices: number of devices; need not exist on this machine.
    bytes_per_device: memory of one device (None: no verdict).
    mesh_shape: `(data, fsdp, tensor)` replacing `config.mesh` (-1 allowed).
    device_type: a key of `DEVICES` (peak FLOP/s, platform), or None.
    activations: "auto" (compiled when the mesh fits here and the platform
      matches), "compiled" or "analytic".

  Returns:
    The `Plan`.

  Raises:
    ValueError: naming the field (`devices`, `mesh.*`, `model`, ...) that is wrong.
  """
  if device_type is not None and device_type not in DEVICES:
    raise ValueError(f"devices: unknown device type {device_type!r}; known: {list(DEVICES)}")
  config_schema.check(config)  # each field's own value, named, before any size is read
  if mesh_shape is not None:
    config = config.copy_and_resolve_references()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  sizes = validation.mesh_shape(config, devices)
  mesh: Any = jax.sharding.AbstractMesh(sizes, sharding.MESH_AXES)  # tree_shardings accepts it
  mc, note = model_config(config)
  graphdef, params, opt_state, buffer, optimizer, base = _abstract_run(config, mc)
  p_bytes = _nbytes(params, sharding.tree_shardings(params, mesh))
  base_bytes = 0 if base is None else _nbytes(base, sharding.tree_shardings(base, mesh))
  validation.micro_batch_rows(config)  # fails naming the field before anything compiles
  local = jax.devices()
  same = device_type is None or DEVICES[device_type].platform == local[0].platform
  if activations == "compiled" or (activations == "auto" and same and mesh.size <= len(local)):
    act = _compiled_activations(config, mc, graphdef, params, opt_state, optimizer, sizes, base)
    source = f"compiled (XLA memory_analysis on {local[0].platform})"
  else:
    act, source = _analytic_activations(config, mc, mesh, p_bytes), "analytic"
  options = components.step_options(config)
  needs_ref = options.needs_ref
  run = RunSpec.from_config(config)
  slots = components.snapshot_slots(run.lag.mode, run.lag.sync_interval, run.lag.sync_offset)
  whole = models.lora.join(base, params)
  sampler_sizes, sampler, sampler_params = _sampler_side(config, whole, sizes)
  row_bytes = {
    "params": base_bytes + p_bytes,
    "optimizer state": _nbytes(opt_state, sharding.tree_shardings(opt_state, mesh)),
    "replay buffer": _nbytes(buffer, replay.shardings(buffer, mesh)),
    "lag snapshots": slots * p_bytes,
    "reference params": p_bytes if needs_ref else 0,
    ROWS[5]: _kv_cache_bytes(config, mc, sampler_sizes) + _decode_copy_bytes(mc, whole, mesh),
    ROWS[6]: act,
  }
  g, k, p, n = components.sizes(config)[:4]
  critic = (0, 0) if mc.critic is None else (mc.critic.num_params(), mc.critic.num_active_params())
  num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(whole)) - critic[0]
  if mc.num_experts:  # a token is computed with k of each block's E experts
    policy = dataclasses.replace(mc, critic=None)
    num_params -= policy.num_params() - policy.num_active_params()
  per_token = train_flops_per_token(adapters=base is not None) + 2.0 * needs_ref
  # A separate critic trains on the same tokens (computed with its active parameters) and
  # samples nothing.
  trained = per_token * num_params + train_flops_per_token(adapters=False) * critic[1]
  flops = trained * g * k * (p + n) * options.num_epochs
  flops += 2.0 * num_params * (g * p + g * k * n)
  rule = f"{per_token:g}ND train" + (" (incl. 2ND reference forward)" if needs_ref else "")
  rule += " + 6N_critic D critic train" if critic[0] else ""
  peak = DEVICES[device_type].peak_flops if device_type else None
  axes = dict(zip(sharding.MESH_AXES, sizes, strict=True))
  notes = (note,) if note else ()
  return Plan(
    row_bytes,
    axes,
    devices,
    bytes_per_device,
    source,
    flops,
    peak,
    notes,
    sampler,
    sampler_params,
    f"{rule} + 2ND sample",
  )


def train_flops_per_token(*, adapters: bool) -> float:
  """FLOPs per parameter and trained token of a forward + backward pass.

  6: forward 2, activation gradients 2, weight gradients 2. With adapters 4:
  the frozen base needs activation gradients (the adapters sit below it) but
  no weight gradients; the adapters' weight gradients are negligible.
  """
  return 4.0 if adapters else 6.0
