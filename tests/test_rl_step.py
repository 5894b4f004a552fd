"""Tests for the pure RL step: traced lag schedule, vmap over seeds, chunked scans."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import components, lag, rl_step, rollouts  # noqa: E402
from tests.test_loop import small_config  # noqa: E402


@pytest.mark.parametrize("m,n", [(1, 0), (1, 3), (4, 0), (3, 2), (100, 0)])
def test_traced_behaviour_version_matches_the_schedule(m, n):
  steps = jnp.arange(1, 30)
  got = jax.jit(rl_step.behaviour_version)(steps, rl_step.LagSchedule(jnp.int32(m), jnp.int32(n)))
  want = [lag.behavior_version(int(t), m, n) for t in steps]
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.fixture(scope="module")
def built():
  cfg = small_config(**{"sft.enabled": False, "lag.sync_interval": 2, "mesh.data": 1})
  comps = components.build_components(cfg)
  fns = comps.fns
  schedule = rl_step.LagSchedule(jnp.int32(2), jnp.int32(0))
  return fns, comps.run.replay, schedule


def _state(fns, seed):
  return rl_step.init_state(fns, fns.init_params(seed), capacity_batches=1, snapshots=2)


def _prompts(fns, seed, steps):
  it = rollouts.prompt_iterator(fns, seed)
  batches = [next(it) for _ in range(steps)]
  return [{k: jnp.asarray(b[k]) for k in rollouts.DEVICE_FIELDS} for b in batches]


def test_vmap_over_three_seeds_matches_three_single_seed_runs(built):
  fns, opts, schedule = built
  seeds, steps = (0, 1, 2), 3
  step_fn = functools.partial(rl_step.rl_step, fns, opts)
  single = jax.jit(step_fn)
  singles = []
  for seed in seeds:
    state = _state(fns, seed)
    rows = []
    for t, prompts in enumerate(_prompts(fns, seed, steps), start=1):
      state, m = single(state, prompts, jnp.int32(t), jnp.int32(seed), schedule)
      rows.append(m)
    singles.append((state, rows))

  batched = jax.jit(jax.vmap(step_fn, in_axes=(0, 0, None, 0, None)))
  stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
  state = stack([_state(fns, s) for s in seeds])
  per_seed = [_prompts(fns, s, steps) for s in seeds]
  for t in range(steps):
    prompts = stack([p[t] for p in per_seed])
    state, m = batched(state, prompts, jnp.int32(t + 1), jnp.asarray(seeds, jnp.int32), schedule)
    for i in range(len(seeds)):
      for k in ("reward_mean", "loss", "staleness_max", "behavior_version", "grad_norm"):
        np.testing.assert_allclose(m[k][i], singles[i][1][t][k], rtol=1e-4, atol=1e-5, err_msg=k)
  for i in range(len(seeds)):
    got = jax.tree.map(lambda x, i=i: x[i], state.train.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(singles[i][0].train.params), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_scanned_chunk_equals_step_by_step(built):
  fns, opts, schedule = built
  prompts = _prompts(fns, 0, 4)
  single = jax.jit(functools.partial(rl_step.rl_step, fns, opts))
  state = _state(fns, 0)
  rows = []
  for t, p in enumerate(prompts, start=1):
    state, m = single(state, p, jnp.int32(t), jnp.int32(0), schedule)
    rows.append(m)
  chunk = jax.jit(functools.partial(rl_step.rl_steps, fns, opts))
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *prompts)
  state2, out = chunk(_state(fns, 0), stacked, jnp.arange(1, 5, dtype=jnp.int32), 0, schedule)
  for t in range(4):
    for k in ("reward_mean", "loss", "behavior_version", "staleness_mean"):
      np.testing.assert_allclose(out[k][t], rows[t][k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_array_equal(out["snapshot_missing"], 0)
  for a, b in zip(jax.tree.leaves(state.train), jax.tree.leaves(state2.train), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
