"""Errors the person running a command caused and can fix.

The binaries (`offpolicy_jax.cli`) print a `UserError` as one line,

  error: config.total_steps: must be an int >= 1, got -5

and exit non-zero without a traceback (`--verbose`, or `OFFPOLICY_JAX_VERBOSE=1`,
shows it). Anything else is a bug and keeps its traceback.

`UserError` subclasses keep the builtin type the library raised before
(`ConfigError` is a `ValueError`), so callers that catch those still do.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterable, Iterator


class UserError(Exception):
  """A problem in what the user asked for: a field, a value, a name, a file, a workdir.

  Attributes:
    hint: what to do about it, printed in parentheses after the message.
  """

  def __init__(self, message: str, hint: str | None = None):
    super().__init__(message)
    self.hint = hint

  def line(self) -> str:
    """The one line the binaries print (without the `error: ` prefix)."""
    text = " ".join(str(self).split())  # one line, whatever the message held
    return f"{text} ({self.hint})" if self.hint else text


class ConfigError(UserError, ValueError):
  """A config field's value, a name it gives, or a file or directory it points to is wrong."""


def need(ok: bool, field: str, msg: str) -> None:
  """Raises `ConfigError("config.<field>: <msg>")` unless `ok`: a config check's one line."""
  if not ok:
    raise ConfigError(f"config.{field}: {msg}")


class WorkdirError(UserError, ValueError):
  """A workdir is missing, empty, unwritable, or holds another run or no checkpoint asked for."""


@contextlib.contextmanager
def as_user_error(hint: str | None = None) -> Iterator[None]:
  """Re-raises the `ValueError`s and `OSError`s of a start-up check as `ConfigError`s.

  For checks of user input (configs, data files, model directories) that
  raise builtin errors: their messages already name the field, file or row.
  """
  try:
    yield
  except UserError:
    raise
  except (ValueError, OSError) as e:
    raise ConfigError(str(e), hint) from e


@contextlib.contextmanager
def about(what: str) -> Iterator[None]:
  """Re-raises a `ValueError` as a `ConfigError` whose message starts with `what: `.

  For a caller that knows which part of a larger input the error belongs to
  (`"sweep run lr3"`, `"config.study.methods: wide"`); a `UserError`'s hint,
  such as a suggested name, is kept.
  """
  try:
    yield
  except ValueError as e:
    raise ConfigError(f"{what}: {e}", getattr(e, "hint", None)) from e


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
  """`did you mean 'x'?` for the choice nearest to a misspelt `word`, or None when none is near.

  Near: difflib's similarity ratio at least 0.6 (`difflib.get_close_matches`).
  """
  found = difflib.get_close_matches(word, list(choices), n=1)
  return f"did you mean {found[0]!r}?" if found else None


class Interrupted(Exception):
  """A run stopped early on a signal, after saving: the same command resumes it.

  Attributes:
    exit_code: the status the binaries exit with (128 + the signal's number).
  """

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code
