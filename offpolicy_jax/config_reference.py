"""What the schema generates: the config reference (docs/config.md) and the typed spec.

  python -m offpolicy_jax.config_reference > docs/config.md
  python -m offpolicy_jax.config_reference --spec > offpolicy_jax/config_spec.py

`tests/test_config_schema.py` checks that both files are this module's output.
"""

from __future__ import annotations

import keyword
import sys
import textwrap
from collections.abc import Iterable

from offpolicy_jax.config_fields import ROLES, Field
from offpolicy_jax.config_schema import RUN_FIELDS, STUDY_FIELDS

# The sections of the config reference (docs/config.md): (title, one line, members). A member
# is a top-level field or the first part of dotted ones ("loss" holds every loss.* field).
_SECTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
  ("Run", "The run's seed and length.", ("seed", "total_steps")),
  ("Model", "Which model, its dtype and how its forward runs ([models.md](models.md)).",
   ("model", "model_dtype", "model_scan_layers", "model_scan_decode", "model_remat",
    "model_attention", "model_router_aux_coef", "tokenizer")),
  ("Task and data", "The task, its data and the static shapes of prompts and responses.",
   ("task", "task_kwargs", "max_prompt_len", "max_new_tokens", "data")),
  ("Sampling", "The behaviour policy's decoding and the batch: G prompts of K responses a step.",
   ("temperature", "top_p", "top_k", "group_size", "prompts_per_step")),
  ("Rollout (`rollout.*`)", "How the sampler produces a step's rows and what it records "
   "([off_policyness.md](off_policyness.md), [speed.md](speed.md)).", ("rollout",)),
  ("Host rewards", "The sandboxed verifier workers that score host rewards "
   "([rewards_and_security.md](rewards_and_security.md)).",
   ("reward_timeout", "reward_batch_timeout", "reward_workers", "reward_memory_mb",
    "reward_sandbox")),
  ("Loss (`loss.*`)", "A loss preset and its overrides; an override left unset (None) keeps "
   "the preset's value ([losses.md](losses.md)).", ("loss",)),
  ("Advantage (`advantage.*`)", "The advantage estimator ([losses.md](losses.md)).",
   ("advantage",)),
  ("Critic (`critic.*`)", "A value head on the policy's trunk and the token advantages it "
   "makes ([losses.md](losses.md#critics)).", ("critic",)),
  ("Policy lag (`lag.*`)", "The schedule of the parameter versions that sample "
   "([science.md](science.md) s5, [lag_and_study.md](lag_and_study.md)).", ("lag",)),
  ("Replay (`replay.*`)", "The buffer of sampled groups a step trains on.", ("replay",)),
  ("Train step (`train.*`)", "Optimizer steps per sampled batch and how each runs.",
   ("train",)),
  ("Optimizer (`optimizer.*`)", "AdamW and its schedule.", ("optimizer",)),
  ("LoRA (`lora.*`)", "Low-rank adapters ([lora.md](lora.md)).", ("lora",)),
  ("Multi-turn (`multiturn.*`)", "Multi-turn episodes ([multiturn.md](multiturn.md)).",
   ("multiturn",)),
  ("Mesh (`mesh.*`)", "Device meshes ([scaling_out.md](scaling_out.md)).", ("mesh",)),
  ("Warm start (`sft.*`)", "The supervised warm start before RL.", ("sft",)),
  ("Evaluation", "Held-out evaluation during the run.",
   ("eval_every", "eval_prompts", "eval_samples", "eval_ope")),
  ("Checkpoints and logging", "What the run writes, and how often.",
   ("checkpoint_every", "log_every", "profile_steps", "keep_checkpoints", "async_checkpoint",
    "tensorboard", "wandb_project", "progress")),
  ("Study (`study.*`)", "A study config's own fields (`configs/lag_study.py`; "
   "[lag_and_study.md](lag_and_study.md)).", ("study",)),
)  # fmt: skip

