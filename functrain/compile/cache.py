"""The portable compile cache of ``jit(..., cache_dir=...)``: torch's cache artifacts
(``torch.compiler.save_cache_artifacts``: AOTAutograd and inductor entries, compiled kernels) in a file per
step, loaded into the local caches before the first compile in a new process, on this machine or another
of the same kind.

Example (what ``jit(..., cache_dir=run_dir.name)`` does around a compile; nothing compiles here):
    >>> import os, tempfile
    >>> run_dir = tempfile.TemporaryDirectory()
    >>> cache = PortableCache(run_dir.name, "train_step")
    >>> misses = cache.before_call(first=True)  # loads the folder's files, once per process
    >>> cache.after_compile(misses)  # writes train_step.compile-cache only when a compile missed
    >>> os.listdir(run_dir.name)  # no compile since before_call: nothing new to keep
    []
"""

from __future__ import annotations

import logging
import os

import torch

from functrain.core.atomic import atomic_write

__all__ = ["CACHE_SUFFIX", "PortableCache"]

log = logging.getLogger("functrain.jit")  # the logger jit's users configure

CACHE_SUFFIX = ".compile-cache"
_loaded_cache_files: set[str] = set()


def _cache_misses() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


def _load_cache_dir(directory: str) -> int:
    """Load every cache file of ``directory`` not loaded by this process yet; returns how many.

    The files are torch's serialized cache entries (pickles, like inductor's own cache directory):
    load only a directory that your own runs wrote.
    """
    if not os.path.isdir(directory):
        return 0
    loaded = 0
    for name in sorted(os.listdir(directory)):
        path = os.path.abspath(os.path.join(directory, name))
        if not name.endswith(CACHE_SUFFIX) or path in _loaded_cache_files:
            continue
        _loaded_cache_files.add(path)
        try:
            with open(path, "rb") as f:
                torch.compiler.load_cache_artifacts(f.read())
            loaded += 1
        except Exception as e:  # a stale or foreign file costs a cold compile, never the run
            log.warning("functrain.jit: ignoring compile cache %s (%s: %s)", path, type(e).__name__, e)
    return loaded


def _save_cache_file(directory: str, name: str) -> None:
    """Write this process's compile artifacts (all of them, cumulative) to ``directory/name``.

    Written atomically (:func:`functrain.core.atomic.atomic_write`): ranks of one run may write the same file
    at once.
    """
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return
    path = os.path.join(directory, name + CACHE_SUFFIX)
    try:
        os.makedirs(directory, exist_ok=True)
        with atomic_write(path, fsync=False) as f:
            f.write(artifacts[0])
    except OSError as e:
        log.warning("functrain.jit: could not write the compile cache %s: %s", path, e)
    _loaded_cache_files.add(os.path.abspath(path))


class PortableCache:
    """One step's file in a ``cache_dir``: the folder loaded before the step's first compile, the file
    written after a compile that missed the local caches."""

    def __init__(self, directory: str, name: str) -> None:
        self.directory = directory
        self.name = name

    def before_call(self, *, first: bool) -> int:
        """Load the folder before the first compile; returns the cache misses so far (for :meth:`after_compile`)."""
        if first:
            _load_cache_dir(self.directory)
        return _cache_misses()

    def after_compile(self, misses_before: int) -> None:
        """Write the file when the compile missed the local caches (new artifacts to keep)."""
        if _cache_misses() > misses_before:
            _save_cache_file(self.directory, self.name)
