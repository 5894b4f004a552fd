"""Packages whose modules load on first use: `__getattr__, __dir__ = lazy.modules(...)`.

A binary that only reads its config, or refuses it, then does not pay for
importing JAX, orbax and the models (seconds per start).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType


def modules(
  package: str, names: Iterable[str], paths: Mapping[str, str] | None = None
) -> tuple[Callable[[str], ModuleType], Callable[[], list[str]]]:
  """`(__getattr__, __dir__)` for `package`, whose attributes `names` are modules loaded lazily.

  `paths[name]` is the module to import for `name` (default `package.name`).
  A loaded module is set on the package, so `__getattr__` runs once per name.
  """
  names, paths = frozenset(names), dict(paths or {})

  def getattr_(name: str) -> ModuleType:
    if name not in names:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module(paths.get(name, f"{package}.{name}"))
    setattr(sys.modules[package], name, module)
    return module

  def dir_() -> list[str]:
    return sorted(set(vars(sys.modules[package])) | names)

  return getattr_, dir_
