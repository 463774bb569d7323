"""Atomic file replacement, the one helper every writer of functrain uses (checkpoints, logs, the config,
compile caches): write to a temporary file beside the target, fsync, rename, fsync the folder.

A reader (or a process restarted after a crash) sees either the old file or the complete new one, never
a partial file under the final name. A temporary name says who writes it,
``<target>.tmp-<host>-<boot>-<pid>-<random>`` (hashes of the host name and pid namespace, and of the boot
id), so that a later *writer* can tell a file whose writer is gone (:func:`is_abandoned`) from one being
written right now by another process, and remove only the former. Readers never remove anything.

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
import functools
import hashlib
import os
import re
import secrets
import socket
from collections.abc import Iterator
from typing import BinaryIO

__all__ = [
    "ABANDONED_AFTER_SECONDS",
    "TMP_MARKER",
    "atomic_write",
    "drop_cached_pages",
    "fsync_directory",
    "is_abandoned",
    "process_exists",
    "replace_text",
    "temporary_path",
]

TMP_MARKER = ".tmp-"
# A temporary file nobody has written to for this long is abandoned even when its writer cannot be checked
# (another host, an older functrain's name). A live writer touches its file with every chunk it writes.
ABANDONED_AFTER_SECONDS = 3600.0
_OWNED = re.compile(r"\.tmp-([0-9a-f]{8})-([0-9a-f]{8})-([0-9]+)-[0-9a-f]+$")
_UNKNOWN_BOOT = "0" * 8


@functools.cache
def _host() -> str:
    """This host and pid namespace, hashed: pids are comparable only between files with the same value."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.blake2s(f"{socket.gethostname()}\0{namespace}".encode(), digest_size=4).hexdigest()


@functools.cache
def _boot() -> str:
    """This boot of the kernel (Linux), hashed; a file from an earlier boot has no live writer."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as file:
            return hashlib.blake2s(file.read().strip(), digest_size=4).hexdigest()
    except OSError:
        return _UNKNOWN_BOOT


def temporary_path(path: str | os.PathLike[str]) -> str:
    """A fresh temporary name beside ``path`` that records this process as its writer.

    Example:
        >>> temporary_path("run/step_1.ckpt").startswith("run/step_1.ckpt.tmp-")
        True
    """
    return f"{os.fspath(path)}{TMP_MARKER}{_host()}-{_boot()}-{os.getpid()}-{secrets.token_hex(4)}"


def process_exists(pid: int) -> bool | None:
    """Whether ``pid`` is a live process here; ``None`` where that cannot be asked safely.

    Example:
        >>> process_exists(os.getpid())
        True
    """
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except (OSError, OverflowError):
        return None
    return True


def is_abandoned(path: str | os.PathLike[str], *, now: float, mtime: float) -> bool:
    """Whether the temporary file ``path`` (last modified at ``mtime``) is provably not being written.

    True when its name says it was written on this host by a process that no longer exists, or during an
    earlier boot; otherwise (another host, a live writer, a name without a writer) only when it was not
    modified for :data:`ABANDONED_AFTER_SECONDS`.

    Example:
        >>> import time
        >>> is_abandoned(temporary_path("a.ckpt"), now=time.time(), mtime=time.time())
        False
    """
    match = _OWNED.search(os.fspath(path))
    if match is not None and match.group(1) == _host():
        boot, pid = match.group(2), int(match.group(3))
        if _UNKNOWN_BOOT not in (boot, _boot()) and boot != _boot():
            return True
        if boot == _boot() and process_exists(pid) is False:
            return True
    return now - mtime > ABANDONED_AFTER_SECONDS


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
    temporary = temporary_path(path)
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


def replace_text(path: str | os.PathLike[str], text: str, *, fsync: bool = True) -> None:
    """Replace ``path``'s content with ``text`` (UTF-8, newlines as given) through :func:`atomic_write`.

    Example:
        >>> replace_text("run/run_id.txt", "abc123")  # doctest: +SKIP
    """
    with atomic_write(path, fsync=fsync) as file:
        file.write(text.encode("utf-8"))
