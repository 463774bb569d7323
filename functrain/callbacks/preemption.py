"""Preemption: SIGTERM or SIGINT saves a checkpoint and ends the run cleanly; the next fit resumes."""

from __future__ import annotations

import signal
from typing import Any

from functrain.callbacks.base import Callback, Context
from functrain.compile import interrupt

__all__ = ["Preemption"]


class Preemption(Callback):
    """On SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C), finish the current step, save a
    checkpoint and stop. A step that is compiling stops compiling and runs eagerly instead
    (:mod:`functrain.compile.interrupt`), so the run stops within seconds. ``fit`` then returns with ``result.preempted``; run it again with
    ``resume_from_checkpoint=True`` to continue exactly where it stopped.

    The handlers are installed at train begin and the previous ones restored at train end.

    Example:
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> def sigterm_in_step_2(state, batch):  # as a scheduler would, during the second step
        ...     if int(state.step) == 1:
        ...         signal.raise_signal(signal.SIGTERM)
        ...     return step(state, batch)
        >>> import os, tempfile
        >>> run_dir = tempfile.TemporaryDirectory()
        >>> result = ft.fit(state, sigterm_in_step_2, data, batch_size=16, epochs=1, checkpoints=run_dir.name,
        ...                 progress_bar=False, callbacks=[Preemption()])
        >>> result.preempted, int(result.state.step), os.listdir(run_dir.name)
        (True, 2, ['step_0000000002.ckpt'])
        >>> run_dir.cleanup()
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C interrupts at once
        self.received = signum
        if interrupt.under_way():  # a compile would finish the step in minutes: abandon it now
            raise interrupt.CompileInterrupted(signum)

    def on_train_begin(self, state: Any, ctx: Context) -> Any:
        self.received = None
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)
        except ValueError:  # not the main thread: signals cannot be handled here
            self._previous.clear()
        return state

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        if self.received is not None:
            ctx.control.save()
            ctx.control.stop(f"preempted by {signal.Signals(self.received).name}", final=False)
        return state

    def on_train_end(self, state: Any, ctx: Context) -> Any:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        return state
