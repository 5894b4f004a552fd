"""What one config field is: its role, its check of the value alone, its record (`Field`).

A role says what changing the field changes (`config_schema`'s docstring). A
check is `check(value) -> complaint` ("must be ..., got ...") or None, and its
`describe()` says what it accepts, for the config reference. `config_schema`
declares every field with these; `run.validation` runs the checks first,
before the checks against registries, files and other fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np


class Role(NamedTuple):
  """What changing a field changes (module docstring)."""

  name: str
  compiled: bool
  kept: bool
  cell: bool
  doc: str


PROGRAM = Role("program", True, True, True, "changes the compiled programs")
NUMBERS = Role("numbers", False, True, True, "changes a run's numbers, not what compiles")
CONTROL = Role(
  "control", False, False, True, "run control a study cell records; may change on resume"
)
PLACEMENT = Role(
  "placement", True, False, False, "where and how the compiled part runs; may change on resume"
)
NO_CELL_EFFECT = Role(
  "no_cell_effect", False, False, False, "no effect on a study cell; may change on resume"
)
ROLES = (PROGRAM, NUMBERS, CONTROL, PLACEMENT, NO_CELL_EFFECT)


def _is_int(v: Any) -> bool:
  return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
  return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


class Int(NamedTuple):
  """An int >= lo (and < hi), or one of `also`; `note` is appended to the complaint."""

  lo: int
  hi: int | None = None
  note: str = ""
  also: tuple[int, ...] = ()

  def describe(self) -> str:
    """What it accepts, in the words of its complaint."""
    want = f">= {self.lo}" if self.hi is None else f"in [{self.lo}, {self.hi})"
    return f"an int {want}{self.note}"

  def __call__(self, v: Any) -> str | None:
    ok = _is_int(v) and (v in self.also or (v >= self.lo and (self.hi is None or v < self.hi)))
    return None if ok else f"must be {self.describe()}, got {v!r}"


class Float(NamedTuple):
  """A finite number between lo and hi (open or closed ends), or one of `also`.

  `none_ok`: None (a placeholder left unset) passes. `unit` names what it counts.
  """

  lo: float
  hi: float = math.inf
  lo_open: bool = False
  hi_open: bool = False
  note: str = ""
  unit: str = ""
  also: tuple[float, ...] = ()
  none_ok: bool = False

  def _number(self) -> str:
    if self.hi == math.inf and self.lo == -math.inf:
      want = ""
    elif self.hi == math.inf:
      want = f" {'>' if self.lo_open else '>='} {self.lo}"
    else:
      want = f" in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
    unit = f" of {self.unit}" if self.unit else ""
    return f"a finite number{unit}{want}{self.note}"

  def describe(self) -> str:
    """What it accepts, in the words of its complaint (and None with `none_ok`)."""
    return self._number() + (", or None (unset)" if self.none_ok else "")

  def __call__(self, v: Any) -> str | None:
    if v is None and self.none_ok:
      return None
    ok = _is_num(v) and math.isfinite(v)
    inside = ok and (v > self.lo if self.lo_open else v >= self.lo)
    inside = inside and (v < self.hi if self.hi_open else v <= self.hi)
    if ok and (inside or v in self.also):
      return None
    return f"must be {self._number()}, got {v!r}"


class Choice(NamedTuple):
  """One of a fixed set of values."""

  choices: tuple[Any, ...]

  def describe(self) -> str:
    """What it accepts, in the words of its complaint."""
    return f"one of {', '.join(map(repr, self.choices))}"

  def __call__(self, v: Any) -> str | None:
    if v in self.choices:
      return None
    return f"must be {self.describe()}, got {v!r}"


class Bool(NamedTuple):
  """True or False (None too with `none_ok`)."""

  none_ok: bool = False

  def describe(self) -> str:
    """What it accepts, in the words of its complaint."""
    return "True or False" + (", or None (unset)" if self.none_ok else "")

  def __call__(self, v: Any) -> str | None:
    if isinstance(v, bool | np.bool_) or (v is None and self.none_ok):
      return None
    return f"must be {self.describe()}, got {v!r}"


class Str(NamedTuple):
  """A string (None too with `none_ok`)."""

  none_ok: bool = False

  def describe(self) -> str:
    """What it accepts."""
    return "a string" + (", or None (unset)" if self.none_ok else "")

  def __call__(self, v: Any) -> str | None:
    if isinstance(v, str) or (v is None and self.none_ok):
      return None
    return f"must be a string, got {v!r}"


class Check(Protocol):
  """`check(value) -> complaint` ("must be ..., got ...") or None when the value is fine.

  `describe()` says what it accepts ("an int >= 1"), for the config reference.
  """

  def __call__(self, v: Any, /) -> str | None: ...

  def describe(self) -> str: ...


class Field(NamedTuple):
  """One config field.

  Attributes:
    name: dotted path in the config, e.g. "lag.sync_interval".
    default: its value in `configs/default.py` (the main job); a dict is a
      ConfigDict of free keys (task_kwargs); None is a placeholder of `value_type`.
    role: what changing it changes (module docstring).
    doc: its one comment.
    check: `value -> complaint or None`, for checks that need nothing but the value.
    value_type: the type a None default accepts from the command line.
    warm_start: the supervised warm start depends on it (`StepFns.model.key`:
      runs that agree on these fields share a warm start of the same seed).
  """

  name: str
  default: Any
  role: Role
  doc: str
  check: Check | None = None
  value_type: type | None = None
  warm_start: bool = False


class Names(NamedTuple):
  """A comma-separated list of distinct words from `choices` (non-empty unless `empty_ok`)."""

  choices: tuple[str, ...]
  empty_ok: bool = False

  def describe(self) -> str:
    """What it accepts, in the words of its complaint."""
    none = ' ("" = none)' if self.empty_ok else ""
    return f"comma-separated names from {', '.join(self.choices)}{none}"

  def __call__(self, v: Any) -> str | None:
    if self.empty_ok and isinstance(v, str) and not v.strip():
      return None
    words = [w.strip() for w in v.split(",")] if isinstance(v, str) else None
    if words and all(w in self.choices for w in words) and len(set(words)) == len(words):
      return None
    return f"must be {self.describe()}, got {v!r}"


# ----------------------------------------------------------------- the typed records


class FrozenMapping(Mapping[str, Any]):
  """A read-only mapping of free keys (`task_kwargs`) that hashes and pickles.

  (`types.MappingProxyType` is read-only too, but neither hashes nor pickles,
  so a record holding one could not go to a worker process.)
  """

  def __init__(self, items: Mapping[str, Any]):
    self._items = dict(items)

  def __getitem__(self, key: str) -> Any:
    return self._items[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._items)

  def __len__(self) -> int:
    return len(self._items)

  def __hash__(self) -> int:
    return hash(json.dumps(self._items, sort_keys=True, default=str))

  def __repr__(self) -> str:
    return f"FrozenMapping({self._items!r})"


def build_record(cls: Any, node: Any, blocks: Mapping[tuple[str, str], Any]) -> Any:
  """The frozen dataclass `cls` (of `config_spec`) from a config node (ConfigDict or dict).

  `blocks[(class name, attribute)]` is the record of a nested block, built
  recursively; a mapping value (free keys) becomes a `FrozenMapping`.
  """
  values: dict[str, Any] = {}
  for f in dataclasses.fields(cls):
    value = node[f.name]
    block = blocks.get((cls.__name__, f.name))
    if block is not None:
      value = build_record(block, value, blocks)
    elif isinstance(value, Mapping) or hasattr(value, "to_dict"):
      value = FrozenMapping(value.to_dict() if hasattr(value, "to_dict") else value)
    values[f.name] = value
  return cls(**values)
