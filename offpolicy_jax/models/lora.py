"""Low-rank adapters: base / adapter split, merging, and PEFT import / export.

A decoder built with `ModelConfig.lora` holds, besides its base weights, an
`nnx.LoRA` per targeted projection (`lora_ops`):
``y = x W + (alpha / r) dropout(x) A B``, the dropout in the train step only.

  adapter, base = lora.split(params)       # nnx.LoRAParam leaves | the rest
  params = lora.join(base, adapter)        # one state again (no copy)
  merged = lora.merged(params, config)     # the base layout with W + (alpha / r) A B

The run trains the adapter only: `params` of the train state, snapshots,
reference and proximal policies and the sampler's copies are adapters, and the
frozen base is held once (`step.run_state.RunState.base`).

PEFT format (`save_peft` / `load_peft`): ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``
tensors (A as [r, in], B as [out, r], PyTorch's [out, in] layout) and
``adapter_config.json``; `peft.PeftModel.from_pretrained` loads it onto the HF
model `hf.save_pretrained` writes. `save_merged` writes the merged weights as
a plain HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from offpolicy_jax import files
from offpolicy_jax.models import hf, layout, lora_ops
from offpolicy_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from offpolicy_jax.models.decoder import Decoder

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """`(base, adapter)` of a decoder's state: the `nnx.LoRAParam` leaves and the rest."""
  adapter, base = nnx.split_state(params, nnx.LoRAParam, ...)
  return base, adapter


def join(base: Any, params: Any) -> Any:
  """The whole state of `base` and trainable `params` (just `params` when `base` is None).

  A pytree operation, no copy: inside a jitted function it costs nothing.
  """
  return params if base is None else nnx.merge_state(base, params)


def _module(target: str) -> str:
  return "self_attn" if target in _ATTN else "mlp"


def merged(params: nnx.State, config: ModelConfig) -> nnx.State:
  """The state of the decoder without adapters: each targeted W becomes W + (alpha / r) A B.

  Args:
    params: the whole state (`join(base, adapter)`) of a decoder with `config.lora`.
    config: its config.

  Returns:
    A state with the layout of `Decoder(dataclasses.replace(config, lora=None))`
    (traceable; inside `jax.jit` it materialises one merged copy).
  """
  lc = config.lora
  if lc is None:
    return params
  base, adapter = split(params)
  flat = dict(nnx.to_flat_state(adapter))

  def one(path, var):
    name = path[-1]
    if not isinstance(name, str) or name not in lc.targets:
      return var
    owner = (*path[:-1], lora_ops.adapter_name(name))
    a, b = flat[(*owner, "lora_a")][...], flat[(*owner, "lora_b")][...]
    w = var[...]
    delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)) * lc.scale  # [L,] D, out
    return var.replace(w + delta.reshape(w.shape).astype(w.dtype))

  return nnx.map_state(one, base)


def without_adapters(model: Decoder) -> Decoder:
  """The plain decoder whose weights are `model`'s merged ones (a new model)."""
  config = dataclasses.replace(model.config, lora=None)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, merged(nnx.state(model), model.config))


def with_adapters(model: Decoder, lora: LoraConfig, key: jax.Array) -> Decoder:
  """`model` (without adapters) with fresh adapters (A random from `key`, B = 0) added.

  The adapters are drawn by a jitted construction of the whole adapted model
  whose base XLA prunes away, so no second copy of the base is made.
  """
  if model.config.lora is not None:
    raise ValueError(f"the model already has adapters ({model.config.lora})")
  config = dataclasses.replace(model.config, lora=lora)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
  adapter = init_adapter(config, key)
  return nnx.merge(graphdef, nnx.state(model), adapter)


def init_adapter(config: ModelConfig, key: jax.Array) -> nnx.State:
  """The fresh adapter state of `config` (its `Decoder` built with `rngs=nnx.Rngs(params=key)`).

  Equals the adapter of that construction exactly; the base is never computed.
  """

  @jax.jit
  def build():
    return nnx.state(Decoder(config, rngs=nnx.Rngs(params=key)), nnx.LoRAParam)

  return build()


def fingerprint(tree: Any, view: Callable[[Any], Any] | None = None) -> str:
  """16 hex digits identifying the values of a pytree of arrays (e.g. a frozen base).

  With `view`, the digits of `view(tree)`, computed inside the same program (e.g. the
  base in its other layout of the decoder blocks, `models.layout`, without a copy of it).

  Two wrap-around uint32 sums of each leaf's bits times position-dependent odd
  multipliers, computed on device: integer sums do not depend on reduction
  order, so the digits are the same on any mesh and number of processes, and
  nothing is copied to the host. Not cryptographic: it tells a changed base
  (another checkpoint at the same path, another warm start) from the recorded one.
  """

  @jax.jit
  def digits(tree):
    leaves = jax.tree.leaves(tree if view is None else view(tree))
    h1 = h2 = jnp.uint32(len(leaves))
    for x in leaves:
      x = x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.int32)
      bits = jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint32)
      i = jnp.arange(bits.size, dtype=jnp.uint32)
      m1 = i * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9) | jnp.uint32(1)
      m2 = (i ^ jnp.uint32(0x85EBCA6B)) * jnp.uint32(0xC2B2AE35) | jnp.uint32(1)
      h1 = h1 * jnp.uint32(31) + jnp.sum(bits * m1, dtype=jnp.uint32)
      h2 = h2 * jnp.uint32(37) + jnp.sum((bits ^ (bits >> 15)) * m2, dtype=jnp.uint32)
    return jnp.stack([h1, h2])

  h = np.asarray(jax.device_get(digits(tree)))
  return f"{int(h[0]):08x}{int(h[1]):08x}"


