"""A gloo rank's exit: let gloo's worker threads put down their last collective before Python finalizes.

Why: gloo runs each collective on a worker thread of its process group (``pt_gloo_runloop``). The
caller's ``wait()`` returns when the result is ready; the worker drops its reference to the finished
work a moment later, and with it the work's tensors: releasing a tensor that has a Python object takes
the GIL. If the interpreter has begun finalizing by then (the script ended while the worker was
descheduled, on a busy machine), Python 3.11's ``take_gil`` ends the thread with ``pthread_exit``; the
forced unwind passes the work's ``noexcept`` destructor and the process aborts: ``terminate called
without an active exception``, exit -6, no Python frame. Core dump of such an abort (torch 2.13)::

    Thread 1 "pt_gloo_runloop" (Exiting)
    #6  std::terminate()                 ... #9  _Unwind_ForcedUnwind
    #12 __GI___pthread_exit              #13 PyThread_exit_thread   #14 take_gil
    #16 pybind11::gil_scoped_acquire     #17 ConcretePyInterpreterVTable::decref
    #18 c10::TensorImpl::decref_pyobject #20 c10d::ProcessGroupGloo::AsyncWork::~AsyncWork
    #22 c10d::ProcessGroupGloo::runLoop
    Thread 4 (main): Py_FinalizeEx -> PyGC_Collect

Destroying the process group joins its workers, but only once nothing references the group any more:
``destroy_process_group`` forgets it, while a ``GradientReducer``, a sharding spec, functional
collectives' bookkeeping or the user's own ``group = dist.group.WORLD`` keep the object alive, its
workers running into finalization (gloo's ``shutdown`` and ``abort`` do not stop them either). About 1
gloo run in 100 aborted this way after finishing; a 2-rank script that ends right after its collectives
holding the group, 6 in 33. The bug is torch's, with Python <= 3.13 (3.14 parks such a thread instead of
ending it, gh-87135); its minimal reproduction is tests/test_distributed_torchrun.py's late-worker test,
and this module is the workaround.

:func:`wait_for_gloo_workers` runs at exit (registered by :func:`functrain.distributed.initialize`),
before the interpreter finalizes: it sleeps, GIL released, until every gloo worker thread of the process
has stayed blocked through a whole interval, i.e. is parked waiting for work. Linux only (it reads
``/proc/self/task``); elsewhere it returns at once.

Example:
    >>> wait_for_gloo_workers()  # no gloo group in this process: returns at once
    True
"""

from __future__ import annotations

import atexit
import os
import time

__all__ = ["wait_for_gloo_workers", "wait_for_gloo_workers_at_exit"]

_WORKER_NAME = "pt_gloo_runloop"  # what ProcessGroupGloo names its work threads
_TASKS = "/proc/self/task"
_registered = False


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread ended
        return None


def _worker_threads() -> list[str]:
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    return [tid for tid in tids if (_read(f"{_TASKS}/{tid}/comm") or "").strip() == _WORKER_NAME]


def _activity(tids: list[str]) -> dict[str, tuple[str, ...]] | None:
    """Each thread's state and context-switch counts; None while one of them is running or runnable."""
    seen = {}
    for tid in tids:
        status = _read(f"{_TASKS}/{tid}/status")
        if status is None:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        state = fields.get("State", "").split()
        if not state or state[0] == "R":
            return None
        seen[tid] = tuple(
            fields.get(k, "").strip() for k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        )
    return seen


def wait_for_gloo_workers(timeout_s: float = 5.0, interval_s: float = 0.005) -> bool:
    """Wait until this process's gloo worker threads are parked; True when they are (or there are none).

    A thread counts as parked once it was asleep at the start and the end of an ``interval_s`` sleep
    and did not wake in between (its context-switch counts unchanged): a worker still releasing a
    finished work either runs, or waits for the GIL that this sleep hands it and so wakes. Gives up
    after ``timeout_s`` (a collective nobody waits for can keep a worker busy) and returns False.

    Example:
        >>> wait_for_gloo_workers(timeout_s=0.1)
        True
    """
    tids = _worker_threads()
    if not tids:
        return True
    deadline = time.monotonic() + timeout_s
    before = _activity(tids)
    while time.monotonic() < deadline:
        time.sleep(interval_s)  # releases the GIL: a worker waiting for it takes it now
        now = _activity(tids)
        if now is not None and now == before:
            return True
        before = now
    return False


def wait_for_gloo_workers_at_exit() -> None:
    """Run :func:`wait_for_gloo_workers` when the interpreter exits, before it finalizes (once per process).

    Example:
        >>> wait_for_gloo_workers_at_exit()  # what initialize() calls when it joins a process group
    """
    global _registered
    if not _registered:
        atexit.register(wait_for_gloo_workers)
        _registered = True
