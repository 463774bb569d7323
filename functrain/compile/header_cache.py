"""Inductor's precompiled C++ header, found without preprocessing it again in every process.

Before it loads or builds its first CPU kernel, every process (a warm start too, whose kernels are all
cached) runs inductor's ``_precompile_header``: ``g++ -E`` over the whole prefix header (ATen's
vectorized types) and an ``openssl sha512`` of the output, ~0.8 s on the loaded 2-core machine, only to
name the ``.gch`` file that an earlier process already built. :func:`install` wraps that function:
the path it returned is recorded in functrain's per-user cache (:func:`functrain.compile.isa_probe.
cache_root`) under a key of its arguments, torch's build and install folder and the compiler's
version; a later call with the same key, whose ``.gch`` file still exists, returns the recorded path
without running the compiler. Anything else (no record, another torch or compiler, the file gone, a
private torch API that moved) calls inductor's own function.

Example:
    >>> from torch._inductor import codecache
    >>> install()  # once per process, before inductor loads a CPU kernel (jit's backend does)
    >>> codecache._precompile_header.__wrapped__.__wrapped__.__module__  # inductor's own, on a miss
    'torch._inductor.codecache'
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from functrain.compile.isa_probe import cache_root
from functrain.core.atomic import replace_text

__all__ = ["install"]

log = logging.getLogger("functrain.jit")

_RECORD_PREFIX = "precompiled-header-"
_installed = False


def _key(header: str, command_line: str, compile_command: dict[str, Any]) -> str:
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    fields = {
        "header": header,
        "command_line": command_line,
        # Objects by type and str(): inductor's vector ISAs print as their name, not their address.
        "compile_command": [[k, type(v).__qualname__, str(v)] for k, v in sorted(compile_command.items())],
        "torch": [torch.__version__, torch.version.git_version, os.path.dirname(torch.__file__)],
        "compiler": get_compiler_version_info(get_cpp_compiler()),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def _remembering(original: Callable[..., str]) -> Callable[..., str]:
    def precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        try:
            path = cache_root() / f"{_RECORD_PREFIX}{_key(header, hashable_cmd_line, compile_command)}.json"
        except Exception as e:  # a private torch API moved: inductor's own way
            log.debug("precompiled header not remembered (%s: %s)", type(e).__name__, e)
            return original(header, hashable_cmd_line, **compile_command)
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))["header"]
            if isinstance(recorded, str) and any(os.path.isfile(recorded + ext) for ext in (".gch", ".pch")):
                return recorded
        except (OSError, ValueError, KeyError, TypeError):
            pass
        built = original(header, hashable_cmd_line, **compile_command)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_text(path, json.dumps({"header": built}))
        except OSError:  # a read-only cache: the next process preprocesses again
            pass
        return built

    return precompile_header


def install() -> None:
    """Wrap inductor's ``_precompile_header`` (once per process; a no-op where torch has no such
    function or builds no precompiled header)."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch._inductor import codecache

    original = getattr(codecache, "_precompile_header", None)
    if original is None or not callable(original):
        return
    wrapped = _remembering(original)
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    codecache._precompile_header = functools.cache(wrapped)  # once per argument set, as inductor's
