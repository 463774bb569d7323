"""`History`: the run's scalar store, written by any part of a run without a host sync.

``put`` keeps 0-d tensors as they are; the first read (or ``flush``) converts every pending tensor
with one ``torch.stack(...).tolist()`` per device, so logging a step's loss never stalls the GPU.
Its content is plain lists of ints and floats (:meth:`History.as_dict`), saved in checkpoints as is.

Example:
    >>> import torch
    >>> h = History()
    >>> h.put("loss", torch.tensor(0.5), step=1)
    >>> h.put("loss", 0.25, step=2)
    >>> h.series("loss")
    [(1, 0.5), (2, 0.25)]
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["History", "to_floats"]

Number = int | float


def _check_scalar(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"scalar {name!r} must be a number or a one-element tensor, got shape {tuple(value.shape)}"
            )
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"scalar {name!r} must be a number or a 0-d tensor, got {type(value).__name__}")


def to_floats(values: list[Any]) -> list[float]:
    """Numbers and one-element tensors as Python floats, with one host transfer per device.

    Example:
        >>> to_floats([1, torch.tensor(2.5)])
        [1.0, 2.5]
    """
    out: list[float | None] = [None if isinstance(v, torch.Tensor) else float(v) for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for indices in by_device.values():
        stacked = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in indices])
        for i, f in zip(indices, stacked.tolist()):  # the one sync for this device
            out[i] = f
    return out  # type: ignore[return-value]


class History:
    """Scalar series by name: ``put(name, value, step)``, then ``latest``, ``series``, ``as_dict``.

    ``value`` and ``step`` may be 0-d tensors (e.g. ``state.step``); they stay tensors until read.

    Example:
        >>> h = History()
        >>> h.put("eval/accuracy", 0.9, step=100)
        >>> h.latest("eval/accuracy"), h.names()
        (0.9, ['eval/accuracy'])
    """

    def __init__(self) -> None:
        self._steps: dict[str, list[int]] = {}
        self._values: dict[str, list[float]] = {}
        self._pending: list[tuple[str, Any, Any]] = []

    def put(self, name: str, value: float | torch.Tensor, step: int | torch.Tensor) -> None:
        """Record ``value`` for ``name`` at ``step``; tensors are not converted here (no host sync)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"History.put: name must be a non-empty string, got {name!r}")
        _check_scalar(name, value)
        _check_scalar(f"{name} step", step)
        self._pending.append((name, value, step))

    def put_scalars(self, scalars: Mapping[str, float | torch.Tensor], step: int | torch.Tensor) -> None:
        """``put`` every ``{name: value}`` at one step."""
        for name, value in scalars.items():
            self.put(name, value, step)

    def flush(self) -> None:
        """Convert every pending tensor to a float, with one host transfer per device."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        numbers = to_floats([x for _, value, step in pending for x in (value, step)])
        for k, (name, _, _) in enumerate(pending):
            self._steps.setdefault(name, []).append(int(numbers[2 * k + 1]))
            self._values.setdefault(name, []).append(numbers[2 * k])

    def _known(self, name: str) -> None:
        self.flush()
        if name not in self._values:
            close = difflib.get_close_matches(name, list(self._values), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {sorted(self._values)}"
            raise KeyError(f"no scalar named {name!r} in the history{hint}")

    def names(self) -> list[str]:
        """Every recorded name, sorted."""
        self.flush()
        return sorted(self._values)

    def latest(self, name: str) -> float:
        """The last value recorded for ``name``."""
        self._known(name)
        return self._values[name][-1]

    def series(self, name: str) -> list[tuple[int, float]]:
        """``[(step, value), ...]`` for ``name`` in the order recorded."""
        self._known(name)
        return list(zip(self._steps[name], self._values[name]))

    def at(self, step: int) -> dict[str, float]:
        """Every name's value recorded at ``step`` (its last entry, when that entry is at ``step``).

        Example:
            >>> h = History()
            >>> h.put("loss", 0.5, 10); h.put("lr", 0.1, 10); h.put("loss", 0.4, 20)
            >>> h.at(10), h.at(20)
            ({'lr': 0.1}, {'loss': 0.4})
        """
        self.flush()
        return {
            n: self._values[n][-1]
            for n in sorted(self._values)
            if self._steps[n] and self._steps[n][-1] == step
        }

    def as_dict(self) -> dict[str, dict[str, list[Any]]]:
        """``{name: {"steps": [int], "values": [float]}}``: plain data for checkpoints (msgpack, JSON)."""
        self.flush()
        return {
            n: {"steps": list(self._steps[n]), "values": list(self._values[n])} for n in sorted(self._values)
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, list[Any]]]) -> History:
        """Rebuild a history saved with :meth:`as_dict`.

        Example:
            >>> History.from_dict({"loss": {"steps": [1], "values": [0.5]}}).latest("loss")
            0.5
        """
        history = cls()
        for name, series in data.items():
            steps, values = series.get("steps"), series.get("values")
            if not isinstance(steps, list) or not isinstance(values, list) or len(steps) != len(values):
                raise ValueError(f"History.from_dict: {name!r} needs equal-length 'steps' and 'values' lists")
            history._steps[name] = [int(s) for s in steps]
            history._values[name] = [float(v) for v in values]
        return history

    def truncate(self, after_step: int) -> None:
        """Drop every entry with step > ``after_step`` (resuming from a checkpoint taken at that step)."""
        self.flush()
        for name in list(self._values):
            keep = [i for i, s in enumerate(self._steps[name]) if s <= after_step]
            self._steps[name] = [self._steps[name][i] for i in keep]
            self._values[name] = [self._values[name][i] for i in keep]
            if not keep:
                del self._steps[name], self._values[name]

    def __repr__(self) -> str:
        return f"History(names={sorted(self._values)}, pending={len(self._pending)})"
