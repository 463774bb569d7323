"""`Average`: an example-weighted mean, the metric for losses.

A dataset's mean loss is ``sum(loss_i * n_i) / sum(n_i)`` over batches, not the mean of batch means:
a short last batch must count for its few examples only. The state is two sums, so merging batches or
ranks is addition.

Example:
    >>> import torch
    >>> avg = Average("loss")
    >>> s = avg.update(avg.empty(), loss=torch.tensor(1.0), num_examples=3)
    >>> s = avg.update(s, loss=torch.tensor(5.0), num_examples=1)
    >>> float(avg.compute(s))
    2.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from functrain import tree
from functrain.metrics.base import require_input

__all__ = ["Average", "AverageState"]


@tree.struct
class AverageState:
    """Running ``total`` and ``count`` of an average; both are sum-reducible 0-d tensors.

    Example:
        >>> AverageState(torch.tensor(6.0), torch.tensor(3.0)).count
        tensor(3.)
    """

    total: torch.Tensor
    count: torch.Tensor


def _as_weight(weight: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        if weight.ndim != 0:
            raise ValueError(
                f"num_examples must be a number or a 0-d tensor, got shape {tuple(weight.shape)}"
            )
        return weight.detach().to(dtype=dtype, device=device)
    return torch.tensor(float(weight), dtype=dtype, device=device)


@dataclasses.dataclass(frozen=True)
class Average:
    """Example-weighted mean of the input named ``of`` (``"loss"`` by default).

    A 0-d value is a batch mean: it is weighted by ``num_examples`` (1 when not given). A value with
    dimensions holds one entry per example: every entry counts once, or by ``mask`` when given (so the
    padding of a fixed-shape batch is left out). ``compute`` of an empty state is ``nan``.

    Example:
        >>> import torch
        >>> avg = Average("loss")
        >>> s = avg.update(avg.empty(), loss=torch.tensor([1.0, 2.0, 9.0]), mask=torch.tensor([1, 1, 0]))
        >>> float(avg.compute(s))
        1.5
    """

    of: str = "loss"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.of, str) or not self.of:
            raise TypeError(f"Average(of=...) must name an input such as 'loss', got {self.of!r}")
        if not self.dtype.is_floating_point:
            raise TypeError(f"Average(dtype=...) must be a floating dtype, got {self.dtype}")

    def empty(self, device: torch.device | str | None = None) -> AverageState:
        zero = torch.zeros((), dtype=self.dtype, device=device)
        return AverageState(total=zero, count=zero.clone())

    def update(self, state: AverageState, **inputs: Any) -> AverageState:
        value = require_input(inputs, self.of, "Average", "a 0-d batch mean or one value per example")
        device = state.total.device
        value = torch.as_tensor(value, device=device).detach().to(self.dtype)
        mask = inputs.get("mask")
        if value.ndim == 0:
            num_examples = inputs.get("num_examples")
            weight = _as_weight(1 if num_examples is None else num_examples, self.dtype, device)
            total, count = value * weight, weight
        elif mask is None:
            total = value.sum()
            count = torch.tensor(float(value.numel()), dtype=self.dtype, device=device)
        else:
            weight = mask.detach().to(self.dtype)
            # A per-example mask broadcasts over trailing dims (e.g. per-token losses).
            weight = weight.reshape(weight.shape + (1,) * (value.ndim - weight.ndim)).expand_as(value)
            total, count = (value * weight).sum(), weight.sum()
        return AverageState(total=state.total + total, count=state.count + count)

    def merge(self, a: AverageState, b: AverageState) -> AverageState:
        return AverageState(total=a.total + b.total, count=a.count + b.count)

    def reductions(self) -> AverageState:
        return AverageState(total="sum", count="sum")  # type: ignore[arg-type]

    def compute(self, state: AverageState) -> torch.Tensor:
        return state.total / state.count
