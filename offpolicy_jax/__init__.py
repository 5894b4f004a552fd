"""offpolicy_jax: JAX-native off-policy reinforcement learning for language models."""

from offpolicy_jax import types

__version__ = "0.1.0"
