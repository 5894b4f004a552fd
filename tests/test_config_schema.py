"""Tests for offpolicy_jax.config_schema: one declaration per field, read by every reader."""

import copy
import os
import pickle
import sys

import ml_collections
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import code, default, gsm8k_qwen25_1p5b, lag_study  # noqa: E402
from offpolicy_jax import config_fields as fields  # noqa: E402
from offpolicy_jax import config_reference  # noqa: E402
from offpolicy_jax import config_schema as schema  # noqa: E402

ALL = (*schema.RUN_FIELDS, *schema.STUDY_FIELDS)


def _leaves(c, prefix=""):
  for k, v in c.items():
    if isinstance(v, ml_collections.ConfigDict) and len(v) and k != "task_kwargs":
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}"


def test_every_field_is_declared_once_with_a_role_and_a_doc():
  names = [f.name for f in ALL]
  assert len(names) == len(set(names))
  for f in ALL:
    assert f.role in fields.ROLES, f.name
    assert f.doc.strip().endswith("."), f.name


@pytest.mark.parametrize("f", ALL, ids=lambda f: f.name)
def test_every_default_passes_its_own_check(f):
  assert f.check is None or f.check(f.default) is None


@pytest.mark.parametrize(
  "module,args", [(default, ()), (code, ()), (gsm8k_qwen25_1p5b, ()), (lag_study, ("toy",))]
)
def test_shipped_configs_hold_exactly_the_declared_fields(module, args):
  config = module.get_config(*args)
  declared = {f.name for f in schema.RUN_FIELDS}
  if "study" in config:
    declared |= {f.name for f in schema.STUDY_FIELDS}
  assert set(_leaves(config)) == declared
  schema.check(config, ALL if "study" in config else schema.RUN_FIELDS)


def test_config_dict_is_the_command_line_surface():
  c = default.get_config()
  with pytest.raises(AttributeError):
    c.lag.no_such_field = 1
  c.unlock()
  c.loss.eps_low = 0.2  # a placeholder takes its declared type
  with pytest.raises(TypeError):
    c.lag.sync_interval = "four"
  assert default.base_config().to_dict() == schema.config_dict().to_dict()


def test_roles_of_nested_and_undeclared_fields():
  assert schema.role_of("task_kwargs.train_path") is fields.PROGRAM
  assert schema.role_of("lag.sync_interval") is fields.NUMBERS
  assert schema.role_of("mesh.data") is fields.PLACEMENT
  assert schema.role_of("study.vmap_seeds") is fields.NO_CELL_EFFECT
  assert schema.role_of("no_such_field") is fields.PROGRAM  # unknown: taken to change everything


def test_check_names_the_field():
  c = schema.config_dict()
  c.lag.sync_interval = 0
  with pytest.raises(ValueError, match=r"^config.lag.sync_interval: must be an int >= 1, got 0"):
    schema.check(c)
  assert fields.Float(0, lo_open=True, unit="seconds")(0.0) == (
    "must be a finite number of seconds > 0, got 0.0"
  )
  assert fields.Int(1, note=" or -1", also=(-1,))(-1) is None
  assert fields.Int(0)(True) is not None  # a bool is not an int


def test_docs_config_md_is_the_generated_reference():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "docs", "config.md")) as f:
    written = f.read()
  assert written == config_reference.reference_markdown(), (
    "docs/config.md differs from config_reference.reference_markdown(); regenerate it with "
    "`python -m offpolicy_jax.config_reference > docs/config.md`"
  )


def test_reference_lists_every_field_once_with_what_it_accepts():
  rows = [r for r in config_reference.reference_markdown().splitlines() if r.startswith("| `")]
  assert sorted(r.split("`")[1] for r in rows) == sorted(f.name for f in ALL)
  row = next(r for r in rows if r.startswith("| `lag.sync_interval` "))
  assert row.startswith("| `lag.sync_interval` | `4` | numbers | an int >= 1 | m: parameters")
  stray = fields.Field("no_section", 0, fields.NUMBERS, "A field no section holds.")
  with pytest.raises(ValueError, match="no_section"):
    config_reference.reference_sections((*ALL, stray))


def test_describe_is_what_the_complaint_says():
  for check, bad in [
    (fields.Int(1, note=" or -1", also=(-1,)), 0),
    (fields.Float(0, 1, lo_open=True, unit="seconds"), 0.0),
    (fields.Choice(("sync", "async")), "nope"),
    (fields.Bool(), 1),
    (fields.Str(), 1),
    (fields.Names(("q_proj", "k_proj")), "x"),
  ]:
    assert check(bad) == f"must be {check.describe()}, got {bad!r}"
  assert fields.Float(0, none_ok=True).describe() == "a finite number >= 0, or None (unset)"


def test_config_spec_is_the_generated_module():
  from offpolicy_jax import config_spec

  with open(config_spec.__file__) as f:
    written = f.read()
  assert written == config_reference.spec_module(), (
    "offpolicy_jax/config_spec.py differs from config_reference.spec_module(); regenerate it "
    "with `python -m offpolicy_jax.config_reference --spec > offpolicy_jax/config_spec.py`"
  )


@pytest.mark.parametrize("make", [default.get_config, code.get_config, lag_study.get_config])
def test_run_spec_holds_every_field_of_a_config_at_its_dotted_path(make):
  import dataclasses

  from offpolicy_jax import config_spec

  config = make()
  spec = config_spec.RunSpec.from_config(config)
  for f in schema.RUN_FIELDS:
    got = spec
    for part in f.name.split("."):
      got = getattr(got, part)
    want = schema.get(config, f.name)
    assert (dict(got) if f.name == "task_kwargs" else got) == (
      want.to_dict() if f.name == "task_kwargs" else want
    ), f.name
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.lag.sync_interval = 2  # type: ignore[misc]
  with pytest.raises(TypeError):
    spec.task_kwargs["x"] = 1  # type: ignore[index]
  # A record: it hashes, pickles and copies (a worker process can receive it).
  assert pickle.loads(pickle.dumps(spec)) == spec and hash(copy.deepcopy(spec)) == hash(spec)
  if "study" in config:
    study = config_spec.StudySpec.from_config(config)
    assert study.seeds == config.study.seeds and study.methods == config.study.methods
    assert study.equivalence_margin == config.study.equivalence_margin