# ------------------------------------------------------------------ PEFT


def _rows(config: ModelConfig) -> list[tuple[tuple, str]]:
  """(our path of the nnx.LoRA module, PEFT name prefix) of every adapter."""
  lc = config.lora
  assert lc is not None
  rows = []
  for i in range(config.num_layers):
    for t in lc.targets:
      peft = f"base_model.model.model.layers.{i}.{_module(t)}.{t}"
      rows.append((("layers", i, _module(t), lora_ops.adapter_name(t)), peft))
  return rows


def peft_config(lora: LoraConfig, base_model_name_or_path: str = "") -> dict[str, Any]:
  """The `adapter_config.json` dict of `lora` (a plain LoRA: no DoRA, no rsLoRA, no bias)."""
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model_name_or_path or None,
    "r": lora.rank,
    "lora_alpha": lora.alpha,
    "lora_dropout": lora.dropout,
    "target_modules": list(lora.targets),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
  }


def save_peft(model: Decoder, path: str, *, base_model_name_or_path: str = "", dtype=None) -> None:
  """Writes `model`'s adapters as a PEFT LoRA adapter directory.

  Args:
    model: a decoder with `config.lora`.
    path: output directory (created).
    base_model_name_or_path: recorded in adapter_config.json (the HF base's path or name).
    dtype: storage dtype (default: the parameter dtype).
  """
  config = model.config
  if config.lora is None:
    raise ValueError("save_peft: the model has no adapters (config.lora is None)")
  np_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
  adapter = layout.unstack(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)), config.num_layers)
  tensors = {}
  for ours, name in _rows(config):
    node: Any = adapter
    for k in ours:
      node = node[k]
    for ab, key in (("A", "lora_a"), ("B", "lora_b")):
      x = np.asarray(jax.device_get(node[key])).astype(np_dtype)
      tensors[f"{name}.lora_{ab}.weight"] = np.ascontiguousarray(x.T)
  os.makedirs(path, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(path, ADAPTER_FILE), metadata={"format": "pt"})
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(peft_config(config.lora, base_model_name_or_path), f, indent=2)


def save_merged(model: Decoder, path: str, dtype=None) -> None:
  """Writes `model` with its adapters merged into the base as a plain HF checkpoint."""
  hf.save_pretrained(without_adapters(model) if model.config.lora else model, path, dtype)


def _read_peft_config(path: str) -> LoraConfig:
  file = os.path.join(path, CONFIG_FILE)
  c = files.read_json_object(file)
  if c.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{file}: peft_type {c.get('peft_type')!r} is not LORA")
  for flag in ("use_dora", "use_rslora", "fan_in_fan_out", "lora_bias"):
    if c.get(flag):
      raise ValueError(f"{file}: {flag}=true is not supported")
  if c.get("bias", "none") != "none":
    raise ValueError(f"{file}: bias={c['bias']!r} is not supported (only 'none')")
  for field in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
    if c.get(field):
      raise ValueError(f"{file}: {field} is not supported (one rank and alpha for all layers)")
  targets = c.get("target_modules")
  if isinstance(targets, str):
    targets = list(LORA_TARGETS) if targets == "all-linear" else [targets]
  try:
    return LoraConfig(
      int(c["r"]),
      float(c.get("lora_alpha", 8)),
      tuple(sorted(targets or [])),
      float(c.get("lora_dropout") or 0.0),
    )
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{file}: not a LoRA config this decoder supports: {e}") from e


def load_peft(model: Decoder, path: str) -> Decoder:
  """`model`'s base with the PEFT LoRA adapter in `path` (a new model).

  Args:
    model: the base decoder (its adapters, if any, are replaced).
    path: a directory with adapter_config.json and adapter_model.safetensors.

  Raises:
    ValueError: naming the file for an unsupported config, a missing tensor or
      a tensor of the wrong shape.
  """
  lora = _read_peft_config(path)
  base = split(nnx.state(model))[0]
  config = dataclasses.replace(model.config, lora=lora)
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))), nnx.LoRAParam, ...
  )[:2]
  # PEFT stores one tensor per layer: read per layer, stacked under `scan_layers`.
  per_layer = dataclasses.replace(config, scan_layers=False)
  target = nnx.split(
    nnx.eval_shape(lambda: Decoder(per_layer, rngs=nnx.Rngs(0))), nnx.LoRAParam, ...
  )[1]
  file = os.path.join(path, ADAPTER_FILE)
  with safe_open(file, "np") as f:
    names = set(f.keys())
    values: dict = {}
    for ours, name in _rows(config):
      node = target
      for k in ours:
        node = node[k]
      out = values
      for k in ours:
        out = out.setdefault(k, {})
      for ab, key in (("A", "lora_a"), ("B", "lora_b")):
        tensor = f"{name}.lora_{ab}.weight"
        if tensor not in names:
          raise ValueError(f"{file} is missing tensor {tensor!r}")
        x = f.get_tensor(tensor).T
        want = tuple(node[key].shape)
        if x.shape != want:
          raise ValueError(
            f"{file}: tensor {tensor!r} has shape {x.T.shape}, expected {want[::-1]}"
          )
        out[key] = jnp.asarray(x, jnp.dtype(config.param_dtype))
  nnx.replace_by_pure_dict(abstract, layout.stack(values) if config.scan_layers else values)
  return nnx.merge(graphdef, abstract, base)
