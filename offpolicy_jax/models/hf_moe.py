"""Hugging Face layouts of the feed-forward: dense SwiGLU, Qwen3-MoE and Mixtral experts.

`models.hf` imports and exports whole checkpoints; this module holds what
differs between the families' feed-forward blocks: the config fields of the
mixtures of experts, and the rows of `hf._tensor_map` for one block.

On disk (as `transformers` writes them), each expert is its own set of
linear weights, ``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``
(Qwen3-MoE) or ``model.layers.{i}.block_sparse_moe.experts.{j}.{w1,w3,w2}.weight``
(Mixtral), [out, in] each; ours are stacked ``[E, in, out]``. On import the E
stored tensors are read through `Stacked`, a lazy view, so a device reads only
its own slice of its own experts, as for the dense weights.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from offpolicy_jax.models import layout
from offpolicy_jax.models.config import ModelConfig

# HF config fields of the MoE families, and the values the decoder implements.
_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
  ("decoder_sparse_step", 1, "every block a mixture of experts"),
  ("mlp_only_layers", [], "no dense blocks between them"),
  ("router_jitter_noise", 0.0, "no router noise"),
)


def config_from_hf(hf: Mapping, family: str) -> dict:
  """The `ModelConfig` fields of an HF config's experts ({} for a dense family).

  Raises:
    ValueError: naming an HF field whose value the decoder does not implement.
  """
  if family not in ("qwen3_moe", "mixtral"):
    return {}
  for name, value, what in _UNSUPPORTED:
    if name in hf and hf[name] not in (value, None):
      raise ValueError(f"{name}={hf[name]!r} is not supported ({what}: {name}={value!r} only)")
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  return dict(
    num_experts=int(experts or 0),
    num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
    moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
    norm_topk_prob=family == "mixtral" or bool(hf.get("norm_topk_prob", False)),
  )


def config_to_hf(c: ModelConfig) -> dict:
  """The HF config fields of `c`'s experts ({} for a dense model)."""
  if c.num_experts == 0:
    return {}
  fields = {"num_experts_per_tok": c.num_experts_per_tok, "router_aux_loss_coef": 0.0}
  if c.family == "mixtral":
    if not c.norm_topk_prob or c.moe_intermediate_size != c.intermediate_size:
      raise ValueError(
        "family 'mixtral' renormalises the top-k weights and has experts of width "
        "intermediate_size: export needs norm_topk_prob=True and "
        f"moe_intermediate_size={c.intermediate_size}, got {c.norm_topk_prob}, "
        f"{c.moe_intermediate_size}"
      )
    return {**fields, "num_local_experts": c.num_experts, "router_jitter_noise": 0.0}
  return {
    **fields,
    "num_experts": c.num_experts,
    "moe_intermediate_size": c.moe_intermediate_size,
    "norm_topk_prob": c.norm_topk_prob,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
  }


class Stacked(layout.LayerViews):
  """E stored [out, in] tensors seen as one [E, in, out] array, read lazily.

  Indexing with a tuple of slices (`jax.make_array_from_callback`'s) reads
  only the indexed experts' slices; `np.asarray` reads all.
  """

  def __init__(self, views: Sequence[np.ndarray]):
    shapes = {v.T.shape for v in views}
    if len(shapes) != 1:
      raise ValueError(f"experts of one block differ in shape: {sorted(shapes)}")
    super().__init__([v.T for v in views])


def _stacked(names: Sequence[str]) -> tuple[Callable, Callable]:
  def to_hf(x):  # ours [E, in, out] -> E tensors [out, in]
    return [np.ascontiguousarray(x[e].T) for e in range(len(names))]

  return Stacked, to_hf


def rows(c: ModelConfig, prefix: str, ours: tuple) -> list[tuple]:
  """`hf._tensor_map` rows of block `ours` (HF names under `prefix`, "model.layers.{i}.").

  A row names one HF tensor (a str), or, for stacked experts, the E tensors
  (a tuple) its two converters read and write as a list.
  """
  tr = (lambda x: x.T, lambda x: x.T)
  mlp = (*ours, "mlp")
  if c.num_experts == 0:
    return [
      ((*mlp, n), f"{prefix}mlp.{n}.weight", *tr) for n in ("gate_proj", "up_proj", "down_proj")
    ]
  if c.family == "mixtral":
    block, names = "block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
  else:
    block, names = "mlp", {n: n for n in ("gate_proj", "up_proj", "down_proj")}
  out: list[tuple] = [((*mlp, "router"), f"{prefix}{block}.gate.weight", *tr)]
  for ours_name, hf_name in names.items():
    experts = tuple(f"{prefix}{block}.experts.{e}.{hf_name}.weight" for e in range(c.num_experts))
    out.append(((*mlp, ours_name), experts, *_stacked(experts)))
  return out
