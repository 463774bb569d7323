"""The examples in functrain.step's docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "functrain.step",
    "functrain.step.base",
    "functrain.step.batch",
    "functrain.step.bind",
    "functrain.step.evaluate",
    "functrain.step.per_example",
    "functrain.step.sam",
    "functrain.step.train",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
