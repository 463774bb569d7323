"""Build the inductor step beside the run: a low-priority child process warms the compile caches.

On a small CPU a cold inductor compile costs 10-70 s, mostly waiting for the C++ compiler, while a whole
short eager run takes seconds. Where cores are idle (or a GPU runs the steps and leaves the host idle), a
:class:`BackgroundBuild` starts ``python -m functrain.compile.background SPEC``: a child process, niced,
its compile workers limited to the idle cores, that rebuilds the run's steps from a *recipe* (an import
spec ``"module:function"`` returning :class:`Warmup` items: each step with a state and a batch of the
run's shapes and dtypes), compiles them into inductor's and AOTAutograd's on-disk caches (shared by every
process of the user), then compiles them again from those caches and reports that warm time. The run's
:class:`~functrain.compile.tiers.TieredStep` stays on its eager tier meanwhile; told the caches are warm,
it weighs the warm cost instead of the cold one and, where that pays, switches at a step boundary (its
one compile, in the main process, loads the kernels the child built). The decision is a plain
:class:`~functrain.compile.tiers.TierPlan`, kept with the run's checkpoints: a resume replays it.

A thread compiling beside the eager steps was measured instead and rejected: dynamo's tracing in two
threads crashed one run in two, the eager steps ran 2-2.3x slower on 2 cores, and the process aborted when
it exited mid-compile. A child process shares nothing but the cache files and is killed with the run: at
:meth:`BackgroundBuild.stop`, at the interpreter's exit (Ctrl-C included), and by the kernel when the
parent dies (``PR_SET_PDEATHSIG`` on Linux). A child that fails costs one log line; the run stays on its
tier.

The C++ kernels specialize on the run's intra-op thread count (inductor's FX cache key includes it), so the
child runs with the parent's ``torch.get_num_threads()``; only its compile workers are limited.

Example:
    >>> build = BackgroundBuild("mytask:warmups")  # doctest: +SKIP
    >>> step = tiered(make_train_step(model, loss), background=build)  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from functrain.core.atomic import process_exists

__all__ = ["BackgroundBuild", "BuildResult", "Warmup", "idle_cores", "remove_orphaned_dirs", "wanted"]

log = logging.getLogger("functrain.jit")  # the logger jit's users configure

RUNNING, FAILED = "running", "failed"
_RESULT, _SPEC, _OUTPUT = "result.json", "spec.json", "child.log"
_PREFIX = "functrain-background-"
_builds: weakref.WeakSet[BackgroundBuild] = weakref.WeakSet()  # stopped at exit


@dataclasses.dataclass(frozen=True)
class Warmup:
    """One step for the child to compile: a :class:`~functrain.compile.tiers.TieredStep` built as the run
    builds it, and a call of the run's shapes and dtypes (``step(state, *args)``; zeros are fine)."""

    step: Any
    state: Any
    args: tuple


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What a finished child reports: ``key``, the first step's compile key
    (:meth:`~functrain.compile.tiers.TieredStep.compile_key`: the run checks it compiled the same graph);
    ``warm_seconds``, the steps' compile from the warm caches plus dynamo's and inductor's imports (what
    the main process will pay); ``cold_seconds``, the child's own cold compile."""

    key: str
    warm_seconds: float
    cold_seconds: float


