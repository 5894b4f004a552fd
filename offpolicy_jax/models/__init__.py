"""Qwen2 / Qwen3 / Llama / Qwen3-MoE / Mixtral decoders in Flax NNX, presets, HF io, log-probs.

model = models.from_pretrained("/path/to/Qwen2.5-1.5B-Instruct")  # f32 params + compute
model = models.Decoder(models.get_config("tiny"), rngs=nnx.Rngs(0))
logits = model(tokens)                                             # [B, T, V] float32
logp, entropy = models.sequence_logprobs(model, prompt, prompt_mask, tokens, mask)
models.save_pretrained(model, "/tmp/out")                          # transformers loads it
model = models.Decoder(models.get_config("tiny", lora=models.LoraConfig(rank=8)), rngs=...)
models.lora.save_peft(model, "/tmp/adapter")                       # peft loads it

  decoder        `Decoder` (embeddings, layers, caches, shared-prefix passes) and `KVCache`
  layout         blocks per layer or stacked over layers (`scan_layers`), converted both ways
  block          one decoder block: attention, then the MLP or the mixture of experts
  attention      the grouped-query self-attention layer (projections, q/k norms, adapters)
  layers         parameters with logical axis names, RMSNorm, the SwiGLU MLP
  moe            mixture-of-experts blocks: top-k routing, dropless grouped matmuls
  attention_ops  attention maths without parameters: RoPE, head projections, fused kernels
  lora_ops       the adapter on a projection in the forward pass, with input dropout
  config         decoder hyper-parameters
  presets        named size presets
  hf             Hugging Face checkpoint import / export (feed-forward layouts: hf_moe)
  lora           base / adapter split, merging, PEFT import / export
  logprobs       memory-light teacher-forced log-probs and entropies
  tokenizers     a tiny character tokenizer and an HF `tokenizers` wrapper
  parts          `ModelParts`: a run's mesh, graph, initialiser, tokenizer and adapters
"""

from offpolicy_jax.models import layout, lora
from offpolicy_jax.models.attention_ops import default_positions
from offpolicy_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from offpolicy_jax.models.decoder import Decoder, KVCache
from offpolicy_jax.models.hf import config_from_hf, config_to_hf, from_pretrained, save_pretrained
from offpolicy_jax.models.logprobs import (
  log_kept_mass,
  logprobs,
  sequence_logprobs,
  shared_prefix_logprobs,
)
from offpolicy_jax.models.presets import get_config, preset_names

__all__ = [
  "Decoder",
  "KVCache",
  "LORA_TARGETS",
  "LoraConfig",
  "ModelConfig",
  "config_from_hf",
  "config_to_hf",
  "default_positions",
  "from_pretrained",
  "get_config",
  "layout",
  "log_kept_mass",
  "logprobs",
  "lora",
  "preset_names",
  "save_pretrained",
  "sequence_logprobs",
  "shared_prefix_logprobs",
]
