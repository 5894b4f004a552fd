"""Tests for the pure RL step: traced lag schedule, vmap over seeds, chunked scans."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import lag  # noqa: E402
from offpolicy_jax.rollout import prompt_rows  # noqa: E402
from offpolicy_jax.run import components  # noqa: E402
from offpolicy_jax.step import rl_step, run_state  # noqa: E402
from tests.test_loop import small_config  # noqa: E402


@pytest.mark.parametrize("m,n", [(1, 0), (1, 3), (4, 0), (3, 2), (100, 0)])
def test_traced_behaviour_version_matches_the_schedule(m, n):
  steps = jnp.arange(1, 30)
  got = jax.jit(lag.behavior_version)(steps, jnp.int32(m), jnp.int32(n))
  want = [lag.behavior_version(int(t), m, n) for t in steps]
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.fixture(scope="module")
def built():
  cfg = small_config(**{"sft.enabled": False, "lag.sync_interval": 2})
  comps = components.build_components(cfg)
  fns = comps.fns
  schedule = run_state.LagSchedule(jnp.int32(2), jnp.int32(0))
  single = jax.jit(functools.partial(rl_step.rl_step, fns, comps.replay))
  return fns, comps.replay, schedule, single


STEPS = 3
SEEDS = (0, 1, 2)


def _state(fns, seed):
  return run_state.init_state(fns, fns.model.init_params(seed), capacity_batches=1, snapshots=2)


def _prompts(fns, seed, steps):
  it = fns.prompts(seed)
  batches = [next(it) for _ in range(steps)]
  return [{k: jnp.asarray(b[k]) for k in prompt_rows.DEVICE_FIELDS} for b in batches]


@pytest.fixture(scope="module")
def single_runs(built):
  """(final state, metric rows) of STEPS single-seed steps for each seed."""
  fns, _, schedule, single = built
  runs = []
  for seed in SEEDS:
    state, rows = _state(fns, seed), []
    for t, prompts in enumerate(_prompts(fns, seed, STEPS), start=1):
      state, m = single(state, prompts, jnp.int32(t), jnp.int32(seed), schedule)
      rows.append(m)
    runs.append((state, rows))
  return runs


def test_vmap_over_three_seeds_matches_three_single_seed_runs(built, single_runs):
  fns, opts, schedule, _ = built
  batched = jax.jit(jax.vmap(functools.partial(rl_step.rl_step, fns, opts), (0, 0, None, 0, None)))
  stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
  state = stack([_state(fns, s) for s in SEEDS])
  per_seed = [_prompts(fns, s, STEPS) for s in SEEDS]
  for t in range(STEPS):
    prompts = stack([p[t] for p in per_seed])
    state, m = batched(state, prompts, jnp.int32(t + 1), jnp.asarray(SEEDS, jnp.int32), schedule)
    for i in range(len(SEEDS)):
      for k in ("reward_mean", "loss", "staleness_max", "behavior_version", "grad_norm"):
        want = single_runs[i][1][t][k]
        np.testing.assert_allclose(m[k][i], want, rtol=1e-4, atol=1e-5, err_msg=k)
  for i in range(len(SEEDS)):
    got = jax.tree.map(lambda x, i=i: x[i], state.train.params)
    want = single_runs[i][0].train.params
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_scanned_chunk_equals_step_by_step(built, single_runs):
  fns, opts, schedule, _ = built
  chunk = jax.jit(functools.partial(rl_step.rl_steps, fns, opts))
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *_prompts(fns, 0, STEPS))
  steps = jnp.arange(1, STEPS + 1, dtype=jnp.int32)
  state, out = chunk(_state(fns, 0), stacked, steps, 0, schedule)
  want_state, rows = single_runs[0]
  for t in range(STEPS):
    for k in ("reward_mean", "loss", "behavior_version", "staleness_mean"):
      np.testing.assert_allclose(out[k][t], rows[t][k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_array_equal(out["snapshot_missing"], 0)
  for a, b in zip(jax.tree.leaves(state.train), jax.tree.leaves(want_state.train), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_readme_example_of_one_rl_step_runs():
  """The README's Python example (build the components, one jitted RL step) runs as written."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "README.md")) as f:
    text = f.read()
  blocks = [b.split("```", 1)[0] for b in text.split("```python")[1:]]
  (example,) = [b for b in blocks if "build_components" in b]
  scope = {"functools": functools, "jax": jax, "jnp": jnp, "opj": __import__("offpolicy_jax")}
  exec(compile(example, "README.md", "exec"), scope)  # the repository's own text, not model output
  assert np.isfinite(float(scope["metrics"]["loss"]))
  assert int(scope["state"].train.step) == 1
