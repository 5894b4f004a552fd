"""Decoder hyper-parameters: `ModelConfig` and `LoraConfig` (named sizes: `models.presets`)."""

import dataclasses
from typing import Any

import jax.numpy as jnp

_FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe", "mixtral")
# Families whose blocks are mixtures of experts (`models.moe`).
MOE_FAMILIES = ("qwen3_moe", "mixtral")
ATTENTION = ("xla", "dot_product")
# A model of this many parameters or more stacks its blocks over layers by default
# (`ModelConfig.scan_layers`): compile time flat in depth from qwen2.5-0.5b on.
STACK_FROM_PARAMS = 400_000_000
# The projections a low-rank adapter can target (HF / PEFT module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION_TARGETS = LORA_TARGETS[:4]


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
    scan_layers: if True the blocks' parameters are stacked over layers (one
      leaf per kind of weight, leading [L] axis; `models.layout`) and the
      cache-free forward (training, scoring) runs them as one `lax.scan`, so
      compile time stays flat in depth (MaxText's `scan_layers`). The same
      numbers from the same seed as per-layer blocks; HF and PEFT files are
      per layer either way. None (the default): stacked from
      `STACK_FROM_PARAMS` parameters on (the presets of 0.5B and more).
    scan_decode: with stacked blocks, the cached passes (the samplers' prefill
      and decode steps) run as one `lax.scan` too, the KV cache stacked
      [L, ...]: their compile time flat in depth, at a cost in decode speed
      on the CPU (docs/results/compile_time.md). False: the samplers decode
      per layer (`layout.for_decoding`).
    family: "qwen2", "qwen3", "llama", "qwen3_moe" or "mixtral" (selects the HF
      architecture on export).
    attention: "xla" (our einsum attention, head-major keys read in place) or
      "dot_product" (`jax.nn.dot_product_attention`, which JAX maps to cuDNN
      flash attention on GPU; the same numbers within float tolerance).
    lora: low-rank adapters on the projections (`LoraConfig`), or None. With
      experts, adapters target the attention projections only.
    num_experts: E, experts per block (0: a dense SwiGLU block). With E > 0
      every block's feed-forward is a mixture of experts (`models.moe`), as in
      Qwen3-MoE and Mixtral (`family` "qwen3_moe" or "mixtral").
    num_experts_per_tok: k, experts each token is routed to, 1 <= k <= E.
    moe_intermediate_size: each expert's SwiGLU hidden width.
    norm_topk_prob: if True the k routing weights are renormalised to sum to
      1 (Mixtral always; Qwen3-MoE's `norm_topk_prob`), else they are the
      softmax probabilities of the chosen experts.
    value_head: if True the decoder carries a value head on its trunk
      (`models.value`: V(s_t) = w . h_t + b), the critic of `learn.critic`.
    critic: a separate critic model (`models.value`): a decoder of its own
      trunk, with a value head (`value_head` True) and this vocabulary,
      carried as the `critic` submodule; None: no separate critic. Exclusive
      with `value_head` (a head on the policy's own trunk) and with `lora`.
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
  scan_layers: bool | None = None
  scan_decode: bool = False
  family: str = "llama"
  attention: str = "xla"
  lora: LoraConfig | None = None
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  value_head: bool = False
  critic: "ModelConfig | None" = None

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
    self._check_experts()
    self._check_critic()
    if self.scan_layers is None:
      own = self.num_params() - (0 if self.critic is None else self.critic.num_params())
      object.__setattr__(self, "scan_layers", own >= STACK_FROM_PARAMS)

  def _check_critic(self):
    c = self.critic
    if c is None:
      return
    problems = [
      (not c.value_head, "the critic needs its value head (value_head=True)"),
      (c.critic is not None, "a critic has no critic of its own"),
      (self.value_head, "the policy has a value head of its own (value_head=True)"),
      (self.lora is not None or c.lora is not None, "not with adapters (lora)"),
      (
        c.vocab_size != self.vocab_size,
        f"vocabulary {c.vocab_size} is not the policy's {self.vocab_size}",
      ),
      (
        c.max_position_embeddings < self.max_position_embeddings,
        f"max_position_embeddings {c.max_position_embeddings} is shorter than the policy's "
        f"{self.max_position_embeddings}",
      ),
    ]
    for bad, why in problems:
      if bad:
        raise ValueError(f"critic (a run's critic.model): {why}")

  def _check_experts(self):
    e, k = self.num_experts, self.num_experts_per_tok
    if (self.family in MOE_FAMILIES) != (e > 0):
      raise ValueError(
        f"num_experts: family {self.family!r} needs "
        f"{'num_experts >= 1' if self.family in MOE_FAMILIES else 'num_experts = 0'}, got {e}"
      )
    if e == 0:
      return
    if not 1 <= k <= e:
      raise ValueError(f"num_experts_per_tok must be in [1, num_experts={e}], got {k}")
    if self.moe_intermediate_size <= 0:
      raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
    if self.lora is not None and set(self.lora.targets) - set(_ATTENTION_TARGETS):
      raise ValueError(
        "lora targets (a run's lora.targets): with experts, adapters target the attention "
        f"projections only, e.g. --config.lora.targets={','.join(_ATTENTION_TARGETS)}; "
        f"got {','.join(self.lora.targets)}"
      )

  @property
  def rope_scaling_dict(self) -> dict | None:
    """`rope_scaling` as a plain dict (or None)."""
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  def num_params(self) -> int:
    """Number of parameters of the decoder built from this config."""
    d, n, kv, h = (
      self.hidden_size,
      self.num_heads,
      self.num_kv_heads,
      self.head_dim,
    )
    attn = d * n * h * 2 + d * kv * h * 2
    if self.qkv_bias:
      attn += n * h + 2 * kv * h
    if self.qk_norm:
      attn += 2 * h
    layer = attn + self._feed_forward_params() + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    critic = 0 if self.critic is None else self.critic.num_params()
    return self.num_layers * layer + embed + d + (d + 1 if self.value_head else 0) + critic

  def _feed_forward_params(self, active: bool = False) -> int:
    d, e, k = self.hidden_size, self.num_experts, self.num_experts_per_tok
    if e == 0:
      return 3 * d * self.intermediate_size
    return d * e + (k if active else e) * 3 * d * self.moe_intermediate_size

  def num_active_params(self) -> int:
    """Parameters a token is computed with: `num_params` with k of the E experts per block."""
    dense = self._feed_forward_params(active=False) - self._feed_forward_params(active=True)
    return self.num_params() - self.num_layers * dense

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
