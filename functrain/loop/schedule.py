"""When the loop logs, evaluates and saves: CLU-style periodic actions, ``Every(n)`` steps or
``Every("epoch")``.

Example:
    >>> every = Every.parse(100, "save_every")
    >>> every.due(step=200, epoch_done=False), every.due(step=250, epoch_done=True)
    (True, False)
    >>> Every.parse("epoch", "eval_every").due(step=7, epoch_done=True)
    True
"""

from __future__ import annotations

import dataclasses

__all__ = ["Every"]


@dataclasses.dataclass(frozen=True)
class Every:
    """Due every ``steps`` optimizer steps, or at each epoch's end (``epoch=True``); neither: never."""

    steps: int | None = None
    epoch: bool = False

    @classmethod
    def parse(cls, value: int | str | None, name: str) -> Every:
        """``Every`` from ``int`` steps, ``"epoch"`` or ``None``/``"no"`` (never); ``name`` for errors."""
        if value is None or value == "no":
            return cls()
        if value == "epoch":
            return cls(epoch=True)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return cls(steps=value)
        raise ValueError(f"fit: {name} must be a positive number of steps, 'epoch' or None, got {value!r}")

    def due(self, step: int, epoch_done: bool) -> bool:
        """Whether the action is due after optimizer step ``step`` (``epoch_done``: it ended an epoch)."""
        return bool(self.steps and step % self.steps == 0) or (self.epoch and epoch_done)
