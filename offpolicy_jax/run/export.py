"""Export a run's checkpoint as a PEFT adapter or a Hugging Face checkpoint.

  python -m experiments.export --workdir=DIR --out=OUT [--format=peft|merged] [--step=N]
  export.export_checkpoint(workdir, out, fmt="peft")     # the same, from a notebook

The run is rebuilt from its recorded config (`config.json`, with the changes
`config_history.jsonl` records applied in order; fields added since take their
defaults); the parameters of the checkpoint step (default: the latest) are read
by name, as `start.evaluate_checkpoint` reads them. Formats:

- ``peft`` (a LoRA run): `models.lora.save_peft` writes the adapter to OUT.
  The adapter belongs to the run's frozen base, rebuilt as at the run's start
  (loaded from `config.model`, warm-started when `sft.enabled`) and checked
  against the base fingerprint the checkpoint recorded. When that base is
  exactly an HF directory on disk (`config.model` without a warm start),
  ``adapter_config.json`` names it; otherwise (a preset, a warm-started base)
  the base is written as an HF checkpoint to OUT/base and named instead, so
  `peft.PeftModel.from_pretrained` always has the adapter's own base.
- ``merged``: one HF checkpoint with W + (alpha / r) A B in every adapted
  projection (`models.lora.save_merged`); for a run without adapters, the
  trained model itself.

Every HF checkpoint written (the merged model, OUT/base) holds the run's
tokenizer and its special token ids (`models.hf.save_tokenizer`), so
`AutoTokenizer` and `AutoModelForCausalLM` load it as it is and `generate()`
stops at EOS; an adapter directory holds the tokenizer files. OUT must be new
or empty: an export never mixes its files with others.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
from flax import nnx

from offpolicy_jax import errors, models
from offpolicy_jax.config_spec import RunSpec
from offpolicy_jax.models import hf, hub
from offpolicy_jax.run import components, relayout, start
from offpolicy_jax.store import checkpointing
from offpolicy_jax.store import workdir as workdir_lib

# The config a run last ran with (kept here by name for existing callers).
recorded_config = workdir_lib.recorded_config

FORMATS = ("peft", "merged")
BASE_DIR = "base"


def _cannot_export(workdir: str, e: checkpointing.CheckpointError) -> checkpointing.CheckpointError:
  return checkpointing.CheckpointError(
    f"{workdir}: cannot export: {e}; pass --step for an older intact step", e.failures
  )


def _restore(workdir: str, comps, step: int | None):
  """`(base, params, meta)` of checkpoint `step`, the base checked against its record."""
  base, params = start.initial_weights(comps, warm_start=comps.fns.model.lora is not None)
  try:
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), create=False)
    try:
      stacked = comps.fns.model.stacked
      items, meta, _ = relayout.restore(
        ckpt, {"params": params}, step=step, stacked=stacked, workdir=workdir
      )
    finally:
      ckpt.close()
  except checkpointing.CheckpointError as e:
    raise _cannot_export(workdir, e) from None
  if base is not None:
    want = meta.get("base") or {}
    got = models.lora.fingerprint(base)
    stacked = comps.fns.model.stacked
    if not relayout.fingerprint_matches(want.get("fingerprint"), base, stacked, got):
      raise ValueError(
        f"{workdir}: the checkpoint's adapters belong to the base {want}, but the rebuilt "
        f"base has fingerprint {got} (config.model or its files changed, or a warm start"
        " rebuilt on other devices or XLA flags than the run's); refusing to export"
      )
  return base, items["params"], meta


def export_checkpoint(
  workdir: str, out: str, *, fmt: str = "peft", step: int | None = None, dtype: Any = None
) -> dict[str, Any]:
  """Writes a run's checkpoint as a PEFT adapter (`fmt="peft"`) or an HF checkpoint ("merged").

  Args:
    workdir: the run directory (config.json, checkpoints/).
    out: output directory (created); a non-empty one is refused.
    fmt: "peft" (LoRA runs only) or "merged".
    step: checkpoint step; None for the latest.
    dtype: storage dtype (default: the parameter dtype).

  Returns:
    `{"step", "format", "out", "base"}`; "base" is the adapter's base (PEFT) or None.
    `out` (and a base written under it) also holds the run's tokenizer files.

  Raises:
    errors.UserError: an unknown format or dtype, "peft" for a run without adapters,
      an `out` that is a file or a non-empty directory (before anything is written).
    ValueError: a base mismatch.
    FileNotFoundError / checkpointing.CheckpointError: no checkpoint, or a corrupt step.
  """
  if fmt not in FORMATS:
    raise errors.UserError(f"export format must be one of {FORMATS}, got {fmt!r}")
  if dtype is not None:
    try:
      jnp.dtype(dtype)
    except TypeError:
      raise errors.UserError(
        f"--dtype {dtype}: not a dtype", "e.g. bfloat16, float16 or float32"
      ) from None
  if os.path.exists(out) and not os.path.isdir(out):
    raise errors.UserError(f"--out {out} is a file", "give a directory to write the export into")
  if os.path.isdir(out) and os.listdir(out):
    raise errors.UserError(
      f"--out {out} is not empty: the export would mix its files with what is there",
      "choose an empty or new folder",
    )
  config = recorded_config(workdir)
  if fmt == "peft" and not RunSpec.from_config(config).lora.rank:
    raise errors.UserError(
      f"{workdir}: the run has no adapters (lora.rank = 0), so there is no PEFT adapter",
      "export the whole model with --merged",
    )
  try:
    start.require_step(workdir, step)  # before the model is built (and warm-started)
  except checkpointing.MissingCheckpoint as e:
    raise checkpointing.MissingCheckpoint(f"{workdir}: nothing to export: {e}") from None
  except checkpointing.CheckpointError as e:
    raise _cannot_export(workdir, e) from None
  comps = components.build_components(config)
  base, params, meta = _restore(workdir, comps, step)
  model = nnx.merge(comps.fns.model.graphdef, models.lora.join(base, params))
  tokenizer, base_path = comps.fns.model.tokenizer, None
  if fmt == "merged":
    models.lora.save_merged(model, out, dtype)
    hf.save_tokenizer(tokenizer, out)
  else:
    base_path = _base_path(config, model, out, dtype, tokenizer)
    models.lora.save_peft(model, out, base_model_name_or_path=base_path, dtype=dtype)
    tokenizer.save_pretrained(out)  # `transformers` loads it from the adapter's directory too
  return {"step": meta["step"], "format": fmt, "out": out, "base": base_path}


def _base_path(config, model, out: str, dtype, tokenizer) -> str:
  """The HF directory of the adapter's base: `config.model`, or the base written to OUT/base."""
  spec = RunSpec.from_config(config)
  local = hub.model_dir(spec.model)
  if local is not None and not spec.sft.enabled:
    return os.path.abspath(local)
  path = os.path.join(out, BASE_DIR)
  base = models.lora.without_adapters(_zeroed(model))
  models.save_pretrained(base, path, dtype, tokenizer=tokenizer)
  return os.path.abspath(path)


def _zeroed(model):
  """`model` with its adapters' B set to 0: the plain base under them."""
  graphdef, adapter, rest = nnx.split(model, nnx.LoRAParam, ...)
  zero = nnx.map_state(
    lambda path, v: v.replace(v[...] * 0) if path[-1] == "lora_b" else v, adapter
  )
  return nnx.merge(graphdef, zero, rest)