_INTRO = """\
# Config reference

<!-- Generated from offpolicy_jax/config_schema.py; do not edit. Regenerate with:
python -m offpolicy_jax.config_reference > docs/config.md -->

Every field of a run's config, declared once in `offpolicy_jax/config_schema.py`
with its default, role, check and doc. The defaults are the main job's
(`configs/default.py`); the other configs under `configs/` start from them.
Set a field on the command line, `--config.<name>=<value>`:

    python -m experiments.train --config=configs/default.py --workdir=DIR \\
      --config.lag.sync_interval=8 --config.loss.name=grpo

or in a config file under `configs/`, whose `get_config()` returns the config
(`c.lag.sync_interval = 8`). The config is locked: a misspelt name is an
error. Every value is checked at start-up, before anything compiles, and a
bad one fails naming the field: "Accepts" below is the check of the value
alone; checks against registries (loss, advantage, task and model names),
files and other fields run there too. In code, the same fields are frozen,
typed records: `offpolicy_jax.config_spec.RunSpec.from_config(config)`
(`spec.lag.sync_interval`), generated from the same declarations.

## Roles

A field's role says what changing it changes:

| Role | Compiled | Kept on resume | Study cell | Changing it |
|---|---|---|---|---|
"""

_ROLES_NOTES = """
- compiled: the cached compiled part of a run is built from it.
- kept on resume: resuming a run (the same `--workdir`) with a changed value
  is refused unless `--allow_config_change` is given (the change is then
  recorded in the workdir); the fields the checkpointed parameters' shapes
  follow (`model`, `lora.rank`, `lora.targets`) cannot change even then.
- study cell: a finished study cell depends on it, so a study that changes it
  is not resumed.
"""


def _cell(text: str) -> str:
  """`text` for a markdown table cell: pipes escaped, no `<name>` read as an HTML tag."""
  text = text.replace("|", "\\|")
  return "".join(
    "&lt;" if c == "<" and text[i + 1 : i + 2].isalpha() else c for i, c in enumerate(text)
  )


def _row(f: Field) -> str:
  accepts = f.check.describe() if f.check is not None else "checked at start-up"
  default = _cell(f"`{f.default!r}`")
  return f"| `{f.name}` | {default} | {f.role.name} | {_cell(accepts)} | {_cell(f.doc)} |"


def reference_sections(
  fields: Iterable[Field] = (*RUN_FIELDS, *STUDY_FIELDS),
) -> list[tuple[str, str, list[Field]]]:
  """The config reference's sections, `(title, one line, fields)`, in declaration order.

  Raises:
    ValueError: a field that no section holds (add it to `_SECTIONS`).
  """
  fields = list(fields)
  out = [
    (title, line, [f for f in fields if f.name.split(".")[0] in members])
    for title, line, members in _SECTIONS
  ]
  placed = {f.name for _, _, held in out for f in held}
  missing = [f.name for f in fields if f.name not in placed]
  if missing:
    raise ValueError(f"fields in no section of the config reference (_SECTIONS): {missing}")
  return out


def reference_markdown() -> str:
  """The config reference (docs/config.md): the roles, then every field by section."""
  yes = {True: "yes", False: "no"}
  lines = [_INTRO.rstrip("\n")]
  for r in ROLES:
    lines.append(f"| {r.name} | {yes[r.compiled]} | {yes[r.kept]} | {yes[r.cell]} | {r.doc} |")
  lines.append(_ROLES_NOTES)
  for title, line, fields in reference_sections():
    lines += [f"## {title}", "", line, "", "| Field | Default | Role | Accepts | Description |"]
    lines += ["|---|---|---|---|---|", *map(_row, fields), ""]
  return "\n".join(lines)


# ----------------------------------------------------------------- the typed spec

