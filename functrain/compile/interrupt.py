"""Ctrl-C during a compile stops it at once, and inductor's compile workers are closed after a compile.

While :func:`functrain.jit` compiles, :func:`compiling` marks the compile as under way. A
``KeyboardInterrupt`` (Ctrl-C, or a :class:`CompileInterrupted` that a signal handler raises, e.g.
:class:`functrain.callbacks.Preemption`'s) ends it within a second: dynamo's trace and inductor's
Python work stop at the next bytecode, and :func:`close_compile_workers` kills the C++ compilers that
inductor's worker threads run and cancels their queued kernels (without that, the interpreter waits for
every queued ``g++`` before it exits: a minute for a small model on 2 cores).

After every compile the workers are closed too (:func:`close_compile_workers`): inductor keeps its
thread pool, and on a GPU its pool of compile subprocesses, for the life of the process otherwise;
the next compile starts them again.

Example:
    >>> with compiling():
    ...     compiled_step(state, batch)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator

__all__ = ["CompileInterrupted", "close_compile_workers", "compiled", "compiling", "under_way"]

_armed: list[bool] = []  # one entry per compile under way (nested when a step calls another jitted step)


class CompileInterrupted(KeyboardInterrupt):
    """A signal arrived while a step compiled and the compile was abandoned (``signum``: which).

    A ``KeyboardInterrupt``, so code that does not know it stops as on Ctrl-C.
    """

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def under_way() -> bool:
    """Whether a jitted step is compiling and may be abandoned: a signal handler may raise
    :class:`CompileInterrupted` (then the step's inputs are untouched)."""
    return bool(_armed) and _armed[-1]


def compiled() -> None:
    """The compile is done and its graph is about to run (it may write donated inputs): from here the
    step is not abandoned."""
    if _armed:
        _armed[-1] = False


@contextlib.contextmanager
def compiling(*, abandonable: bool = True) -> Iterator[None]:
    """Mark a compile as under way (``abandonable``: :func:`under_way` says so until :func:`compiled`);
    on ``KeyboardInterrupt`` close the compile workers before it propagates (their compilers killed,
    queued kernels cancelled)."""
    _armed.append(abandonable)
    try:
        yield
    except KeyboardInterrupt:
        close_compile_workers(kill=True)
        raise
    finally:
        _armed.pop()


def _children(pid: int, tid: int) -> list[int]:
    """Process ids started by thread ``tid`` of process ``pid`` (Linux ``/proc``; [] elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, deepest first."""
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return []
    out: list[int] = []
    for tid in tasks:
        for child in _children(pid, tid):
            out += [*_descendants(child), child]
    return out


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def close_compile_workers(*, kill: bool = False) -> None:
    """Shut inductor's compile workers down (a no-op before inductor is imported): its thread pool
    (queued kernels cancelled) and its subprocess pools. ``kill=True`` also kills the compilers its
    threads are running (``g++`` and what it started), so that an interrupted compile ends now; only
    processes started by those threads are touched, never the caller's own (data loader workers...)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None:
        return
    compile_class = async_compile.AsyncCompile
    info = compile_class.pool.cache_info()
    if info.currsize:
        pool = compile_class.pool()
        pool.shutdown(wait=False, cancel_futures=True)
        if kill:
            threads = list(getattr(pool, "_threads", ()))
            for _ in range(3):  # again: a thread may have taken a kernel just before the shutdown
                _kill([p for t in threads if t.native_id for c in _children(os.getpid(), t.native_id)
                       for p in (*_descendants(c), c)])  # fmt: skip
                time.sleep(0.02)
        else:
            pool.shutdown(wait=True)
        compile_class.pool.cache_clear()
    if async_compile._pool_set:  # subprocess pools (Triton kernels on a GPU)
        async_compile.shutdown_compile_workers()
