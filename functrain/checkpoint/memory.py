"""How much memory this process can still take: what a reader checks a header's declared sizes against.

A header is read before any tensor is allocated, so a file that declares more tensor bytes than could
ever be held (a crafted or damaged header over a sparse file of matching size) is refused with a
:class:`~functrain.checkpoint.CheckpointError` instead of an allocator error or the OOM killer.

Example:
    >>> available = available_memory()
    >>> available is None or available > 0
    True
"""

from __future__ import annotations

import os

__all__ = ["available_memory", "human_size"]


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (Linux); empty elsewhere."""
    values = {}
    try:
        with open("/proc/meminfo", "rb") as file:
            for line in file:
                key, _, rest = line.partition(b":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    values[key.decode()] = int(fields[0]) * (1024 if fields[1:] == [b"kB"] else 1)
    except OSError:
        return {}
    return values


def _cgroup_limit() -> int | None:
    """The cgroup v2 memory limit of this container (``/sys/fs/cgroup/memory.max``), if it has one."""
    try:
        with open("/sys/fs/cgroup/memory.max", "rb") as file:
            text = file.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> int | None:
    """Bytes that allocations can still get: available RAM plus free swap, within the cgroup limit.

    ``None`` where the platform does not say (then nothing is refused up front). Linux: ``MemAvailable``
    plus ``SwapFree`` from ``/proc/meminfo``; elsewhere ``os.sysconf`` available pages.

    Example:
        >>> available_memory()  # doctest: +SKIP
        23684521984
    """
    info = _meminfo()
    if "MemAvailable" in info:
        available = info["MemAvailable"] + info.get("SwapFree", 0)
    else:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return None
        if available <= 0:
            return None
    limit = _cgroup_limit()
    return available if limit is None else min(available, limit + info.get("SwapFree", 0))


def human_size(nbytes: int) -> str:
    """``nbytes`` in binary units, as ``functrain inspect`` prints sizes.

    Example:
        >>> human_size(24), human_size(3 << 20), human_size(1 << 40)
        ('24 B', '3.0 MiB', '1.0 TiB')
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
