"""Atomic file replacement: write to a temporary file beside the target, fsync, rename, fsync the folder.

A reader (or a process restarted after a crash) sees either the old file or the complete new one, never
a partial file under the final name. Temporary names end in ``.tmp-<random>`` so that a
:class:`~functrain.checkpoint.CheckpointManager` can clean up what a killed process left behind.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with atomic_write(os.path.join(folder, "a.bin")) as f:
    ...     _ = f.write(b"complete")
    >>> open(os.path.join(folder, "a.bin"), "rb").read()
    b'complete'
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["TMP_MARKER", "atomic_write", "drop_cached_pages", "fsync_directory", "is_temporary"]

TMP_MARKER = ".tmp-"


def is_temporary(filename: str) -> bool:
    """True for a name :func:`atomic_write` uses while writing (a leftover after a crash)."""
    return TMP_MARKER in filename


def fsync_directory(directory: str) -> None:
    """Make a rename or delete in ``directory`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder; its renames are durable enough
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def drop_cached_pages(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (best effort; POSIX only).

    An atomic write needs a new file's worth of page cache while the old file is still there; the
    old file's pages are useless once it is replaced. Dropping them first lets the new file reuse that
    memory: measured on this project's VM, writing 1 GiB beside a cached 1 GiB file took 3.0-4.8 s,
    and 1.0-2.1 s after the old file's pages were dropped (an in-place truncating write: 1.0-1.5 s).
    Dirty pages are not dropped (the kernel starts writing them back); the file itself is untouched.

    Example:
        >>> drop_cached_pages("run/last.ckpt")  # doctest: +SKIP
    """
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path``; on success it replaces ``path``, on error it is removed.

    With ``fsync`` the data and the rename reach the disk before this returns (survives power loss);
    without it the result is still atomic for other processes and for a killed writer.

    Example:
        >>> with atomic_write("model.ckpt") as f:  # doctest: +SKIP
        ...     f.write(data)
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = f"{path}{TMP_MARKER}{secrets.token_hex(6)}"
    drop_cached_pages(path)  # the file being replaced: its cached pages are better spent on the new one
    try:
        with open(temporary, "wb") as file:
            yield file
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    if fsync:
        fsync_directory(directory)
