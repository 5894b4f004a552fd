"""The store wing: what a run writes to disk and reads back.

  checkpointing  orbax save/restore of named items; fallback past corrupt steps
  integrity      sha256 manifests of checkpoint files, format checks, moving corrupt steps aside
  items          how a pytree is stored as a named item (nested dicts by path name) and rebuilt
  workdir        the workdir lock and the config record a resume is checked against
  metrics        JSONL + TensorBoard (+ optional wandb) writers that survive torn/deleted files
  metrics_files  reading metrics.jsonl (torn lines skipped), truncating it on resume

May import: the maths modules.
"""

from offpolicy_jax import lazy

__all__ = ["checkpointing", "integrity", "items", "metrics", "metrics_files", "workdir"]

# The modules load on first use: a binary refuses a wrong config or workdir before it pays
# for importing JAX, orbax and the models.
__getattr__, __dir__ = lazy.modules(__name__, __all__)
