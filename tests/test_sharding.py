"""Tests for mesh construction, logical-axis rules and sharding helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from offpolicy_jax.scale import sharding
from offpolicy_jax.types import TrainBatch


def test_make_mesh_fill_and_shapes():
  assert jax.device_count() == 8
  mesh = sharding.make_mesh(data=-1, fsdp=2, tensor=2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
  mesh = sharding.make_mesh(data=1, fsdp=-1, devices=jax.devices()[:1])
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  mesh = sharding.make_mesh(tensor=2, axis_type=jax.sharding.AxisType.Explicit)
  assert mesh.shape["data"] == 4


@pytest.mark.parametrize(
  "kwargs,field",
  [
    (dict(data=3), "mesh"),
    (dict(data=-1, fsdp=3), "fsdp"),
    (dict(data=-1, tensor=-1), "-1"),
    (dict(data=0), "mesh.data"),
    (dict(data=-1, tensor=0), "mesh.tensor"),
  ],
)
def test_make_mesh_errors(kwargs, field):
  with pytest.raises(ValueError, match=field):
    sharding.make_mesh(**kwargs)


def test_rules_table_names_every_logical_axis_once():
  assert [name for name, _ in sharding.LOGICAL_AXIS_RULES] == list(sharding.LOGICAL_AXES)
  assert sharding.MESH_AXES == (sharding.DATA, sharding.FSDP, sharding.TENSOR)


def test_logical_to_spec_rules_and_divisibility():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  assert sharding.logical_to_spec(("embed", "mlp"), (8, 4), mesh) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("vocab", "embed"), (5, 8), mesh) == P(None, "fsdp")
  assert sharding.logical_to_spec(("batch", None), (4, 3), mesh) == P(("data", "fsdp"), None)
  # A mesh axis is used once per spec.
  assert sharding.logical_to_spec(("mlp", "heads"), (4, 4), mesh) == P("tensor", None)
  assert sharding.logical_to_spec(None) == P()
  with pytest.raises(ValueError, match="nonsense"):
    sharding.logical_to_spec(("nonsense",))
  # Size-1 mesh axes are dropped.
  one = sharding.make_mesh(data=8)
  assert sharding.logical_to_spec(("embed", "mlp"), (8, 4), one) == P(None, None)


class _Toy(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(
      jnp.arange(32.0).reshape(4, 8), out_sharding=("embed", "mlp"), eager_sharding=False
    )
    self.e = nnx.Param(jnp.ones((5, 4)), out_sharding=("vocab", "embed"), eager_sharding=False)
    self.b = nnx.Param(jnp.ones(8))


def test_shard_params_places_by_logical_names():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  _, state = nnx.split(_Toy())
  placed = sharding.shard_params(state, mesh)
  assert placed["w"].get_value().sharding.spec == P("fsdp", "tensor")
  assert placed["e"].get_value().sharding.spec == P(None, "fsdp")
  assert placed["b"].get_value().sharding.spec == P()
  np.testing.assert_array_equal(placed["w"].get_value(), state["w"].get_value())


def test_shard_batch_and_errors():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  batch = TrainBatch(*[jnp.zeros((8, 3))] * 11)
  out = sharding.shard_batch(batch, mesh)
  assert out.tokens.sharding.spec == P(("data", "fsdp"), None)
  bad = batch._replace(rewards=jnp.zeros(6))
  with pytest.raises(ValueError, match="batch.rewards"):
    sharding.shard_batch(bad, mesh)


def test_constrain_inside_jit():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  f = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", "mlp"), mesh))
  y = f(jnp.ones((4, 4)))
  assert y.sharding.spec == P(("data", "fsdp"), "tensor")
  # Without a mesh it is the identity.
  np.testing.assert_array_equal(sharding.constrain(jnp.ones(3), ("batch",)), np.ones(3))
