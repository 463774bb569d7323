"""`Profiler`: a ``torch.profiler`` trace of a window of training steps, written to the run directory.

The profiler exists only inside its window: it is created at the first warm-up step and stopped (the
trace written) after the last active step, so the steps before and after run exactly as without it: no
profiler bookkeeping, no device synchronisation. Writing the trace waits for the device, once, at the
end of the window.

Example:
    >>> import functrain as ft
    >>> profiler = ft.callbacks.Profiler("runs/exp1/profile", wait=10, warmup=2, active=3)
    >>> # ft.fit(state, step, data, callbacks=[profiler]) -> runs/exp1/profile/trace_rank0_step12.json
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from functrain.callbacks.base import Callback, Context

__all__ = ["Profiler"]


class Profiler(Callback):
    """Profile ``warmup + active`` steps after ``wait`` steps of this run; write a Chrome trace (and/or a
    TensorBoard profile).

    Args:
        output_dir: where traces go (e.g. ``<run dir>/profile``); made when the trace is written.
        wait: steps of this run (counted from its first step, also after a resume) before profiling.
        warmup: steps profiled but discarded (the profiler's own start-up cost lands there).
        active: steps recorded in the trace.
        chrome: write ``trace_rank{R}_step{S}.json`` (open in ``chrome://tracing`` or Perfetto), ``S`` the
            first active step.
        tensorboard: also write ``rank{R}.step{S}.pt.trace.json``, the file name TensorBoard's profiler
            plugin reads (``tensorboard --logdir output_dir``).
        activities: ``torch.profiler.ProfilerActivity`` values; default: CPU, plus CUDA when available.
        profiler_kwargs: more ``torch.profiler.profile`` arguments (``record_shapes``, ``profile_memory``,
            ``with_stack``, ...).

    Attributes:
        trace_path: the Chrome trace written (``None`` before the window ends).
    """

    name = "Profiler"

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        wait: int = 5,
        warmup: int = 1,
        active: int = 3,
        chrome: bool = True,
        tensorboard: bool = False,
        activities: Iterable[torch.profiler.ProfilerActivity] | None = None,
        **profiler_kwargs: Any,
    ) -> None:
        for arg, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Profiler: {arg} must be an int >= {low}, got {value!r}")
        if not (chrome or tensorboard):
            raise ValueError("Profiler: chrome and tensorboard are both False; enable one to write a trace")
        self.output_dir = Path(output_dir)
        self.wait, self.warmup, self.active = wait, warmup, active
        self.chrome, self.tensorboard = chrome, tensorboard
        if activities is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.activities = list(activities)
        self.profiler_kwargs = profiler_kwargs
        self.trace_path: Path | None = None
        self._prof: torch.profiler.profile | None = None
        self._first_step = 0
        self._profiled = 0
        self._done = False

    def on_train_begin(self, state: Any, ctx: Context) -> Any:
        self._first_step, self._profiled, self._done = ctx.step, 0, False
        return state

    def on_step_begin(self, state: Any, ctx: Context) -> Any:
        if self._prof is None and not self._done and ctx.step - self._first_step == self.wait:
            self._start(ctx.step)
        return state

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        if self._prof is not None:
            self._prof.step()
            self._profiled += 1
            if self._profiled == self.warmup + self.active:
                self._stop()
        return state

    def on_train_end(self, state: Any, ctx: Context) -> Any:
        if self._prof is not None:  # the run ended inside the window: keep what was recorded
            self._stop()
        return state

    def _start(self, step: int) -> None:
        from functrain import distributed

        first_active = step + self.warmup
        rank = distributed.rank()

        def on_trace_ready(prof: torch.profiler.profile) -> None:
            # Kineto saves a trace once: write one file, copy it for the other format
            self.output_dir.mkdir(parents=True, exist_ok=True)
            chrome_path = self.output_dir / f"trace_rank{rank}_step{first_active}.json"
            tb_path = self.output_dir / f"rank{rank}.step{first_active}.pt.trace.json"  # TensorBoard's naming
            first = chrome_path if self.chrome else tb_path
            prof.export_chrome_trace(str(first))
            if self.chrome and self.tensorboard:
                shutil.copyfile(chrome_path, tb_path)
            if self.chrome:
                self.trace_path = chrome_path

        schedule = torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.active, repeat=1)
        self._prof = torch.profiler.profile(
            activities=self.activities,
            schedule=schedule,
            on_trace_ready=on_trace_ready,
            **self.profiler_kwargs,
        )
        self._prof.start()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        self._done = True
        if prof is not None:
            prof.stop()
