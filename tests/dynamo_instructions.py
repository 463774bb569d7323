"""Counting the bytecode instructions dynamo interprets to trace a function (deterministic, unlike
trace time on a shared machine): what the warm-start tests bound per param or leaf (issue 33)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo import symbolic_convert


def instructions_traced(fn: Callable[..., Any], *args: Any) -> int:
    """Instructions dynamo interprets to trace ``fn(*args)`` as one graph (the eager backend)."""
    count = [0]
    original = symbolic_convert.InstructionTranslatorBase.step

    def counting(self):  # type: ignore[no-untyped-def]
        count[0] += 1
        return original(self)

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(symbolic_convert.InstructionTranslatorBase, "step", counting)
        torch.compile(fn, backend="eager", fullgraph=True)(*args)
    return count[0]
