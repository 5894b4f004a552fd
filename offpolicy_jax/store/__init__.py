"""The store wing: what a run writes to disk and reads back.

  checkpointing  orbax save/restore of named items; fallback past corrupt steps
  integrity      sha256 manifests of checkpoint files, format checks, moving corrupt steps aside
  items          how a pytree is stored as a named item (nested dicts by path name) and rebuilt
  workdir        the workdir lock and the config record a resume is checked against
  metrics        JSONL + TensorBoard (+ optional wandb) writers that survive torn/deleted files
  metrics_files  reading metrics.jsonl (torn lines skipped), truncating it on resume

May import: the maths modules.
"""

import importlib
from typing import Any

__all__ = ["checkpointing", "integrity", "items", "metrics", "metrics_files", "workdir"]


# The modules load on first use: `workdir` and `metrics` need no JAX, so a binary refuses a
# mistyped workdir before it pays for importing JAX and orbax (`checkpointing`, `items`).
def __getattr__(name: str) -> Any:
  if name not in __all__:
    raise AttributeError(f"module 'offpolicy_jax.store' has no attribute {name!r}")
  module = importlib.import_module(f"offpolicy_jax.store.{name}")
  globals()[name] = module
  return module


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
