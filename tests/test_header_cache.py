"""functrain.compile.header_cache: inductor's precompiled header is named from a record, not by running
``g++ -E`` over the prefix header again in every process (~0.8 s of every warm start)."""

from __future__ import annotations

import pytest

from functrain.compile import header_cache


@pytest.fixture
def inductor_precompile(monkeypatch, tmp_path):
    """An empty functrain cache and a counted stand-in for inductor's ``_precompile_header`` that
    "builds" ``<header>.gch`` in ``tmp_path`` (``calls`` counts the compiler runs)."""
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "functrain"))
    calls = []

    def precompile(header: str, hashable_cmd_line: str, **compile_command) -> str:
        calls.append((header, hashable_cmd_line))
        built = tmp_path / f"{len(calls)}-{header.replace('/', '_')}"
        built.with_name(built.name + ".gch").write_text("pch")
        return str(built)

    precompile.calls = calls
    return precompile


def _new_process(original):
    """The wrapper as a new process installs it (its own per-process cache)."""
    import functools

    return functools.cache(header_cache._remembering(original))


def test_a_later_process_reuses_the_recorded_header_without_the_compiler(inductor_precompile):
    first = _new_process(inductor_precompile)(
        "torch/csrc/inductor/cpp_prefix.h", "g++ -O3 o i", vec_isa="avx2"
    )
    assert len(inductor_precompile.calls) == 1
    again = _new_process(inductor_precompile)(
        "torch/csrc/inductor/cpp_prefix.h", "g++ -O3 o i", vec_isa="avx2"
    )
    assert again == first
    assert len(inductor_precompile.calls) == 1  # no g++ -E, no openssl: the record named it


def test_other_flags_or_a_missing_header_file_run_inductors_own_function(inductor_precompile, tmp_path):
    header = "torch/csrc/inductor/cpp_prefix.h"
    first = _new_process(inductor_precompile)(header, "g++ -O3 o i", vec_isa="avx2")
    other = _new_process(inductor_precompile)(header, "g++ -O3 o i", vec_isa="avx512")
    assert other != first and len(inductor_precompile.calls) == 2
    (tmp_path / (first.split("/")[-1] + ".gch")).unlink()  # inductor's cache folder was wiped
    rebuilt = _new_process(inductor_precompile)(header, "g++ -O3 o i", vec_isa="avx2")
    assert len(inductor_precompile.calls) == 3
    assert _new_process(inductor_precompile)(header, "g++ -O3 o i", vec_isa="avx2") == rebuilt


def test_install_wraps_inductors_function_once(monkeypatch):
    from torch._inductor import codecache

    monkeypatch.setattr(header_cache, "_installed", False)
    original = codecache._precompile_header
    monkeypatch.setattr(codecache, "_precompile_header", original)
    header_cache.install()
    header_cache.install()
    assert codecache._precompile_header.__wrapped__.__wrapped__ is original
