"""Tests for build_components: the only reader of the config, compiled parts shared safely."""

import dataclasses
import json
import os
import sys

import ml_collections
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax.config_spec import RunSpec  # noqa: E402
from offpolicy_jax.run import components  # noqa: E402
from tests.test_loop import small_config  # noqa: E402


def _holds_config(obj, seen=None) -> bool:
  """Whether `obj` (a dataclass / dict / sequence tree) holds a ConfigDict anywhere."""
  seen = set() if seen is None else seen
  if id(obj) in seen:
    return False
  seen.add(id(obj))
  if isinstance(obj, ml_collections.ConfigDict | ml_collections.FrozenConfigDict):
    return True
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return any(_holds_config(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
  if isinstance(obj, dict):
    return any(_holds_config(v, seen) for v in obj.values())
  if isinstance(obj, list | tuple):
    return any(_holds_config(v, seen) for v in obj)
  return False


def test_components_hold_no_config_and_share_compiled_parts():
  a = components.build_components(small_config(seed=1, total_steps=9))
  b = components.build_components(small_config(**{"seed": 2, "lag.sync_interval": 5}))
  assert not _holds_config(a)
  # Run fields differ: the compiled part is shared, the settings are each run's own.
  assert a.fns is b.fns
  assert (a.run.seed, a.run.total_steps, a.run.lag.sync_interval) == (1, 9, 4)
  assert (b.run.seed, b.run.total_steps, b.run.lag.sync_interval) == (2, 6, 5)
  # A field that changes what compiles gives its own compiled part.
  c = components.build_components(small_config(temperature=0.7))
  assert c.fns is not a.fns and c.fns.learner.options.temperature == 0.7


def test_warm_start_key_follows_the_fields_marked_warm_start():
  """Runs share a warm start when the fields it depends on agree (`Field.warm_start`)."""
  key = components.warm_start_key(small_config())
  for name, value in (
    ("max_prompt_len", 14),
    ("task_kwargs", {"digits": 3}),
    ("lora.rank", 4),
    ("mesh.data", 2),
    ("rollout.sampler_dtype", "bfloat16"),
  ):
    assert components.warm_start_key(small_config(**{name: value})) != key, name
  for name, value in (
    ("seed", 3),
    ("lag.sync_interval", 5),
    ("lora.dropout", 0.1),
    ("optimizer.learning_rate", 1e-3),
    ("sft.steps", 7),  # the warm start's own settings are the cache key's other parts
  ):
    assert components.warm_start_key(small_config(**{name: value})) == key, name


def test_components_are_frozen():
  comps = components.build_components(small_config())
  with pytest.raises(dataclasses.FrozenInstanceError):
    comps.run = None  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError):
    comps.fns.sizes = None  # type: ignore[misc]


def test_every_config_field_is_either_compiled_or_a_run_setting():
  """A compiled field is in the compile key, so changing it cannot reuse stale code."""
  base = small_config()
  key = components.compile_key(base)
  changed = small_config(max_new_tokens=base.max_new_tokens + 1)
  assert components.compile_key(changed) != key
  compiled = set(json.loads(key))
  assert {"mesh.data", "reward_workers", "task_kwargs", "loss.eps_low"} <= compiled
  assert not {"seed", "total_steps", "lag.sync_interval", "eval_every"} & compiled
  same = small_config(**{"seed": 7, "lag.sync_interval": 9, "eval_every": 3, "sft.steps": 1})
  assert components.compile_key(same) == key
  # The replay options are built from the replay.* settings.
  assert components.replay_options(base).policy == base.replay.policy


def test_bad_config_fails_before_anything_is_built():
  with pytest.raises(ValueError, match="config.log_every"):
    components.build_components(small_config(log_every=0))


def test_a_dropped_step_fns_is_freed_with_what_was_built_from_it():
  """Nothing module-level keeps a run's StepFns (and so its compiled programs) alive.

  A sweep or a study runs many configs in one process; each StepFns carries
  jitted programs whose executables XLA maps into memory. What is built from it
  (programs, eval batches, the continuous-batching copy) lives in `fns.memo`, a
  cycle the collector frees once the compiled-parts cache lets go of it
  (benchmarks/runs_memory.py measures the process).
  """
  import gc
  import weakref

  from offpolicy_jax.run import evaluation
  from offpolicy_jax.step import programs, run_state, sampler_choice

  components.clear_cache()
  comps = components.build_components(
    small_config(**{"rollout.continuous_slots": 4, "rollout.continuous_auto_steps": 2})
  )
  fns = comps.fns
  state = run_state.init_state(fns, fns.model.init_params(0), capacity_batches=1, snapshots=2)
  built = programs.programs(fns, comps.replay, state)
  assert programs.programs(fns, comps.replay, state) is built  # built once, shared
  assert evaluation.eval_prompts(fns, 4)
  switched = sampler_choice.continuous_fns(fns)
  assert sampler_choice.continuous_fns(fns) is switched and switched.memo == {}
  gone = weakref.ref(fns), weakref.ref(switched), weakref.ref(built.rl_steps)
  del comps, fns, state, built, switched
  components.clear_cache()
  gc.collect()
  assert [ref() for ref in gone] == [None, None, None]


def test_bfloat16_moments_reach_the_run_state():
  import jax
  import jax.numpy as jnp

  from offpolicy_jax.step import run_state

  comps = components.build_components(small_config(**{"optimizer.moment_dtype": "bfloat16"}))
  fns = comps.fns
  state = run_state.init_state(fns, fns.model.init_params(0), capacity_batches=1, snapshots=1)
  floats = [
    x for x in jax.tree.leaves(state.train.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)
  ]
  params = jax.tree.leaves(state.train.params)
  assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.bfloat16)}
  assert sum(x.size for x in floats) == 2 * sum(x.size for x in params)  # mu and nu
  with pytest.raises(ValueError, match="config.optimizer.moment_dtype"):
    components.build_components(small_config(**{"optimizer.moment_dtype": "float16"}))


def test_model_remat_reaches_preset_and_hugging_face_models(tmp_path):
  from benchmarks import gsm8k_path

  hf = str(tmp_path / "hf")
  gsm8k_path.write_checkpoint(hf, "tiny", ["12 + 7 = 19"] * 5)
  for model, tokenizer in (("tiny", ""), (hf, hf)):
    for remat in (False, True):
      config = small_config(model=model, tokenizer=tokenizer, model_remat=remat)
      built = components.build_components(config).fns.model.build(0)
      assert built.config.remat is remat, (model, remat)


def test_a_model_loaded_with_weights_skips_the_warm_start_unless_asked(tmp_path):
  preset = components._with_warm_start(RunSpec.from_config(small_config()))
  assert preset.sft.enabled  # a preset's random initialisation is warm-started
  loaded = {"model": str(tmp_path)}  # a local HF directory, e.g. an earlier run's export
  spec = components._with_warm_start(RunSpec.from_config(small_config(**loaded)))
  assert not spec.sft.enabled
  asked = small_config(**loaded, **{"sft.on_loaded_model": True})
  assert components._with_warm_start(RunSpec.from_config(asked)).sft.enabled
  off = small_config(**{"sft.enabled": False})
  assert not components._with_warm_start(RunSpec.from_config(off)).sft.enabled
