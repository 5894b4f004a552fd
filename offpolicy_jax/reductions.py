"""Typed metric reductions: the type of a metric says how it combines.

A train step computes metrics per micro-batch and per optimizer step and must
combine them exactly. Instead of choosing a reduction by the metric's name,
each value is wrapped in its reduction type:

  Mean(total, weight)  combines by summing both; the value is total / weight
  Sum(value)           combines by summing
  Max(value), Min(value)

`merge(a, b)` combines two trees of typed metrics of the same structure,
`reduce(stacked)` combines along a leading axis (the output of a `lax.scan`),
`identity(tree)` is the neutral element (zeros, -inf, +inf) that a scan
starts from, and `results(tree)` turns the typed tree into a flat dict of
scalars. Like tunix's weighted metrics or `optax`'s (sum, count) means,
divisions happen once, after accumulation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Mean(NamedTuple):
  """A mean kept as ``(total, weight)``: ``value = total / weight`` (0 when weight is 0)."""

  total: jax.Array
  weight: jax.Array


class Sum(NamedTuple):
  value: jax.Array


class Max(NamedTuple):
  value: jax.Array


class Min(NamedTuple):
  value: jax.Array


_TYPES = (Mean, Sum, Max, Min)


def _is_metric(x: Any) -> bool:
  return isinstance(x, _TYPES)


def mean(value: jax.Array, weight: jax.Array | float = 1.0) -> Mean:
  """A mean of `value` with weight `weight` (e.g. a per-token mean weighted by its token count)."""
  weight = jnp.asarray(weight, jnp.float32)
  return Mean(jnp.asarray(value, jnp.float32) * weight, weight)


def _merge_one(a, b):
  if isinstance(a, Mean):
    return Mean(a.total + b.total, a.weight + b.weight)
  if isinstance(a, Sum):
    return Sum(a.value + b.value)
  if isinstance(a, Max):
    return Max(jnp.maximum(a.value, b.value))
  return Min(jnp.minimum(a.value, b.value))


def merge(a: Any, b: Any) -> Any:
  """Combines two trees of typed metrics with the same structure."""
  return jax.tree.map(_merge_one, a, b, is_leaf=_is_metric)


def _reduce_one(x):
  if isinstance(x, Mean):
    return Mean(x.total.sum(0), x.weight.sum(0))
  if isinstance(x, Sum):
    return Sum(x.value.sum(0))
  if isinstance(x, Max):
    return Max(x.value.max(0))
  return Min(x.value.min(0))


def reduce(stacked: Any) -> Any:
  """Combines a tree of typed metrics along the leading axis of its arrays."""
  return jax.tree.map(_reduce_one, stacked, is_leaf=_is_metric)


def _extreme(z: jax.Array, high: bool) -> jax.Array:
  if jnp.issubdtype(z.dtype, jnp.integer):
    info = jnp.iinfo(z.dtype)
    return jnp.full_like(z, info.max if high else info.min)
  return jnp.full_like(z, jnp.inf if high else -jnp.inf)


def _identity_one(x):
  z = jnp.zeros(jnp.shape(x[0]), jnp.result_type(x[0]))
  if isinstance(x, Mean):
    return Mean(z, jnp.zeros(jnp.shape(x.weight), jnp.result_type(x.weight)))
  if isinstance(x, Sum):
    return Sum(z)
  if isinstance(x, Max):
    return Max(_extreme(z, high=False))
  return Min(_extreme(z, high=True))


def identity(tree: Any) -> Any:
  """The neutral element of `tree`'s metrics (works on `jax.eval_shape` outputs too)."""
  return jax.tree.map(_identity_one, tree, is_leaf=_is_metric)


def _result_one(x):
  if isinstance(x, Mean):
    return jnp.where(x.weight > 0, x.total / jnp.where(x.weight > 0, x.weight, 1), 0.0)
  return x.value


def results(tree: dict[str, Any]) -> dict[str, jax.Array]:
  """`{name: typed metric}` -> `{name: scalar}`."""
  return {k: _result_one(v) for k, v in tree.items()}
