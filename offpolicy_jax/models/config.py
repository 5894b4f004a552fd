"""Decoder hyper-parameters and named size presets.

Presets cover the Qwen2.5, Qwen3 and Llama 3.x families with the values of the
published `config.json` files, plus two small random-init presets: "tiny"
(about 100k parameters, for tests and the CPU default job) and "small" (about
25M parameters, for benchmarks).
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

_FAMILIES = ("qwen2", "qwen3", "llama")
ATTENTION = ("xla", "dot_product")
# The projections a low-rank adapter can target (HF / PEFT module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the decoder's projections (Hu et al., arXiv:2106.09685).

  A targeted projection ``y = x W`` becomes ``y = x W + (alpha / r) x A B`` with
  ``A`` [in, r] and ``B`` [r, out]; ``B`` starts at zero, so a fresh adapter
  leaves the model unchanged, and only ``A`` and ``B`` are trained.

  Attributes:
    rank: r, the adapters' rank.
    alpha: the scale numerator (PEFT's ``lora_alpha``; scale = alpha / r).
    targets: projection names, a subset of `LORA_TARGETS`.
    dropout: p of the dropout on each adapter's input, ``(alpha / r)
      dropout(x) A B`` (PEFT's ``lora_dropout``), 0 <= p < 1. It acts only in
      forward passes given a key: the train step's (`models.lora_ops`).
  """

  rank: int
  alpha: float = 32.0
  targets: tuple[str, ...] = LORA_TARGETS
  dropout: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"lora rank must be an int >= 1, got {self.rank!r}")
    if not self.alpha > 0:
      raise ValueError(f"lora alpha must be > 0, got {self.alpha!r}")
    if not 0 <= self.dropout < 1:
      raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
    unknown = sorted(set(self.targets) - set(LORA_TARGETS))
    if unknown or not self.targets:
      raise ValueError(f"lora targets must be a non-empty subset of {LORA_TARGETS}, got {unknown}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a Qwen2 / Qwen3 / Llama style decoder.

  Attributes:
    vocab_size: V, number of token ids.
    hidden_size: D, residual stream width.
    intermediate_size: F, SwiGLU hidden width.
    num_layers: number of decoder blocks.
    num_heads: N, query heads.
    num_kv_heads: key/value heads (grouped-query attention; divides N).
    head_dim: H, per-head width (Qwen3 sets it explicitly; otherwise D // N).
    rope_theta: RoPE base frequency.
    rope_scaling: None, or a dict with "rope_type" in {"llama3", "linear"} and
      its parameters (HF spelling).
    rms_norm_eps: epsilon of every RMSNorm.
    tie_embeddings: if True the output projection reuses the embedding table.
    qkv_bias: if True q/k/v projections have biases (Qwen2).
    qk_norm: if True queries and keys are RMS-normalised per head (Qwen3).
    max_position_embeddings: longest context the checkpoint supports.
    dtype: compute dtype name ("float32" or "bfloat16").
    param_dtype: parameter storage dtype name.
    remat: if True each decoder block is rematerialised in the backward pass.
    scan_layers: if True the cache-free forward (training, prefill-free scoring)
      runs the blocks as one `lax.scan` over their stacked parameters, so
      compile time stays flat in depth (MaxText's `scan_layers`); parameters
      keep their per-layer layout, so checkpoints do not change.
    family: "qwen2", "qwen3" or "llama" (selects the HF architecture on export).
    attention: "xla" (our einsum attention, head-major keys read in place) or
      "dot_product" (`jax.nn.dot_product_attention`, which JAX maps to cuDNN
      flash attention on GPU; the same numbers within float tolerance).
    lora: low-rank adapters on the projections (`LoraConfig`), or None.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: Any = None
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 4096
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  scan_layers: bool = False
  family: str = "llama"
  attention: str = "xla"
  lora: LoraConfig | None = None

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):
      # Store as a sorted tuple of items so the config stays hashable.
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    for name in ("dtype", "param_dtype"):
      object.__setattr__(self, name, jnp.dtype(getattr(self, name)).name)
    if self.family not in _FAMILIES:
      raise ValueError(f"family must be one of {_FAMILIES}, got {self.family!r}")
    if self.attention not in ATTENTION:
      raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
    ):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
      )

  @property
  def rope_scaling_dict(self) -> dict | None:
    """`rope_scaling` as a plain dict (or None)."""
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  def num_params(self) -> int:
    """Number of parameters of the decoder built from this config."""
    d, f, n, kv, h = (
      self.hidden_size,
      self.intermediate_size,
      self.num_heads,
      self.num_kv_heads,
      self.head_dim,
    )
    attn = d * n * h * 2 + d * kv * h * 2
    if self.qkv_bias:
      attn += n * h + 2 * kv * h
    if self.qk_norm:
      attn += 2 * h
    layer = attn + 3 * d * f + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + embed + d

  def adapter_shapes(self) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter can target (one layer)."""
    d, f, n, kv, h = (
      self.hidden_size,
      self.intermediate_size,
      self.num_heads,
      self.num_kv_heads,
      self.head_dim,
    )
    return {
      "q_proj": (d, n * h),
      "k_proj": (d, kv * h),
      "v_proj": (d, kv * h),
      "o_proj": (n * h, d),
      "gate_proj": (d, f),
      "up_proj": (d, f),
      "down_proj": (f, d),
    }

  def num_adapter_params(self) -> int:
    """Number of adapter parameters (0 without `lora`): r * (in + out) per targeted projection."""
    if self.lora is None:
      return 0
    shapes = self.adapter_shapes()
    per_layer = sum(self.lora.rank * sum(shapes[t]) for t in self.lora.targets)
    return self.num_layers * per_layer

  def kv_bytes_per_token(self) -> int:
    """KV-cache bytes stored per token (all layers, keys and values)."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize


