"""The examples in these modules' docstrings run and print what they say (the optimizers' have their own
test, which finds every module of functrain.optim: test_optim_doctests.py)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "functrain.callbacks.monitors",
    "functrain.callbacks.nonfinite",
    "functrain.callbacks.preemption",
    "functrain.callbacks.progress",
    "functrain.checkpoint.onto",
    "functrain.checkpoint.sharded",
    "functrain.checkpoint.structure",
    "functrain.compile.attention_paths",
    "functrain.compile.cache",
    "functrain.compile.cache_hits",
    "functrain.compile.header_cache",
    "functrain.compile.quiet_logging",
    "functrain.compile.rnn",
    "functrain.compile.tiers",
    "functrain.compile.traceable",
    "functrain.core.member_axis",
    "functrain.data.loader",
    "functrain.data.stream_state",
    "functrain.distributed.gradients",
    "functrain.distributed.reduce",
    "functrain.distributed.replicate",
    "functrain.ensemble.stacked",
    "functrain.ensemble.steps",
    "functrain.jit",
    "functrain.loop",
    "functrain.loop.evaluate",
    "functrain.loop.fit",
    "functrain.loop.run",
    "functrain.remat",
    "functrain.state",
    "functrain.step",
    "functrain.step.base",
    "functrain.step.batch",
    "functrain.step.bind",
    "functrain.step.evaluate",
    "functrain.step.per_example",
    "functrain.step.sam",
    "functrain.step.train",
    "functrain.trainer.core",
    "functrain.trainer.tasks",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
