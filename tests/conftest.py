"""Test-wide settings: one intra-op thread (tiny tensors run several times faster on 2 shared cores)."""

from __future__ import annotations

import builtins
from collections.abc import Callable

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def hide_import(monkeypatch) -> Callable[[str], None]:
    """``hide_import("pkg")``: for the rest of the test, importing ``pkg`` or a submodule raises ImportError,
    as if it were not installed (even where it is imported already)."""
    hidden: list[str] = []
    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):
        if any(name == h or name.startswith(h + ".") for h in hidden):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)
    return hidden.append


class RecordingInductor:
    """A ``torch.compile`` backend: inductor, keeping every FX graph it is given in ``graphs``."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        from torch._inductor.compile_fx import compile_fx

        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)


@pytest.fixture
def recording_inductor() -> RecordingInductor:
    """``torch.compile(fn, backend=recording_inductor)``; ``recording_inductor.graphs``: what it compiled."""
    return RecordingInductor()


def pytest_collection_modifyitems(config, items):
    """Skip ``cuda``-marked tests where torch sees no CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