def _qwen25(**kw) -> dict:
  return dict(
    family="qwen2",
    qkv_bias=True,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    dtype="bfloat16",
    **kw,
  )


def _qwen3(**kw) -> dict:
  return dict(
    family="qwen3",
    qk_norm=True,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    head_dim=128,
    max_position_embeddings=40960,
    vocab_size=151936,
    dtype="bfloat16",
    **kw,
  )


def _llama3(factor: float, **kw) -> dict:
  scaling = {
    "rope_type": "llama3",
    "factor": factor,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
  }
  return dict(
    family="llama",
    rope_theta=500000.0,
    rope_scaling=scaling,
    rms_norm_eps=1e-5,
    vocab_size=128256,
    max_position_embeddings=131072,
    dtype="bfloat16",
    **kw,
  )


_PRESETS: dict[str, dict] = {
  # ~103k parameters: tests and the CPU default job.
  "tiny": dict(
    family="qwen2",
    qkv_bias=True,
    vocab_size=64,
    hidden_size=64,
    intermediate_size=192,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_embeddings=True,
    max_position_embeddings=512,
  ),
  # ~25M parameters: benchmarks.
  "small": dict(
    family="qwen2",
    qkv_bias=True,
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1792,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    tie_embeddings=True,
    max_position_embeddings=2048,
  ),
  "qwen2.5-0.5b": _qwen25(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    tie_embeddings=True,
  ),
  "qwen2.5-1.5b": _qwen25(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    tie_embeddings=True,
  ),
  "qwen2.5-3b": _qwen25(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    head_dim=128,
    tie_embeddings=True,
  ),
  "qwen2.5-7b": _qwen25(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    tie_embeddings=False,
  ),
  "qwen3-0.6b": _qwen3(
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    tie_embeddings=True,
  ),
  "qwen3-1.7b": _qwen3(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    tie_embeddings=True,
  ),
  "qwen3-4b": _qwen3(
    hidden_size=2560,
    intermediate_size=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    tie_embeddings=True,
  ),
  "qwen3-8b": _qwen3(
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    tie_embeddings=False,
  ),
  "llama3.2-1b": _llama3(
    32.0,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    tie_embeddings=True,
  ),
  "llama3.2-3b": _llama3(
    32.0,
    hidden_size=3072,
    intermediate_size=8192,
    num_layers=28,
    num_heads=24,
    num_kv_heads=8,
    head_dim=128,
    tie_embeddings=True,
  ),
  "llama3.1-8b": _llama3(
    8.0,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    tie_embeddings=False,
  ),
}


def preset_names() -> list[str]:
  """Names accepted by `get_config`."""
  return list(_PRESETS)


def get_config(preset_name: str, **overrides) -> ModelConfig:
  """Returns the `ModelConfig` of a named preset, with field overrides.

  Args:
    preset_name: one of `preset_names()`.
    **overrides: ModelConfig fields to replace (e.g. `dtype="float32"`, `remat=True`).

  Returns:
    The config.

  Raises:
    ValueError: unknown preset or unknown override field.
  """
  if preset_name not in _PRESETS:
    raise ValueError(f"preset_name {preset_name!r} unknown; choose from {preset_names()}")
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown ModelConfig override(s) {unknown}")
  return ModelConfig(**{**_PRESETS[preset_name], **overrides})
