"""What ``fit`` was asked, in one frozen, checked record: :class:`FitOptions`.

Example:
    >>> options = FitOptions(RunLength(epochs=2), batch_size=32, save_every=100)
    >>> options.saves.due(step=200, epoch_done=False)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from functrain.callbacks.base import Callback
from functrain.logging import History
from functrain.loop.length import RunLength
from functrain.loop.schedule import Every

__all__ = ["FitOptions"]


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """``fit``'s parameters besides the state, the step and the data; checked when made, so that every
    refusal comes before the first step.

    ``length``: how long (:class:`RunLength`); ``batch_size``/``eval_batch_size``: for data given as a
    dataset; ``eval_step``/``eval_data``: evaluation, both or neither; ``eval_every``/``save_every``: when (as
    :class:`Every` schedules: ``evals``, ``saves``); ``log_steps``: log every this many steps; ``resume``: ``fit``'s
    ``resume_from_checkpoint``; ``progress_bar``: add a bar when no callback is one; ``callbacks``,
    ``loggers``, ``checkpoints`` (a manager, a directory or ``None``) and ``history`` as ``fit`` takes them;
    ``check_batches``: with tensor parallelism, compare the batch over each tp group on the ``"first"``
    step of the call or on ``"every"`` step.

    Example:
        >>> FitOptions(RunLength(max_steps=100), eval_every=10).evals  # no eval_step: never evaluates
        Every(steps=None, epoch=False)
    """

    length: RunLength
    batch_size: int | None = None
    eval_step: Callable[[Any, Any], Mapping[str, Any]] | None = None
    eval_data: Any = None
    eval_batch_size: int | None = None
    eval_every: int | str | None = "epoch"
    save_every: int | str | None = None
    log_steps: int = 50
    resume: bool | int | str = False
    progress_bar: bool = True
    callbacks: tuple[Callback, ...] = ()
    loggers: tuple[Any, ...] = ()
    checkpoints: Any = None
    history: History | None = None
    check_batches: Literal["first", "every"] = "first"
    evals: Every = dataclasses.field(init=False)  # eval_every (never without an eval_step) and save_every
    saves: Every = dataclasses.field(init=False)  # as schedules

    def __post_init__(self) -> None:
        log_steps = self.log_steps
        if not isinstance(log_steps, int) or isinstance(log_steps, bool) or log_steps < 1:
            raise ValueError(f"fit: log_steps must be a positive int, got {log_steps!r}")
        if self.check_batches not in ("first", "every"):
            raise ValueError(f"fit: check_batches must be 'first' or 'every', got {self.check_batches!r}")
        if (self.eval_step is None) != (self.eval_data is None):
            raise ValueError("fit: eval_step and eval_data go together (give both or neither)")
        evals = Every.parse(self.eval_every if self.eval_step is not None else None, "eval_every")
        object.__setattr__(self, "evals", evals)  # frozen: set once, here
        object.__setattr__(self, "saves", Every.parse(self.save_every, "save_every"))
