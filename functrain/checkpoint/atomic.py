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

__all__ = ["TMP_MARKER", "atomic_write", "fsync_directory", "is_temporary"]

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
