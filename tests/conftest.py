"""Test-wide settings: one intra-op thread (tiny tensors run several times faster on 2 shared cores), torch's
structured trace kept out of failure reports, one inductor cache per ``ATEN_CPU_CAPABILITY``."""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable, Iterator

import pytest
import torch


def _inductor_cache_per_capability() -> None:
    """``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) stands in for a CPU without AVX-512: eager ATen and
    inductor's generated code both follow it, but inductor's FX graph cache key leaves it out (torch
    2.13), so a graph cached by a run without it is served to a run with it, and its kernels compute
    garbage (a float64 MLP's first loss 0.56 instead of 0.70, weights 1e252). Each capability gets its
    own cache directory, unless one is set."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-{capability}"


_inductor_cache_per_capability()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# torch's structured-trace logger: always at DEBUG and not propagating, so pytest's log capture attaches
# its handlers to it directly, and a failing compile test's report ends in ~150 "DEBUG torch.__trace"
# lines (and torch builds every trace payload, because the logger now has handlers).
_TORCH_TRACE = logging.getLogger("torch.__trace")


def _detach_pytest_from_torch_trace() -> None:
    for handler in list(_TORCH_TRACE.handlers):
        if type(handler).__module__.startswith("_pytest"):  # torch's own (TORCH_TRACE=dir) handler stays
            _TORCH_TRACE.removeHandler(handler)


@pytest.hookimpl(wrapper=True, trylast=True)  # trylast: inside pytest's logging wrapper, after it attached
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _detach_pytest_from_torch_trace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _detach_pytest_from_torch_trace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    _detach_pytest_from_torch_trace()
    return (yield)


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

        compiled = compile_fx(gm, example_inputs)
        # after compiling: dynamo may restart its analysis from inside compile_fx (a float scalar made a
        # tensor) and pass the same graph again
        self.graphs.append(gm)
        return compiled


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
