"""`Accuracy`: the fraction of examples whose target is among the top-k logits.

Counts are kept as int64 sums (exact at any dataset size) in an :class:`AverageState`.

Example:
    >>> import torch
    >>> acc = Accuracy(top_k=2)
    >>> logits = torch.tensor([[0.1, 0.5, 0.4], [0.9, 0.02, 0.08]])
    >>> float(acc.compute(acc.update(acc.empty(), preds=logits, target=torch.tensor([2, 1]))))
    0.5
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from functrain.metrics.average import AverageState
from functrain.metrics.base import require_input

__all__ = ["Accuracy"]


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """Top-k accuracy from logits ``preds`` of shape ``(..., num_classes)`` and labels ``target`` ``(...)``.

    ``preds`` may also be labels with the shape of ``target`` (``top_k`` must then be 1). An optional
    ``mask`` (shape of ``target``, or one entry per example) leaves padded examples out. ``compute`` of
    an empty state is ``nan``.

    Example:
        >>> import torch
        >>> acc = Accuracy()
        >>> s = acc.update(acc.empty(), preds=torch.tensor([[3.0, 1.0]]), target=torch.tensor([1]))
        >>> float(acc.compute(s))
        0.0
    """

    top_k: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"Accuracy(top_k=...) must be an integer >= 1, got {self.top_k!r}")

    def empty(self, device: torch.device | str | None = None) -> AverageState:
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return AverageState(total=zero, count=zero.clone())

    def update(self, state: AverageState, **inputs: Any) -> AverageState:
        preds = require_input(inputs, "preds", "Accuracy", "logits of shape (..., num_classes)").detach()
        target = require_input(inputs, "target", "Accuracy", "integer labels of shape (...)").detach()
        if preds.shape == target.shape:
            if self.top_k != 1:
                raise ValueError(
                    f"Accuracy(top_k={self.top_k}) needs logits, but preds has the shape of target"
                )
            correct = preds.long() == target.long()
        elif preds.shape[:-1] == target.shape:
            if self.top_k > preds.shape[-1]:
                raise ValueError(
                    f"Accuracy(top_k={self.top_k}) exceeds the {preds.shape[-1]} classes in preds"
                )
            if self.top_k == 1:
                correct = preds.argmax(-1) == target.long()
            else:
                top = preds.topk(self.top_k, dim=-1).indices
                correct = (top == target.long().unsqueeze(-1)).any(-1)
        else:
            raise ValueError(
                f"Accuracy: preds of shape {tuple(preds.shape)} do not match target of shape "
                f"{tuple(target.shape)}; expected preds (..., num_classes) with target (...)"
            )
        mask = inputs.get("mask")
        if mask is None:
            hits = correct.sum()
            count = torch.tensor(correct.numel(), dtype=torch.int64, device=correct.device)
        else:
            # A per-example mask (``[batch]``) broadcasts over the trailing dims (e.g. per-token labels).
            weight = mask.detach().to(torch.int64)
            weight = weight.reshape(weight.shape + (1,) * (correct.ndim - weight.ndim)).expand_as(correct)
            hits, count = (correct.to(torch.int64) * weight).sum(), weight.sum()
        return AverageState(total=state.total + hits, count=state.count + count)

    def merge(self, a: AverageState, b: AverageState) -> AverageState:
        return AverageState(total=a.total + b.total, count=a.count + b.count)

    def reductions(self) -> AverageState:
        return AverageState(total="sum", count="sum")  # type: ignore[arg-type]

    def compute(self, state: AverageState) -> torch.Tensor:
        return (state.total.double() / state.count.double()).float()
