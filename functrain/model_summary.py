"""A model summary: params per module (trainable / frozen), buffers, dtypes and bytes, with totals.

``print(ft.summary(model))`` is Keras' ``model.summary()`` / Lightning's ``ModelSummary`` for a module or a
``TrainState``. Tied weights (one tensor under several names) are counted once, under their first name,
and listed. Frozen parameters are those with ``requires_grad=False`` and those named in ``frozen=``:
``functrain.optim.freeze`` lives inside the optimizer, which keeps no record of its mask, so pass the
same mask (or names) here; the :class:`functrain.Trainer` passes its ``freeze`` config.

Example:
    >>> import torch, functrain as ft
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    >>> s = ft.summary(net, frozen=["0.*"])
    >>> s.total.params, s.total.trainable, s.total.frozen, s.total.buffers
    (25, 10, 15, 7)
    >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
    module  type         params  trainable  frozen  buffers  dtype          bytes
    0       Linear           15          0      15        0  float32           60
    1       BatchNorm1d       6          6       0        7  float32,int64     56
    2       Linear            4          4       0        0  float32           16
    total                    25         10      15        7                   132
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from functrain.optim.selection import mask_by_name

__all__ = ["ModelSummary", "SummaryRow", "summary"]


@dataclasses.dataclass
class SummaryRow:
    """One module's line: parameter elements (trainable / frozen), buffer elements, dtypes, bytes."""

    module: str
    type: str = ""
    params: int = 0
    trainable: int = 0
    frozen: int = 0
    buffers: int = 0
    dtypes: tuple[str, ...] = ()
    bytes: int = 0

    def add(self, tensor: torch.Tensor, kind: str) -> None:
        n = tensor.numel()
        if kind == "buffer":
            self.buffers += n
        else:
            self.params += n
            if kind == "frozen":
                self.frozen += n
            else:
                self.trainable += n
        self.bytes += n * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in self.dtypes:
            self.dtypes = (*self.dtypes, dtype)


@dataclasses.dataclass
class ModelSummary:
    """Rows per module, the totals, and the tied names ``(alias, counted_as)``; ``str()`` is the table."""

    rows: list[SummaryRow]
    total: SummaryRow
    tied: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        header = ("module", "type", "params", "trainable", "frozen", "buffers", "dtype", "bytes")
        lines = [_cells(r) for r in self.rows]
        total = _cells(self.total)
        total[6] = ""
        table = [list(header), *lines, total]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        numeric = {2, 3, 4, 5, 7}
        out = [
            "  ".join(
                c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
            for row in table
        ]
        for alias, canonical in self.tied:
            out.append(f"tied: {alias} is {canonical} (counted once)")
        return "\n".join(out)


def _cells(row: SummaryRow) -> list[str]:
    return [
        row.module,
        row.type,
        str(row.params),
        str(row.trainable),
        str(row.frozen),
        str(row.buffers),
        ",".join(row.dtypes),
        str(row.bytes),
    ]


def _frozen_names(frozen: Any, names: Iterable[str]) -> set[str]:
    """Names frozen by ``frozen``: a mask ``{name: bool}``, or patterns (names, fnmatch globs, compiled
    regular expressions) as :func:`functrain.optim.mask_by_name` matches them."""
    names = list(names)
    if frozen is None:
        return set()
    if isinstance(frozen, Mapping):
        unknown = sorted(set(frozen) - set(names))
        if unknown:
            raise ValueError(f"summary: frozen names {unknown[:5]} are not parameters of the model")
        return {k for k, v in frozen.items() if bool(v)}
    try:
        mask = mask_by_name(dict.fromkeys(names, True), frozen)
    except (TypeError, ValueError) as error:
        raise type(error)(f"summary: frozen must be a {{name: bool}} mask or patterns: {error}") from None
    return {name for name, hit in mask.items() if hit}


def _module_of(name: str, max_depth: int | None) -> str:
    parts = name.split(".")[:-1]
    if max_depth is not None:
        parts = parts[:max_depth]
    return ".".join(parts) or "(root)"


def summary(target: Any, *, frozen: Any = None, max_depth: int | None = None) -> ModelSummary:
    """A :class:`ModelSummary` of an ``nn.Module`` or a :class:`functrain.TrainState`.

    Args:
        target: a module (its parameters and buffers) or a train state (``params`` are trainable,
            ``buffers`` hold buffers and ``requires_grad=False`` parameters, reported as buffers
            unless ``frozen`` names them; dtypes and bytes are the state's).
        frozen: parameters to report as frozen, besides ``requires_grad=False`` ones: a ``{name: bool}``
            mask (as given to ``functrain.optim.freeze``) or names / fnmatch globs.
        max_depth: group by the first ``max_depth`` levels of the module path (1: top-level children);
            default: the module that owns each tensor.

    Example:
        >>> import torch
        >>> summary(torch.nn.Linear(2, 3)).total.params
        9
    """
    if max_depth is not None and (
        isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1
    ):
        raise ValueError(f"summary: max_depth must be an int >= 1 or None, got {max_depth!r}")
    entries: list[tuple[str, torch.Tensor, str]] = []  # (name, tensor, 'trainable' | 'frozen' | 'buffer')
    types: dict[str, str] = {}
    tied: list[tuple[str, str]] = []
    if isinstance(target, nn.Module):
        seen: dict[int, str] = {}
        params = []
        for name, p in target.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                tied.append((name, seen[id(p)]))
                continue
            seen[id(p)] = name
            params.append((name, p))
        frozen_set = _frozen_names(frozen, [n for n, _ in params])
        for name, p in params:
            entries.append((name, p, "frozen" if not p.requires_grad or name in frozen_set else "trainable"))
        for name, b in target.named_buffers(remove_duplicate=False):
            if id(b) in seen:
                if seen[id(b)] != name:
                    tied.append((name, seen[id(b)]))
                continue
            seen[id(b)] = name
            entries.append((name, b, "buffer"))
        types = {name or "(root)": type(m).__name__ for name, m in target.named_modules()}
    elif hasattr(target, "params") and hasattr(target, "buffers"):
        names = [*target.params, *target.buffers]
        frozen_set = _frozen_names(frozen, names)
        for name, p in target.params.items():
            entries.append((name, p, "frozen" if name in frozen_set else "trainable"))
        for name, b in target.buffers.items():
            entries.append((name, b, "frozen" if name in frozen_set else "buffer"))
        tied = list(getattr(target, "tied", ()))
    else:
        raise TypeError(f"summary: expected an nn.Module or a TrainState, got {type(target).__name__}")

    rows: dict[str, SummaryRow] = {}
    total = SummaryRow("total")
    for name, tensor, kind in entries:
        module = _module_of(name, max_depth)
        row = rows.setdefault(module, SummaryRow(module, types.get(module, "")))
        row.add(tensor, kind)
        total.add(tensor, kind)
    return ModelSummary(rows=list(rows.values()), total=total, tied=tuple(tied))
