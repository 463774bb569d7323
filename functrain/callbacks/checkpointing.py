"""ModelCheckpoint: save every N steps or epochs, keep the best by a monitored metric, retain a few."""

from __future__ import annotations

import os
from typing import Any, Literal

from functrain.callbacks.base import Callback, Context

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(Callback):
    """Save checkpoints of the run (state, data position, callback states, history) into ``directory``.

    When to save: every ``every_n_steps`` steps and/or every ``every_n_epochs`` epochs, and after each
    evaluation when ``monitor`` is set (so the best can be kept). Retention is the
    :class:`functrain.checkpoint.CheckpointManager`'s: the newest always, the last ``keep_last``, and the
    ``keep_best`` best by ``monitor`` (``mode`` ``"min"``/``"max"``), independently.

    ``fit`` resumes from this callback's directory when it is given no ``checkpoints=`` of its own.

    Example:
        >>> ckpt = ModelCheckpoint("runs/a/checkpoints", every_n_epochs=1, monitor="eval/accuracy", mode="max")
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = 1,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_last: int | None = 3,
        keep_best: int = 1,
        async_save: bool = False,
    ) -> None:
        from functrain.checkpoint import CheckpointManager

        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 1:
                raise ValueError(f"ModelCheckpoint: {name} must be >= 1 or None, got {value}")
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.monitor = monitor
        self.manager = CheckpointManager(
            directory,
            max_to_keep=keep_last,
            best_metric=monitor,
            best_mode=mode,
            keep_best=keep_best if monitor else 0,
            async_save=async_save,
        )

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        if self.every_n_steps and ctx.step % self.every_n_steps == 0:
            ctx.control.save()
        epoch_done = ctx.batches_per_epoch is not None and ctx.batch_index == ctx.batches_per_epoch
        if self.every_n_epochs and epoch_done and (ctx.epoch + 1) % self.every_n_epochs == 0:
            ctx.control.save()
        return state

    def on_eval_end(self, state: Any, ctx: Context) -> Any:
        if self.monitor is not None:
            if self.monitor not in (ctx.eval_metrics or {}):
                raise KeyError(
                    f"ModelCheckpoint: monitored metric {self.monitor!r} is not among the evaluation results "
                    f"{sorted(ctx.eval_metrics or {})}; set monitor= to one of them"
                )
            ctx.control.save()
        return state