def idle_cores(
    device: torch.device | None = None,
    *,
    cores: int | None = None,
    threads: int | None = None,
    load: float | None = None,
) -> int:
    """CPU cores the run leaves idle: the cores this process may use, less the busier of what the run
    occupies (torch's intra-op threads on a CPU, one host thread where a GPU runs the steps) and the
    machine's load (the 1-minute load average, other processes' work included). ``cores``, ``threads``
    (torch's intra-op threads) and ``load``: measured unless given.

    Example:
        >>> idle_cores(torch.device("cpu"), cores=2, threads=2, load=0.5)
        0
        >>> idle_cores(torch.device("cuda"), cores=16, threads=16, load=1.0)
        15
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device is not None and device.type == "cuda":
        threads = 1  # the host thread that launches the steps; torch's intra-op threads wait
    elif threads is None:
        threads = torch.get_num_threads()
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(0, cores - max(threads, math.ceil(load)))


def wanted(setting: bool | str, device: torch.device | None = None) -> tuple[bool, str]:
    """Whether to build in the background (``setting``: ``True``/``False`` forces it, ``"auto"`` asks
    :func:`idle_cores`), and why, for the log.

    Example:
        >>> wanted(False)
        (False, 'turned off')
    """
    if setting is True:
        return True, "asked for"
    if setting is False:
        return False, "turned off"
    idle = idle_cores(device)
    return idle > 0, f"{idle} idle core{'s' * (idle != 1)}"


class BackgroundBuild:
    """A child process that compiles ``recipe``'s steps into the shared caches (see the module's
    docstring). :meth:`start` it once; :meth:`poll` says ``"running"``, ``"failed"`` (:attr:`failure`
    says why, in one line) or the :class:`BuildResult`; :meth:`stop` kills it (also at exit).

    ``recipe``: an import spec ``"module:function"``, called in the child with ``kwargs`` (JSON values),
    returning a list of :class:`Warmup`; the child imports it with this process's ``sys.path``.
    ``workers``: the child's compile workers (the idle cores; at least 1).

    Example:
        >>> build = BackgroundBuild("mytask:warmups", {"batch_size": 32})  # doctest: +SKIP
        >>> build.start(); build.poll()  # doctest: +SKIP
        'running'
    """

    def __init__(self, recipe: str, kwargs: dict[str, Any] | None = None, *, workers: int = 1) -> None:
        if ":" not in recipe:
            raise ValueError(f"BackgroundBuild: recipe must be 'module:function', got {recipe!r}")
        self.recipe, self.kwargs, self.workers = recipe, dict(kwargs or {}), max(1, int(workers))
        self.failure = ""
        self.started_at: float | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._result: BuildResult | str | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (``None`` before :meth:`start`)."""
        return self._process.pid if self._process is not None else None

    @property
    def started(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        """Start the child (once; its own session, so :meth:`stop` ends the compilers it started too)."""
        if self._process is not None:
            return
        remove_orphaned_dirs()
        self._dir = tempfile.mkdtemp(prefix=_PREFIX)
        spec = {
            "recipe": self.recipe,
            "kwargs": self.kwargs,
            "sys_path": [p for p in sys.path if isinstance(p, str)],
            "threads": torch.get_num_threads(),  # the kernels' thread count is in the cache key
            "parent": os.getpid(),
            "result": os.path.join(self._dir, _RESULT),
        }
        spec_path = os.path.join(self._dir, _SPEC)
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        package = str(Path(__file__).resolve().parents[2])  # the folder holding this functrain package
        path = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "TORCHINDUCTOR_COMPILE_THREADS": str(self.workers)}
        with open(os.path.join(self._dir, _OUTPUT), "wb") as output:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "functrain.compile.background", spec_path],
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        self.started_at = time.perf_counter()
        _builds.add(self)
        weakref.finalize(self, _kill_group, self._process.pid)

    def poll(self) -> BuildResult | str:
        """``"running"``, ``"failed"`` or the child's :class:`BuildResult` (a system call while it runs)."""
        if self._result is not None:
            return self._result
        if self._process is None:
            return self._finish(FAILED, "not started")
        code = self._process.poll()
        if code is None:
            return RUNNING
        if code != 0:
            return self._finish(FAILED, f"exit status {code}: {self._last_line()}")
        try:
            with open(os.path.join(self._dir or "", _RESULT), encoding="utf-8") as f:
                data = json.load(f)
            return self._finish(BuildResult(str(data["key"]), float(data["warm"]), float(data["cold"])))
        except (OSError, ValueError, KeyError, TypeError) as e:
            return self._finish(FAILED, f"no result ({type(e).__name__}: {e})")

    def stop(self) -> None:
        """Kill the child and the compilers it started (a no-op once it is done), and remove its files."""
        if self._process is not None and self._result is None and self._process.poll() is not None:
            self.poll()  # done but not yet read: keep its result
            return
        if self._process is not None and self._process.poll() is None:
            _kill_group(self._process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
            if self._result is None:
                self._result = FAILED
                self.failure = "stopped"
        if self._dir is not None and (self._process is None or self._process.poll() is not None):
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _finish(self, result: BuildResult | str, failure: str = "") -> BuildResult | str:
        self._result, self.failure = result, failure
        self.stop()
        return result

    def _last_line(self) -> str:
        try:
            with open(os.path.join(self._dir or "", _OUTPUT), encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        except OSError:
            return "no output"
        return lines[-1][:300] if lines else "no output"

    def __repr__(self) -> str:
        state = RUNNING if self._result is None and self.started else (self._result or "not started")
        return f"BackgroundBuild({self.recipe}, pid={self.pid}, {state})"


def remove_orphaned_dirs(root: str | None = None) -> list[str]:
    """Remove the folders of builds whose parent process is gone (killed with SIGKILL, which leaves no
    Python to clean up; its child then died with it); the removed paths. A folder whose spec is not
    written yet, or whose parent runs, stays.

    Example:
        >>> remove_orphaned_dirs(tempfile.mkdtemp())  # an empty folder: nothing to remove
        []
    """
    removed = []
    for folder in sorted(Path(root or tempfile.gettempdir()).glob(f"{_PREFIX}*")):
        try:
            parent = int(json.loads((folder / _SPEC).read_text(encoding="utf-8"))["parent"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
        if process_exists(parent) is not False:  # alive, this process, or cannot be asked
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def _kill_group(pid: int) -> None:
    """SIGKILL the child's session (the child and the compilers it started)."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


@atexit.register
def _stop_all() -> None:
    for build in list(_builds):
        build.stop()


# ---------------------------------------------------------------------------------------------- the child


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux); exit if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(3)


def _compile(warmups: Sequence[Warmup]) -> tuple[str, float]:
    """Run each warm-up step on its inductor tier (it compiles); the first one's key and the seconds."""
    started, key = time.perf_counter(), ""
    for i, w in enumerate(warmups):
        if i == 0:
            key = w.step.compile_key(w.state, w.args, {})
        w.step.compile_from_start()
        w.step.at_step(0, 1)
        w.step(w.state, *w.args)
    return key, time.perf_counter() - started


def _recipe(target: str) -> Any:
    """The function a ``"package.module:function"`` recipe names."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def child_main(spec_path: str) -> int:
    """The child: rebuild the recipe's steps, compile them cold, then again from the warm caches; write the
    :class:`BuildResult`'s fields to the spec's result path."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    _die_with_parent(int(spec["parent"]))
    with contextlib.suppress(OSError):
        os.nice(19)  # only the cores nothing else wants
    sys.path[:] = list(spec["sys_path"])
    torch.set_num_threads(int(spec["threads"]))

    started = time.perf_counter()
    for module in ("torch._inductor.compile_fx", "functrain.jit"):  # what the main process will import
        importlib.import_module(module)
    imports = time.perf_counter() - started
    recipe = _recipe(spec["recipe"])
    key, cold = _compile(recipe(**spec["kwargs"]))
    importlib.import_module(
        "torch._dynamo"
    ).reset()  # forget the graphs: the second compile reads the caches the first wrote
    warm_key, warm = _compile(recipe(**spec["kwargs"]))
    if warm_key != key:
        raise RuntimeError(f"the recipe built two different steps ({key} then {warm_key})")
    from functrain.core.atomic import replace_text

    result = {"key": key, "warm": round(imports + warm, 3), "cold": round(cold, 3)}
    replace_text(spec["result"], json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
