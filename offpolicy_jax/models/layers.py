"""The decoder's small layers: parameters with logical axis names, RMSNorm and the SwiGLU MLP.

Every parameter carries logical axis names in its `out_sharding` metadata
(`models.decoder`'s module docstring); `param` makes one.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax.models import lora_ops
from offpolicy_jax.models.config import ModelConfig


def param(key, shape, names, dtype, init="normal"):
  """An `nnx.Param` with logical axis `names` (`out_sharding`): normal(0.02), ones or zeros."""
  if init == "normal":
    value = 0.02 * jax.random.normal(key, shape, dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = jnp.zeros(shape, dtype)
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * w, computed in float32 (Zhang & Sennrich, arXiv:1910.07467)."""

  def __init__(self, dim: int, eps: float, names: tuple, config: ModelConfig):
    self.eps = eps
    self.dtype = jnp.dtype(config.dtype)
    self.weight = param(None, (dim,), names, jnp.dtype(config.param_dtype), init="ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    w = jnp.broadcast_to(self.weight[...].astype(jnp.float32), x.shape)
    return (w * x32.astype(x.dtype)).astype(self.dtype)


class MLP(lora_ops.Adapted):
  """SwiGLU feed-forward: W_down (silu(x W_gate) * x W_up) (Shazeer, arXiv:2002.05202)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    pd = jnp.dtype(config.param_dtype)
    self.config = config
    d, f = config.hidden_size, config.intermediate_size
    self.dtype = jnp.dtype(config.dtype)
    self.gate_proj = param(rngs.params(), (d, f), ("embed", "mlp"), pd)
    self.up_proj = param(rngs.params(), (d, f), ("embed", "mlp"), pd)
    self.down_proj = param(rngs.params(), (f, d), ("mlp", "embed"), pd)

  def __call__(self, x_btd, key=None):
    dt = self.dtype
    gate = x_btd @ self.gate_proj[...].astype(dt)
    up = x_btd @ self.up_proj[...].astype(dt)
    if self.config.lora is not None:
      gate = gate + self._delta("gate_proj", x_btd, gate.shape, key)
      up = up + self._delta("up_proj", x_btd, up.shape, key)
    hidden = jax.nn.silu(gate) * up
    out = hidden @ self.down_proj[...].astype(dt)
    if self.config.lora is None:
      return out
    return out + self._delta("down_proj", hidden, out.shape, key)
