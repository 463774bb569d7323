"""Lazy package attributes (PEP 562): a package's public names are imported on first use.

``import functrain`` and ``functrain --help`` then load no torch; ``functrain.fit`` loads what it needs.

Example:
    >>> install("functrain", {"fit": "functrain.loop"}, submodules=("optim",))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["install"]


class _LazyPackage(types.ModuleType):
    _lazy_names: dict[str, str]
    _lazy_submodules: frozenset[str]

    def __getattr__(self, name: str) -> Any:
        if name in self._lazy_submodules:
            return importlib.import_module(f"{self.__name__}.{name}")  # the import sets the attribute
        module_name = self._lazy_names.get(name)
        if module_name is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        super().__setattr__(name, value)  # later lookups skip __getattr__
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # Importing a sub-module sets it as an attribute of its package; where the public name is a
        # function of that module (functrain.jit, the function, in functrain/jit.py), keep the function.
        if isinstance(value, types.ModuleType) and name in self._lazy_names:
            if name not in vars(self):
                self.__getattr__(name)
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._lazy_names) | self._lazy_submodules)


def install(package: str, names: dict[str, str], submodules: tuple[str, ...] = ()) -> None:
    """Make ``package``'s public names lazy: ``names`` maps a name to the module defining it,
    ``submodules`` are sub-modules exported under their own name."""
    module = sys.modules[package]
    module.__class__ = _LazyPackage
    object.__setattr__(module, "_lazy_names", dict(names))
    object.__setattr__(module, "_lazy_submodules", frozenset(submodules))
