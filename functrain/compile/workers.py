"""How many C++ compilers inductor may run at once for one CPU compile: the cores the machine leaves idle.

On a CPU, inductor's compile workers are threads that each run ``g++`` on one kernel (``compile_threads``,
inductor's default ``min(32, cores)``); each compiler holds ~220 MB (``cc1plus`` with inductor's
precompiled header), as much as the whole eager MLP run of benchmarks/warm_start.py. A second compiler
halves the kernels' compile time only where a second core is idle: on a loaded machine it adds its memory
and gains nothing (benchmarks/README.md, "Compile workers"). :func:`compile_threads` gives one worker per
core that other processes leave idle by the 1-minute load average (the compiling process itself waits
while its compilers run: its own share of the load counts as idle), at least 1 and at most inductor's
default; a warm start
runs no compiler, whatever the setting. ``compile_threads`` is outside inductor's cache key: the choice
never changes which cached graph a step finds. An explicit ``TORCHINDUCTOR_COMPILE_THREADS`` or
``jit(..., options={"compile_threads": n})`` wins.

Example:
    >>> compile_threads(cores=2, load=0.2)
    2
    >>> compile_threads(cores=2, load=3.5)
    1
    >>> compile_threads(cores=64, load=8.0)
    32
"""

from __future__ import annotations

import os

__all__ = ["compile_threads", "machine_compile_threads"]

_INDUCTOR_MAX = 32  # inductor's own cap (torch._inductor.config.decide_compile_threads)


def compile_threads(*, cores: int, load: float) -> int:
    """Compile workers for ``cores`` cores at 1-minute load average ``load`` (this process included,
    whose core is free while its compilers run): the idle cores, rounded, at least 1 and at most
    ``min(32, cores)``."""
    idle = round(cores - load + 1)
    return max(1, min(_INDUCTOR_MAX, cores, idle))


def machine_compile_threads() -> int | None:
    """:func:`compile_threads` for this machine now (its usable cores and load average); ``None`` where the
    user chose (``TORCHINDUCTOR_COMPILE_THREADS``) or the load is unknown (inductor's default then)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return None
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return compile_threads(cores=cores or 1, load=load)
