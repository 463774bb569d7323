"""The examples in functrain.optim's docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import functrain.optim

MODULES = ["functrain.optim"] + [
    f"functrain.optim.{m.name}"
    for m in pkgutil.iter_modules(functrain.optim.__path__)
    if not m.name.startswith("_")
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
