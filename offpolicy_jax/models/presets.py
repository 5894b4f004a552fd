"""Named size presets of `ModelConfig`.

Presets cover the Qwen2.5, Qwen3, Qwen3-MoE, Mixtral and Llama 3.x families
with the values of the published `config.json` files, plus three small
random-init presets: "tiny" (about 100k parameters, for tests and the CPU
default job), "tiny-moe" (tiny's attention with 4 experts, top-2, per block)
and "small" (about 25M parameters, for benchmarks).
"""

import dataclasses

from offpolicy_jax.models.config import ModelConfig


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
  kw.setdefault("family", "qwen3")
  return dict(
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
  # Tiny's attention and 4 experts of width 48 (top-2) per block: MoE tests and studies.
  "tiny-moe": dict(
    family="qwen3_moe",
    qk_norm=True,
    vocab_size=64,
    hidden_size=64,
    intermediate_size=192,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_embeddings=True,
    max_position_embeddings=512,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
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
  "qwen3-30b-a3b": _qwen3(
    family="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    tie_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
  ),
  "mixtral-8x7b": dict(
    family="mixtral",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    max_position_embeddings=32768,
    dtype="bfloat16",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=14336,
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