_SPEC_HEAD = '''\
# size: declaration table: one typed attribute per config field, generated from config_schema.
# Generated from offpolicy_jax/config_schema.py; do not edit. Regenerate with:
# python -m offpolicy_jax.config_reference --spec > offpolicy_jax/config_spec.py
"""The config as frozen, typed records: `RunSpec.from_config(config)`, `StudySpec`.

One attribute per declared field at its dotted path (`spec.lag.sync_interval`),
typed from its default, with the field's doc above it. A reader that takes a
spec instead of the ConfigDict has every name it reads checked by mypy, and
cannot change the run's config. `task_kwargs` is a read-only mapping
(`FrozenMapping`: it hashes and pickles, so a spec does too).
Values are taken as the config holds them: `config_schema.check` (and
`run.validation.validate_config`) check them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from offpolicy_jax.config_fields import FrozenMapping, build_record

__all__ = ["FrozenMapping", "RunSpec", "StudySpec"]
'''


def _type_name(f: Field) -> str:
  if isinstance(f.default, dict):
    return "Mapping[str, Any]"
  if f.default is None:
    return f"{f.value_type.__name__ if f.value_type else 'Any'} | None"
  return type(f.default).__name__


def _class_name(block: str) -> str:
  return "".join(part.capitalize() for part in block.split("_")) + "Spec"


def _spec_class(
  name: str, doc: str, fields: list[tuple[str, Field]], blocks: list[str]
) -> list[str]:
  lines = ["", "", "@dataclasses.dataclass(frozen=True)", f"class {name}:", f'  """{doc}"""']
  for attr, f in fields:
    if keyword.iskeyword(attr):
      raise ValueError(f"config field {f.name!r}: {attr!r} is a Python keyword")
    lines.append("")
    lines += textwrap.wrap(f.doc, 96, initial_indent="  #: ", subsequent_indent="  #: ")
    lines.append(f"  {attr}: {_type_name(f)}")
  for block in blocks:
    lines += ["", f"  {block}: {_class_name(block)}"]
  return lines


def spec_module() -> str:
  """The source of `offpolicy_jax/config_spec.py`: one frozen dataclass per config block."""
  out = _SPEC_HEAD.rstrip("\n").split("\n")
  top: dict[str, list[tuple[str, Field]]] = {"": [], "study": []}
  nested: dict[str, list[tuple[str, Field]]] = {}
  for f in (*RUN_FIELDS, *STUDY_FIELDS):
    *parents, leaf = f.name.split(".")
    if len(parents) > 1:
      raise ValueError(f"config field {f.name!r}: the spec holds blocks one level deep")
    if f.name.startswith("study."):
      top["study"].append((leaf, f))
    else:
      nested.setdefault(parents[0], []).append((leaf, f)) if parents else top[""].append((leaf, f))
  for block, fields in nested.items():
    out += _spec_class(_class_name(block), f"`config.{block}.*`.", fields, [])
  out += _spec_class(
    "RunSpec", "A run's config (`config_schema.RUN_FIELDS`).", top[""], list(nested)
  )
  out += [
    "",
    "  @classmethod",
    "  def from_config(cls, config: Any) -> RunSpec:",
    '    """The spec of a run config (a ConfigDict or nested dict with every declared field)."""',
    "    return build_record(cls, config, _BLOCKS)",
  ]
  out += _spec_class(
    "StudySpec", "A study's own fields, `config.study.*` (`STUDY_FIELDS`).", top["study"], []
  )
  out += [
    "",
    "  @classmethod",
    "  def from_config(cls, config: Any) -> StudySpec:",
    '    """The spec of the `study` block of a study config."""',
    '    study = config.study if hasattr(config, "study") else config["study"]',
    "    return build_record(cls, study, _BLOCKS)",
    "",
    "",
    "# (class, attribute) -> the record of a nested block.",
    "_BLOCKS: dict[tuple[str, str], Any] = {",
    *(f'  ("RunSpec", "{b}"): {_class_name(b)},' for b in nested),
    "}",
  ]
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  print(spec_module() if "--spec" in sys.argv[1:] else reference_markdown(), end="")
