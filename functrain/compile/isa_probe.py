"""Inductor's CPU vector-ISA probe, remembered across processes and cache directories.

Before its first CPU compile in a process, inductor checks each vector ISA the CPU claims (AVX2,
AVX-512, ...): it builds a tiny library with that ISA's flags (cached in inductor's cache directory) and
starts a child Python to load it (not cached). A new process pays ~1.2 s for the loads; a new, empty
inductor cache directory (a fresh container, a cluster node's wiped ``/tmp``, a benchmark's cold start)
pays ~7 s for the builds as well, before any kernel of the model is compiled.

Inductor offers ``cpp.vec_isa_ok=True`` to skip the check. :func:`vec_isa_verified` returns True only
when torch's own check passed for *every* ISA the CPU claims, in this process or in an earlier one with
the same torch, Python, compiler and CPU: then the patch picks the very ISA the check would have picked.
The verdict is a small JSON record in functrain's per-user cache directory (``$FUNCTRAIN_CACHE_DIR``,
else ``$XDG_CACHE_HOME/functrain``, else ``~/.cache/functrain``), one file per environment, so it
outlives inductor's cache directory. Any difference, a failed ISA, or a platform other than x86-64
Linux leaves the check to inductor; a directory that cannot be written only costs the next process the
check again.

The patch is part of inductor's cache key, so :func:`functrain.jit` passes it on every CPU compile once
verified, cold or warm alike, and the cached graphs of one process match the next one's.

``cpp.vec_isa_ok=True`` skips only the base check of each ISA: the AVX-512 bf16, VNNI, AMX and AMX-fp16
extension checks still build and load a probe library each (six child Pythons on a Sapphire Rapids
CPU: 0.7-1.8 s of every warm start, the largest part of loading a cached graph). The record keeps every
build-and-load verdict of torch's check (``builds``), keyed by the ISA's class, inductor's build
fingerprint of its flags (compiler version, flags, torch version) and the probe code's hash; a later
process of the same environment answers ``VecISA.check_build`` from it. A check whose key is not
recorded (other flags, code or compiler) runs torch's own.

Example:
    >>> isinstance(vec_isa_verified(), bool)
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from functrain.core.atomic import replace_text

_RECORD_PREFIX = "vec-isa-"
_verified: bool | None = None


def _environment() -> dict[str, Any] | None:
    """What torch's check depends on: the ISAs the CPU claims, each with inductor's own build
    fingerprint (compiler version, ISA flags, torch version), torch's build and this Python.
    None where inductor's check is not the x86 one this module knows."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    from torch._inductor import cpu_vec_isa

    claimed = cpu_vec_isa.x86_isa_checker()
    candidates = [
        isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in claimed for flag in str(isa).split())
    ]
    if not candidates:
        return None
    return {
        "isas": [str(isa) for isa in candidates],
        "fingerprints": [
            cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags()) for isa in candidates
        ],
        "torch": torch.version.git_version,
        "python": sys.executable,
    }


def cache_root() -> Path:
    """functrain's per-user cache directory: ``$FUNCTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/functrain``,
    else ``~/.cache/functrain`` (not created here)."""
    explicit = os.environ.get("FUNCTRAIN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "functrain"


def _record_path(environment: dict[str, Any]) -> Path:
    """One record per environment: a home directory shared by machines of several kinds keeps each
    kind's verdict instead of overwriting one file."""
    digest = hashlib.sha256(json.dumps(environment, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"{_RECORD_PREFIX}{digest}.json"


def _build_key(isa: Any, code: str) -> str:
    """What a ``check_build`` verdict depends on beyond the environment: the ISA, its flags (an
    extension check adds some) with inductor's compiler fingerprint, and the probe code."""
    from torch._inductor import cpu_vec_isa

    fingerprint = cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags())
    fields = [type(isa).__qualname__, fingerprint, hashlib.sha256(code.encode()).hexdigest()]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:24]


def _unwrapped_check_build() -> Any:
    from torch._inductor import cpu_vec_isa

    current = cpu_vec_isa.VecISA.check_build
    return getattr(current, "__wrapped__", current)


@contextlib.contextmanager
def _recording_builds(builds: dict[str, bool]) -> Iterator[None]:
    """Record every ``VecISA.check_build`` verdict made inside into ``builds``."""
    from torch._inductor import cpu_vec_isa

    original = _unwrapped_check_build()

    def check_build(isa: Any, code: str) -> bool:
        verdict = bool(original(isa, code))
        builds[_build_key(isa, code)] = verdict
        return verdict

    check_build.__wrapped__ = original  # type: ignore[attr-defined]
    saved = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = check_build  # type: ignore[method-assign]
    try:
        yield
    finally:
        cpu_vec_isa.VecISA.check_build = saved  # type: ignore[method-assign]


def _answer_builds(builds: dict[str, bool]) -> None:
    """Answer ``VecISA.check_build`` from ``builds`` (recorded in this environment); torch's own check
    for any other key."""
    from torch._inductor import cpu_vec_isa

    original = _unwrapped_check_build()

    def check_build(isa: Any, code: str) -> bool:
        verdict = builds.get(_build_key(isa, code))
        return original(isa, code) if verdict is None else verdict

    check_build.__wrapped__ = original  # type: ignore[attr-defined]
    cpu_vec_isa.VecISA.check_build = check_build  # type: ignore[method-assign]


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _check() -> bool:
    environment = _environment()
    if environment is None:
        return False
    path = _record_path(environment)
    record = _read_record(path)
    recorded = record.get("builds") if record is not None else None
    # A record without ``builds`` (an earlier functrain's) is checked again once, to add them.
    if isinstance(recorded, dict) and all(record.get(k) == v for k, v in environment.items()):
        _answer_builds({k: v for k, v in recorded.items() if isinstance(v, bool)})
        return True
    from torch._inductor import cpu_vec_isa

    # torch's own check (builds and loads each claimed ISA); all must pass for the patch to be exact.
    builds: dict[str, bool] = {}
    with _recording_builds(builds):
        valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    if valid != environment["isas"]:
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, json.dumps({**environment, "builds": builds}, indent=1))
    except OSError:  # a read-only home: this process knows the verdict, the next one checks again
        pass
    return True


def vec_isa_verified() -> bool:
    """True when every vector ISA this CPU claims passed torch's build-and-load check (here or in a
    recorded earlier process of the same environment); once per process."""
    global _verified
    if _verified is None:
        try:
            _verified = _check()
        except Exception:  # a private torch API moved: leave the check to inductor
            _verified = False
    return _verified
