"""How the binaries start and fail: `cli.run(main)` in place of `absl.app.run(main)`.

A problem the user caused (a `errors.UserError`, or a flag or config
override that does not parse) ends the command with one line on stderr,

  error: --config.totl_steps: no such config field (did you mean --config.total_steps?)

and exit status 1, no traceback; `--verbose` (or `OFFPOLICY_JAX_VERBOSE=1`)
re-raises it with its traceback. Every other exception is a bug and keeps its
traceback.

`config_help()` is the help of the binaries' `--config` flag, so `--help`
names docs/config.md and lists the most used fields (`HELP_FIELDS`) with their
docs from `config_schema`; an error about a config field points there too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags

from offpolicy_jax import errors

VERBOSE_ENV = "OFFPOLICY_JAX_VERBOSE"
USAGE_EXIT = 1  # as absl's own flag errors; a crash exits 1 too, with its traceback

CONFIG_DOC_HINT = "docs/config.md describes every field"
# The fields `--help` shows, with their docs from the schema: what most commands set.
HELP_FIELDS = (
  "model",
  "task",
  "total_steps",
  "seed",
  "loss.name",
  "advantage.name",
  "lag.sync_interval",
  "lag.sync_offset",
  "group_size",
  "prompts_per_step",
  "optimizer.learning_rate",
  "eval_every",
  "checkpoint_every",
)

_VERBOSE = flags.DEFINE_bool(
  "verbose", False, f"Show tracebacks of usage errors (also: {VERBOSE_ENV}=1)."
)


def config_help(what: str = "Config file", fields: Sequence[str] = HELP_FIELDS) -> str:
  """The help of a `--config` flag: how to set a field, where all are described, a few of them.

  Args:
    what: what the file is, e.g. "Config file with get_sweep()".
    fields: dotted names of `config_schema` fields to list, each with the
      first clause of its doc.
  """
  from offpolicy_jax import config_schema

  lines = [
    f"{what}: a .py whose get_config() returns the config (FILE.py:ARG passes ARG to it). "
    "Set a field with --config.FIELD=VALUE; docs/config.md describes every field. Some:"
  ]
  for name in fields:
    field = config_schema.field(name)
    assert field is not None and field.name == name, name
    lines.append(f"--config.{name}: {_first_clause(field.doc)}.")
  return "\n".join(lines)


def _first_clause(doc: str) -> str:
  """`doc` up to its first `. ` or `; ` outside parentheses (an `e.g. ` does not end it)."""
  depth = 0
  for i, char in enumerate(doc):
    depth += (char == "(") - (char == ")")
    if depth == 0 and doc[i : i + 2] in (". ", "; ") and not doc[:i].endswith(("e.g", "i.e")):
      return doc[:i]
  return doc.rstrip(".")


def verbose(argv: Sequence[str] = ()) -> bool:
  """Whether usage errors keep their traceback (the flag may not have parsed yet)."""
  if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
    return True
  return ("--verbose" in argv) or (flags.FLAGS.is_parsed() and _VERBOSE.value)


def _override_error(argv: Sequence[str], e: Exception) -> errors.UserError:
  """A readable error for a `--config.<path>=<value>` that ml_collections refused."""
  text = str(e).replace("\\n", "\n").replace("\\'", "'")
  unknown = re.search(r"'([^'\s]+)'", text)
  better = re.search(r'Did you mean "([^"]+)"', text)
  if isinstance(e, KeyError | AttributeError) and unknown:
    key = unknown.group(1)
    for arg in argv:
      name = arg.split("=", 1)[0]
      parts = name.split(".")
      if name.startswith("--") and key in parts[1:]:  # the leaf, or a parent of it
        hint = None
        if better:
          parts[parts.index(key, 1)] = better.group(1)
          hint = f"did you mean {'.'.join(parts)}? {CONFIG_DOC_HINT}"
        return errors.UserError(f"{name}: no such config field", hint or CONFIG_DOC_HINT)
  if isinstance(e, SyntaxError):
    return errors.UserError(f"--config: {e.filename}, line {e.lineno}: {e.msg}")
  lines = [ln for ln in text.splitlines() if ln.strip()]
  what = f"{type(e).__name__}: {lines[0] if lines else ''}"
  files = [
    a for a in argv if a.startswith("--") and "=" in a and a.split("=", 1)[1].endswith(".py")
  ]
  if files:  # not an override: the config file itself failed to run
    flag = files[0].split(":", 1)[0] if files[0].count(":") else files[0]
    if "has no attribute 'get_config'" in what:
      return errors.UserError(f"{flag}: the file has no get_config()", "see configs/default.py")
    return errors.UserError(f"{flag}: the config file raised {what}", _CONFIG_HINT)
  return errors.UserError(f"flags: {what}", "--helpfull lists the flags")


_CONFIG_HINT = "--verbose shows where in the file"


def _flag_error(e: Exception) -> errors.UserError:
  """absl's flag error; a config file's traceback inside it is cut to its last line."""
  text = str(e)
  if "Traceback (most recent call last)" in text:
    head = text.split(":", 1)[0]  # "flag --config=FILE"
    last = [ln.strip() for ln in text.splitlines() if ln.strip()][-1]
    return errors.UserError(
      f"{head.removeprefix('flag ')}: the config file raised {last}", _CONFIG_HINT
    )
  if text.startswith("flag --config."):  # a field's value: the fields are not absl flags
    return errors.UserError(text, CONFIG_DOC_HINT)
  return errors.UserError(text, "--helpfull lists the flags")


def _installed_configs(argv: list[str]) -> list[str]:
  """`argv` with `--config=configs/<file>.py` read from the installed `configs` package.

  Only when that path does not exist from here: the binaries and the configs
  they name install with the package (setup.py), so the README's commands also
  work from outside the repository.
  """
  spec = importlib.util.find_spec("configs")
  if spec is None or not spec.submodule_search_locations:
    return argv
  root = os.path.dirname(next(iter(spec.submodule_search_locations)))
  out = []
  for arg in argv:
    name, sep, value = arg.partition("=")
    path = value.split(":", 1)[0]
    if sep and name == "--config" and path.startswith("configs/") and not os.path.exists(path):
      if os.path.exists(os.path.join(root, path)):
        arg = f"{name}={os.path.join(root, value)}"
    out.append(arg)
  return out


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with every failure turned into a `UserError`."""
  argv = _installed_configs(argv)
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    raise _flag_error(e) from e
  except Exception as e:  # config_flags: a field override that does not apply
    raise _override_error(argv, e) from e
  _load_config_files()
  return rest


