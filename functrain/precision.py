"""Mixed precision: autocast settings and fp16 dynamic loss scaling kept as pure state.

``bf16`` needs no scaling: the step runs forward and loss under ``torch.autocast(dtype=bfloat16)`` while
params and optimizer state stay in float32. ``fp16`` adds a :class:`LossScale` to the train state: the loss
is multiplied by ``scale`` before differentiation and the gradients divided by it after; when any gradient
is not finite the update is skipped (params and optimizer state kept, selected with ``torch.where``, no
branch) and the scale is halved; after ``growth_interval`` finite steps in a row it doubles.

Example:
    >>> import functrain as ft
    >>> ls = ft.precision.LossScale.create(init_scale=2.0**15)
    >>> float(ls.scale)
    32768.0
"""

from __future__ import annotations

from typing import Literal

import torch

from functrain import tree

Precision = Literal["no", "fp32", "bf16", "fp16"]

__all__ = ["LossScale", "Precision", "autocast_dtype"]


def autocast_dtype(precision: str | None) -> torch.dtype | None:
    """The autocast dtype for a precision name (``None`` for full precision).

    Example:
        >>> autocast_dtype("bf16")
        torch.bfloat16
    """
    table = {None: None, "no": None, "fp32": None, "32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in table:
        raise ValueError(f"precision must be one of 'no', 'bf16', 'fp16', got {precision!r}")
    return table[precision]


@tree.struct
class LossScale:
    """Dynamic loss scale for fp16 training (pure state, updated inside the compiled step).

    Fields: ``scale`` (0-d float32), ``good_steps`` (finite steps since the last change, 0-d int64),
    ``skipped`` (total updates skipped because of overflow, 0-d int64); static ``growth_interval``,
    ``factor`` and ``min_scale``.
    """

    scale: torch.Tensor
    good_steps: torch.Tensor
    skipped: torch.Tensor
    growth_interval: int = tree.field(static=True, default=2000)
    factor: float = tree.field(static=True, default=2.0)
    min_scale: float = tree.field(static=True, default=1.0)

    @classmethod
    def create(
        cls,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        factor: float = 2.0,
        min_scale: float = 1.0,
    ) -> LossScale:
        """A loss scale starting at ``init_scale``.

        Example:
            >>> LossScale.create(1024.0, growth_interval=100).growth_interval
            100
        """
        if init_scale <= 0 or factor <= 1 or growth_interval < 1:
            raise ValueError(
                f"LossScale: need init_scale > 0, factor > 1, growth_interval >= 1; got {init_scale}, "
                f"{factor}, {growth_interval}"
            )
        return cls(
            scale=torch.tensor(float(init_scale), dtype=torch.float32),
            good_steps=torch.zeros((), dtype=torch.int64),
            skipped=torch.zeros((), dtype=torch.int64),
            growth_interval=growth_interval,
            factor=factor,
            min_scale=min_scale,
        )

    def adjust(self, finite: torch.Tensor) -> LossScale:
        """The next scale after a step whose gradients were ``finite`` (a 0-d bool tensor)."""
        good = torch.where(finite, self.good_steps + 1, torch.zeros_like(self.good_steps))
        grow = good >= self.growth_interval
        scale = torch.where(
            finite,
            torch.where(grow, self.scale * self.factor, self.scale),
            torch.clamp(self.scale / self.factor, min=self.min_scale),
        )
        return self.replace(
            scale=scale,
            good_steps=torch.where(grow, torch.zeros_like(good), good),
            skipped=self.skipped + (~finite).to(self.skipped.dtype),
        )

    def __repr__(self) -> str:
        return f"LossScale(scale={float(self.scale):g}, good_steps={int(self.good_steps)}, skipped={int(self.skipped)})"
