"""Hugging Face checkpoint import / export (config.json + safetensors).

Supports `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `LlamaForCausalLM`,
`Qwen3MoeForCausalLM` and `MixtralForCausalLM` (experts: `models.hf_moe`) with
single-file or sharded (`model.safetensors.index.json`) checkpoints stored in
float32, float16 or bfloat16. Tensors are memory-mapped and converted one at a
time; with a mesh, every device reads only its own slice
(`jax.make_array_from_callback`), so no host copy of all weights is ever made.
HF linear weights are [out, in]; ours are [in, out] with heads split out.
"""

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from offpolicy_jax import files
from offpolicy_jax.models import hf_moe, layout, value
from offpolicy_jax.models.config import ModelConfig
from offpolicy_jax.models.decoder import Decoder
from offpolicy_jax.models.tokenizers import Tokenizer
from offpolicy_jax.scale import sharding

_ARCHS = {
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "LlamaForCausalLM": "llama",
  "Qwen3MoeForCausalLM": "qwen3_moe",
  "MixtralForCausalLM": "mixtral",
}
_FAMILY_ARCH = {v: k for k, v in _ARCHS.items()}
GENERATION_CONFIG = "generation_config.json"
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def config_from_hf(hf: Mapping, **overrides) -> ModelConfig:
  """Builds a `ModelConfig` from a parsed HF config.json.

  Args:
    hf: the config.json dict.
    **overrides: ModelConfig fields to replace (e.g. dtype, remat).

  Returns:
    The config.

  Raises:
    ValueError: unsupported architecture or feature.
  """
  archs = hf.get("architectures") or []
  arch = archs[0] if archs else None
  family = _ARCHS.get(arch) if arch else hf.get("model_type")
  if family not in _FAMILY_ARCH:
    raise ValueError(
      f"unsupported architecture {arch or hf.get('model_type')!r}; supported: {sorted(_ARCHS)}"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (silu only)")
  if hf.get("use_sliding_window") or (family == "mixtral" and hf.get("sliding_window")):
    raise ValueError("use_sliding_window / sliding_window is not supported (full attention only)")
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias=True is not supported")
  if family != "qwen2" and hf.get("attention_bias"):
    raise ValueError(f"attention_bias=True is not supported for {family}")
  rope = dict(hf.get("rope_parameters") or {})
  theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
  rope.pop("rope_theta", None)
  scaling = hf.get("rope_scaling") or (rope or None)
  if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
    scaling = None
  n = hf["num_attention_heads"]
  fields = dict(
    vocab_size=hf["vocab_size"],
    hidden_size=hf["hidden_size"],
    intermediate_size=hf["intermediate_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=n,
    num_kv_heads=hf.get("num_key_value_heads") or n,
    head_dim=hf.get("head_dim") or hf["hidden_size"] // n,
    rope_theta=float(theta),
    rope_scaling=scaling,
    rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    qkv_bias=family == "qwen2",
    qk_norm=family in ("qwen3", "qwen3_moe"),
    max_position_embeddings=hf.get("max_position_embeddings", 4096),
    family=family,
    **hf_moe.config_from_hf(hf, family),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(config: ModelConfig, dtype: str) -> dict:
  """HF config.json dict for `config` (weights stored in `dtype`)."""
  c = config
  rope_parameters = {"rope_type": "default", "rope_theta": c.rope_theta}
  rope_parameters.update(c.rope_scaling_dict or {})
  hf = {
    "architectures": [_FAMILY_ARCH[c.family]],
    "model_type": c.family,
    "vocab_size": c.vocab_size,
    "hidden_size": c.hidden_size,
    "intermediate_size": c.intermediate_size,
    "num_hidden_layers": c.num_layers,
    "num_attention_heads": c.num_heads,
    "num_key_value_heads": c.num_kv_heads,
    "head_dim": c.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": c.rms_norm_eps,
    "max_position_embeddings": c.max_position_embeddings,
    "rope_theta": c.rope_theta,
    "rope_parameters": rope_parameters,
    "tie_word_embeddings": c.tie_embeddings,
    "attention_bias": c.qkv_bias and c.family != "qwen2",
    "torch_dtype": dtype,
    "dtype": dtype,
    "use_cache": True,
  }
  if c.rope_scaling is not None:
    hf["rope_scaling"] = c.rope_scaling_dict
  if c.family == "llama":
    hf["mlp_bias"] = False
  if c.family in ("qwen2", "qwen3", "qwen3_moe"):
    hf["use_sliding_window"] = False
  return {**hf, **hf_moe.config_to_hf(c)}


# (our path, HF name or names, hf -> ours, ours -> hf); several names: stacked experts.
_Row = tuple[tuple[str | int, ...], str | tuple[str, ...], Callable, Callable]


def _tensor_map(c: ModelConfig) -> list[_Row]:
  """(our path, HF name, hf->ours view, ours->hf) for every parameter."""
  d, n, kv, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  same = (lambda x: x, lambda x: x)
  tr = (lambda x: x.T, lambda x: x.T)

  def heads_in(m):  # HF [m*H, D] -> [D, m, H]
    return (
      lambda x: x.reshape(m, h, d).transpose(2, 0, 1),
      lambda x: x.transpose(1, 2, 0).reshape(m * h, d),
    )

  def bias(m):
    return (lambda x: x.reshape(m, h), lambda x: x.reshape(m * h))

  o_proj = (
    lambda x: x.reshape(d, n, h).transpose(1, 2, 0),
    lambda x: x.transpose(2, 0, 1).reshape(d, n * h),
  )
  rows: list[_Row] = [
    (("embed_tokens",), "model.embed_tokens.weight", *same),
    (("norm", "weight"), "model.norm.weight", *same),
  ]
  if not c.tie_embeddings:
    rows.append((("lm_head",), "lm_head.weight", *tr))
  for i in range(c.num_layers):
    p, a = f"model.layers.{i}.", ("layers", i)
    rows += [
      ((*a, "input_layernorm", "weight"), p + "input_layernorm.weight", *same),
      ((*a, "post_attention_layernorm", "weight"), p + "post_attention_layernorm.weight", *same),
      ((*a, "self_attn", "q_proj"), p + "self_attn.q_proj.weight", *heads_in(n)),
      ((*a, "self_attn", "k_proj"), p + "self_attn.k_proj.weight", *heads_in(kv)),
      ((*a, "self_attn", "v_proj"), p + "self_attn.v_proj.weight", *heads_in(kv)),
      ((*a, "self_attn", "o_proj"), p + "self_attn.o_proj.weight", *o_proj),
      *hf_moe.rows(c, p, a),
    ]
    if c.qkv_bias:
      rows += [
        ((*a, "self_attn", f"{x}_bias"), p + f"self_attn.{x}_proj.bias", *bias(m))
        for x, m in (("q", n), ("k", kv), ("v", kv))
      ]
    if c.qk_norm:
      rows += [
        ((*a, "self_attn", f"{x}_norm", "weight"), p + f"self_attn.{x}_norm.weight", *same)
        for x in ("q", "k")
      ]
  return rows


def _read_header(file: str) -> tuple[dict, int, int]:
  """Reads and checks a safetensors header: (header, data offset, file size)."""
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise ValueError(f"{file}: truncated safetensors file: {size} bytes, no 8-byte header length")
    header_len = int(np.frombuffer(prefix, "<u8")[0])
    if header_len > size - 8:
      raise ValueError(
        f"{file}: truncated or corrupt safetensors file: the header length is {header_len} "
        f"bytes (bytes 8..{8 + header_len}) but the file has {size} bytes"
      )
    raw = f.read(header_len)
  try:
    header = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file}: corrupt safetensors header (bytes 8..{8 + header_len}): {e}") from e
  if not isinstance(header, dict):
    raise ValueError(f"{file}: corrupt safetensors header: expected a JSON object")
  return header, 8 + header_len, size


def _tensor_view(file: str, name: str, info: Any, data: np.ndarray, offset: int, size: int):
  """The numpy view of tensor `name` in `data`, after checking its header entry."""
  try:
    dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
    start, end = (int(x) for x in info["data_offsets"])
  except (TypeError, KeyError, ValueError) as e:
    raise ValueError(f"{file}: corrupt safetensors header entry for tensor {name!r}: {info}") from e
  if dtype not in _ST_DTYPES:
    raise ValueError(f"tensor {name!r} in {file} has unsupported dtype {dtype}")
  nbytes = math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize
  if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != nbytes:
    raise ValueError(
      f"{file}: corrupt safetensors header: tensor {name!r} of dtype {dtype} and shape "
      f"{shape} needs {nbytes} bytes but its data_offsets are {start}..{end}"
    )
  if end > size - offset:
    raise ValueError(
      f"{file}: truncated safetensors file: the header says tensor {name!r} spans bytes "
      f"{offset + start}..{offset + end} but the file has {size} bytes"
    )
  return data[start:end].view(_ST_DTYPES[dtype]).reshape(shape)


def _read_safetensors_index(file: str) -> dict[str, np.ndarray]:
  """Memory-maps one .safetensors file; returns lazily read numpy views by name.

  Not `safetensors.safe_open`: its slices index the stored HF layout, while our
  parameters are transposed / head-split views of it. A memmap view composes
  with those reshapes, so each device reads only its slice of the *converted*
  tensor and no tensor is ever fully copied to host memory.

  Raises:
    ValueError: naming the file (and the tensor and byte range) for a
      truncated file, a corrupt header or an unsupported dtype.
  """
  header, offset, size = _read_header(file)
  data: np.ndarray
  if size > offset:
    data = np.memmap(file, np.uint8, mode="r", offset=offset)
  else:  # No tensor data: np.memmap cannot map zero bytes.
    data = np.zeros(0, np.uint8)
  return {
    name: _tensor_view(file, name, info, data, offset, size)
    for name, info in header.items()
    if name != "__metadata__"
  }


def _open_checkpoint(path: str) -> dict[str, np.ndarray]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    weight_map = files.read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: no 'weight_map' object")
    shards = sorted(set(weight_map.values()))
  elif os.path.exists(os.path.join(path, "model.safetensors")):
    shards = ["model.safetensors"]
  else:
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")
  tensors = {}
  for file in shards:
    tensors.update(_read_safetensors_index(os.path.join(path, file)))
  return tensors


def _read_slice(view: Any, dtype, index) -> np.ndarray:
  return np.asarray(view[index], dtype)


def _param_rules(rules) -> tuple[tuple[str, Any], ...]:
  """The rules table `from_pretrained` applies: the sharding table by default.

  Explicit ``rules`` replicate every logical axis they do not list.
  """
  if rules is None:
    return sharding.LOGICAL_AXIS_RULES
  table: dict[str, Any] = dict.fromkeys(sharding.LOGICAL_AXES)
  table.update(rules.items() if isinstance(rules, Mapping) else rules)
  return tuple(table.items())


def from_pretrained(
  path: str,
  dtype=jnp.float32,
  *,
  compute_dtype=None,
  mesh: jax.sharding.Mesh | None = None,
  rules: Sequence[tuple[str, str | tuple[str, ...] | None]] | Mapping | None = None,
  **config_overrides,
) -> Decoder:
  """Loads an HF checkpoint directory into a `Decoder`.

  Args:
    path: directory with config.json and model.safetensors (or a sharded index).
    dtype: parameter dtype (float32 master weights by default).
    compute_dtype: activation dtype (default: `dtype`); e.g. jnp.bfloat16.
    mesh: optional mesh; parameters are then created directly in their sharding.
    rules: logical axis -> mesh axis pairs (e.g. [("embed", "fsdp"), ("mlp", "tensor")]);
      logical axes not listed are replicated. Default: the one table,
      `sharding.LOGICAL_AXIS_RULES`. Dimensions that do not divide by their
      mesh axes are replicated (`sharding.logical_to_spec`).
    **config_overrides: ModelConfig fields to replace (e.g. remat=True).

  Returns:
    The decoder.

  Raises:
    ValueError: unsupported architecture, missing tensor (named), bad shape,
      or a corrupt file: invalid JSON in config.json or the index, a truncated
      safetensors file or a corrupt header (naming the file, the tensor and
      the byte range).
  """
  hf = files.read_json_object(os.path.join(path, "config.json"))
  config = config_from_hf(
    hf,
    param_dtype=jnp.dtype(dtype).name,
    dtype=jnp.dtype(compute_dtype or dtype).name,
    **config_overrides,
  )
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
  # HF stores one tensor per layer: views are checked against the per-layer layout, and
  # under `scan_layers` each kind of weight is stacked over the layers as it is read.
  per_layer = dataclasses.replace(config, scan_layers=False)
  target = nnx.split(nnx.eval_shape(lambda: Decoder(per_layer, rngs=nnx.Rngs(0))))[1]
  rules = _param_rules(rules)
  tensors = _open_checkpoint(path)
  np_dtype = jnp.dtype(dtype)
  views: dict = {}
  for ours, name, to_ours, _ in _tensor_map(config):
    names = (name,) if isinstance(name, str) else name
    missing = [n for n in names if n not in tensors]
    if missing:
      raise ValueError(f"checkpoint {path} is missing tensor {missing[0]!r}")
    var = target
    for k in ours:
      var = var[k]
    stored = [tensors[n] for n in names]
    view = to_ours(stored[0] if isinstance(name, str) else stored)
    if tuple(view.shape) != tuple(var.shape):
      raise ValueError(
        f"checkpoint {path}: tensor {names[0]!r} has shape {stored[0].shape}; expected the "
        f"equivalent of {var.shape} (its config.json)"
      )
    views[ours] = view
  if config.scan_layers:
    views = layout.stack_views(views, config.num_layers)
  values: dict = {}
  for ours, view in views.items():
    var = state
    for k in ours:
      var = var[k]
    if mesh is None:
      arr = jnp.asarray(np.asarray(view, np_dtype))
    else:
      spec = sharding.logical_to_spec(tuple(var.out_sharding), view.shape, mesh, rules)
      arr = jax.make_array_from_callback(
        tuple(view.shape),
        jax.sharding.NamedSharding(mesh, spec),
        functools.partial(_read_slice, view, np_dtype),
      )
    node = values
    for k in ours[:-1]:
      node = node.setdefault(k, {})
    node[ours[-1]] = arr
  if config.value_head:  # not an HF tensor: ours beside the weights, or a fresh zero head
    values["value_head"] = value.load(path, config.hidden_size)
  nnx.replace_by_pure_dict(state, values)
  return nnx.merge(graphdef, state)


def save_pretrained(
  model: Decoder, path: str, dtype=None, *, tokenizer: Tokenizer | None = None
) -> None:
  """Writes config.json + model.safetensors loadable by `transformers`.

  Args:
    model: the decoder.
    path: output directory (created).
    dtype: storage dtype (default: the parameter dtype), e.g. jnp.bfloat16.
    tokenizer: the model's tokenizer, written beside it by `save_tokenizer`
      (then `AutoTokenizer` loads it and `generate()` stops at its EOS).

  A separate critic (`models.value`) goes into `path`/critic, which `critic.model` loads.
  """
  config = model.config
  np_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
  os.makedirs(path, exist_ok=True)
  own = {k: v for k, v in nnx.to_pure_dict(nnx.state(model, nnx.Param)).items() if k != "critic"}
  values = layout.unstack(own, config.num_layers)
  tensors = {}
  for ours, name, _, to_hf in _tensor_map(config):
    x: Any = values
    for k in ours:
      x = x[k]
    out = to_hf(np.asarray(jax.device_get(x)).astype(np_dtype))
    if isinstance(name, str):
      tensors[name] = np.ascontiguousarray(out)
    else:
      tensors.update(zip(name, out, strict=True))
  safetensors.numpy.save_file(
    tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"}
  )
  _write_json(os.path.join(path, "config.json"), config_to_hf(config, jnp.dtype(np_dtype).name))
  value.save(model, path)
  if tokenizer is not None:
    save_tokenizer(tokenizer, path)
  if value.has_separate_critic(model):  # an HF checkpoint of its own, with its value head
    save_pretrained(model.critic, os.path.join(path, value.CRITIC_DIR), dtype, tokenizer=tokenizer)


def save_tokenizer(tokenizer: Tokenizer, path: str) -> None:
  """Writes `tokenizer` into the HF checkpoint `path`, with the token ids that end generation.

  Beside `tokenizer.json` and `tokenizer_config.json`, its `bos_token_id`,
  `eos_token_id` and `pad_token_id` go into `config.json` and a
  `generation_config.json`: `transformers`' `generate()` reads them there, and
  without an EOS id it never stops before `max_new_tokens`.

  Args:
    tokenizer: the model's tokenizer.
    path: a directory holding the checkpoint's config.json.
  """
  ids = {
    "bos_token_id": tokenizer.bos_id,
    "eos_token_id": tokenizer.eos_id,
    "pad_token_id": tokenizer.pad_id,
  }
  ids = {k: int(v) for k, v in ids.items() if v is not None}
  config_file = os.path.join(path, "config.json")
  _write_json(config_file, {**files.read_json_object(config_file), **ids})
  _write_json(os.path.join(path, GENERATION_CONFIG), ids)
  tokenizer.save_pretrained(path)


def _write_json(file: str, obj: dict) -> None:
  with open(file, "w") as f:
    json.dump(obj, f, indent=2)
