"""The short last training batch, run eagerly: one compile of the train step for any dataset length.

A train step compiled at the batch size recompiles for the shorter last batch of a set that is not a
multiple of it (a second compile, as long as the first). Padding that batch (``pad_train_batches``) keeps
the shape, but is exact only where each example's loss depends on its own row: BatchNorm's batch
statistics would take in the padded rows (refused), and a mean loss with dropout is corrected with
another dropout draw. Run eagerly, the short batch is the unpadded batch itself, exactly as eager
PyTorch computes it, BatchNorm included, for the cost of one eager step per epoch (milliseconds, where a
compile is tens of seconds on a CPU). Compiled and eager steps differ by float rounding and draw
different dropout masks from the same seed (:func:`functrain.jit`); the choice depends on the batch's
shape only, so a resumed run makes it again.

Example:
    >>> step = EagerShortBatches(train_step, rows=32)  # doctest: +SKIP
    >>> state, metrics = step(state, full_batch)  # compiles  # doctest: +SKIP
    >>> state, metrics = step(state, last_batch)  # fewer rows: eagerly, no second compile  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from functrain.jit import CompiledStep
from functrain.step.batch import is_short

__all__ = ["EagerShortBatches"]


class EagerShortBatches(CompiledStep):
    """A :class:`functrain.jit.CompiledStep` that runs a batch of fewer than ``rows`` examples eagerly
    (seeded and donated as a compiled call) instead of compiling a second graph; ``jit_options``:
    :func:`functrain.jit`'s arguments."""

    def __init__(self, fn: Any, *, rows: int, **jit_options: Any) -> None:
        super().__init__(fn, **jit_options)
        self.rows = rows

    def __call__(self, state: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.compile or not is_short(batch, self.rows):
            return super().__call__(state, batch, *args, **kwargs)
        self.compile = False  # CompiledStep's eager path: seeded and donated as a compiled call
        try:
            return super().__call__(state, batch, *args, **kwargs)
        finally:
            self.compile = True