def _load_config_files() -> None:
  """Loads every config-file flag now: config_flags defers a file's failure to first use."""
  for name in list(flags.FLAGS):
    flag = flags.FLAGS[name]
    if "." in name or not type(flag).__module__.startswith("ml_collections.config_flags"):
      continue  # not a config file flag (overrides are flags named --config.<field>)
    if flag.value is None:
      continue
    try:
      flag.value.keys()
    except Exception as e:  # a missing file, or one that does not run
      last = [ln.strip() for ln in str(e).splitlines() if ln.strip()][-1]
      raise errors.UserError(
        f"--{name}: cannot load the config file: {last}", "give the path of a config .py file"
      ) from e


def early_checks(config: Any = None, *, workdir: str | None = None, study: bool = False) -> None:
  """The checks of a run (or, with `study`, a study) config and a new workdir that need no JAX.

  A binary calls this before it imports JAX: a field out of range or a workdir
  that is a file then ends the command at once, not after the seconds JAX,
  orbax and the models take to import. The full validation
  (`run.validation.validate_config`) still runs after.
  """
  from offpolicy_jax import config_schema
  from offpolicy_jax.store import workdir as workdir_lib

  if config is not None:
    with errors.as_user_error():
      config_schema.check(config)
      if study:
        config_schema.check(config, config_schema.STUDY_FIELDS)
  if workdir is not None:
    workdir_lib.refuse_file(workdir, "give a directory")


def run(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
  """`absl.app.run(main)`, printing a `UserError` as one line (see the module doc)."""
  argv = list(sys.argv if argv is None else argv)
  try:
    app.run(main, argv=argv, flags_parser=parse_flags)
  except errors.UserError as e:
    if verbose(argv):
      raise
    print(f"error: {e.line()}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT)
  except errors.Interrupted as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
