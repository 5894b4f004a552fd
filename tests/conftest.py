"""Shared pytest setup: 8 fake CPU devices so sharding tests run anywhere."""

import os

# Must happen before jax is imported anywhere in the test session. The tests'
# models are tiny, so compiling dominates their time: LLVM's backend optimisations
# are off (about 25-30% less compile time; floating-point semantics unchanged), and
# fusions are emitted by XLA:CPU's older elemental emitters instead of its MLIR
# fusion emitters (about half the remaining compile time; the numbers can differ
# from the default emitters' in the last bit, and every comparison in the suite
# is between programs compiled with these same flags).
FAST_COMPILE = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  " --xla_cpu_use_fusion_emitters=false"
)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Implicit rank promotion ([B, T] op [T]) hides shape bugs: the whole suite, its
# subprocesses and notebook kernels included (they inherit the environment),
# runs with it raising.
os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

import pytest  # noqa: E402


def _numpy_init(config, scale=8.0, seed=0):
  """(graphdef, params) of a Decoder with numpy-random weights: no compilation needed.

  `scale` peaks the logits so sampling tests see non-uniform distributions.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from offpolicy_jax import models

  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0))))
  rng = np.random.RandomState(seed)

  def draw(x):
    if x.ndim == 1:  # Norm weights near 1.
      return jnp.asarray(1 + 0.1 * rng.randn(*x.shape), jnp.float32)
    return jnp.asarray(0.02 * scale * rng.randn(*x.shape), jnp.float32)

  return graphdef, jax.tree.map(draw, state)


@pytest.fixture(scope="session")
def numpy_init():
  """The `_numpy_init(config, scale=8.0, seed=0)` factory, shared by model and sampler tests."""
  return _numpy_init
