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
# Tests (and the training subprocesses they start) build many identical programs: a
# persistent compilation cache, new and empty for each session and shared by its xdist
# workers and subprocesses, compiles each of them once. The controller makes it before
# the workers start (they inherit the environment) and removes it at exit. Tests that
# count compilations turn it off (`no_compile_cache`): a cache hit is not a compilation.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _CACHE_DIR = tempfile.mkdtemp(prefix="offpolicy_jax_tests_xla_cache_")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

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


@pytest.fixture
def no_compile_cache():
  """The persistent compilation cache off for one test, so every program it builds compiles."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


# `--jax-times`: where the suite's time goes. Per test (its setup, call and teardown), the
# seconds JAX spent tracing, lowering and compiling (XLA's backend), from JAX's own
# monitoring events; the 30 tests with the most compile time and the totals are printed at
# the end (xdist workers send theirs with their reports).
_JAX_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "compile",
}
_JAX_SPENT: dict[str, float] = {}  # since the last report, in this process
_TIMES: dict[str, dict[str, float]] = {}  # per test id, summed over its phases


# The slowest files first (measured with `--durations=0`, docs/development.md). Under the
# README's `-n 2 --dist loadfile` a worker takes the next file when it frees up: a slow
# file started last ends the run on one worker while the other idles. Files keep their
# own order of tests (their module fixtures are shared in that order).
_SLOW_FILES_FIRST = (
  "test_loop.py",
  "test_multiprocess.py",
  "test_experiments.py",
  "test_colab.py",
  "test_study.py",
  "test_critic_run.py",
  "test_disagg.py",
  "test_multiturn_run.py",
  "test_lora_run.py",
  "test_routing_replay.py",
  "test_moe.py",
  "test_runs_memory.py",
  "test_step_speedups.py",
  "test_layout.py",
  "test_compile_time.py",
  "test_cli.py",
)


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_SLOW_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_addoption(parser):
  parser.addoption(
    "--jax-times",
    action="store_true",
    help="print the seconds each test spent tracing, lowering and compiling JAX programs",
  )


def pytest_configure(config):
  # xdist hands files out by their number of tests unless told not to: keep the order above.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False
  if config.getoption("--jax-times"):
    import jax

    def listen(event, seconds, **_):
      if event in _JAX_EVENTS:
        _JAX_SPENT[_JAX_EVENTS[event]] = _JAX_SPENT.get(_JAX_EVENTS[event], 0.0) + seconds

    jax.monitoring.register_event_duration_secs_listener(listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  if item.config.getoption("--jax-times"):
    outcome.get_result().user_properties.append(("jax_times", dict(_JAX_SPENT)))
    _JAX_SPENT.clear()


def pytest_runtest_logreport(report):
  spent = dict(report.user_properties).get("jax_times")
  if spent is None:
    return
  times = _TIMES.setdefault(report.nodeid, {"wall": 0.0})
  times["wall"] += report.duration
  for k, v in spent.items():
    times[k] = times.get(k, 0.0) + v


def pytest_terminal_summary(terminalreporter, config):
  if not _TIMES:
    return
  write = terminalreporter.write_line
  write("JAX time per test (s): wall, trace, lower, compile; the 30 with the most compile")
  order = sorted(_TIMES.items(), key=lambda kv: -kv[1].get("compile", 0.0))
  for nodeid, t in order[:30]:
    parts = (t["wall"], t.get("trace", 0), t.get("lower", 0), t.get("compile", 0))
    write(" ".join(f"{x:8.1f}" for x in parts) + f"  {nodeid}")
  total = {
    k: sum(t.get(k, 0.0) for t in _TIMES.values()) for k in ("wall", "trace", "lower", "compile")
  }
  write("total: " + ", ".join(f"{k} {v:.1f}" for k, v in total.items()))
