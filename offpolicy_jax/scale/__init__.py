"""The scale wing: meshes and where arrays live on them.

  sharding  the `(data, fsdp, tensor)` mesh, logical axis names, their one rules table,
            sharding helpers
  disagg    disaggregated sampler/trainer meshes: the device split, weight and batch
            transfer between them, the sampler's parameter copy

May import: the maths modules.
"""

from offpolicy_jax.scale import disagg, sharding

__all__ = ["disagg", "sharding"]
