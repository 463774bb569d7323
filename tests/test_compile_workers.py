"""functrain.compile.workers: one C++ compiler per idle core for a CPU compile, never more than inductor's."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from functrain.compile import workers

backend_module = importlib.import_module("functrain.compile.backend")


@pytest.mark.parametrize(
    ("cores", "load", "expected"),
    [
        (2, 0.2, 2),  # an idle 2-core machine: both cores compile
        (2, 1.0, 2),  # the load is this process alone, which waits while its compilers run
        (2, 2.0, 1),  # another process holds a core: a second compiler would only add ~220 MB
        (2, 15.0, 1),  # this shared machine, loaded: one compiler
        (1, 0.0, 1),
        (16, 4.4, 13),
        (64, 1.0, 32),  # inductor's own cap
    ],
)
def test_one_compiler_per_idle_core(cores, load, expected):
    assert workers.compile_threads(cores=cores, load=load) == expected


def test_the_machine_policy_reads_cores_and_load_and_the_users_choice_wins(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.2, 0.0, 0.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert workers.machine_compile_threads() == 6
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    assert workers.machine_compile_threads() is None


def _patches(monkeypatch, device="cpu", options=None):
    """The config_patches jit's backend hands to (a fake) inductor for a one-op graph on ``device``."""
    seen = {}
    fake = lambda gm, inputs, config_patches=None, **kwargs: seen.update(config_patches or {}) or gm  # noqa: E731
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake)
    graph = torch.fx.symbolic_trace(lambda x: x + 1)
    backend_module.compile_graph(graph, [torch.ones(2, device=device)], dict(options or {}))
    return seen


def test_jit_passes_the_policy_on_cpu_compiles_and_options_win(monkeypatch):
    monkeypatch.setattr(workers, "machine_compile_threads", lambda: 1)
    assert _patches(monkeypatch)["compile_threads"] == 1
    assert _patches(monkeypatch, options={"compile_threads": 2})["compile_threads"] == 2
    assert "compile_threads" not in _patches(monkeypatch, device="meta")  # not a CPU compile: inductor's
    monkeypatch.setattr(workers, "machine_compile_threads", lambda: None)
    assert "compile_threads" not in _patches(monkeypatch)


def test_compile_threads_is_outside_inductors_cache_key():
    # the choice must never make a step miss (or find another) cached graph
    from torch._inductor import config

    assert any("compile_threads".startswith(p) for p in config._cache_config_ignore_prefix)
