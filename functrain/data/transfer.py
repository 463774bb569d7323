"""Moving batches to a device: ``to_device`` and ``pin_memory`` over any pytree.

Example:
    >>> import torch
    >>> to_device({"x": torch.ones(2), "name": ["a", "b"]}, "cpu")["x"].device
    device(type='cpu')
"""

from __future__ import annotations

from typing import Any

import torch

from functrain import tree

__all__ = ["pin_memory", "to_device"]


def to_device(batch: Any, device: str | torch.device | None, non_blocking: bool = True) -> Any:
    """Copy every tensor leaf of ``batch`` to ``device`` (other leaves are kept); ``None`` is a no-op.

    ``non_blocking`` applies only to host -> accelerator copies: a non-blocking copy *to* the CPU
    returns before the data has arrived, and nothing downstream would wait for it.

    Example:
        >>> to_device((torch.zeros(1), 3), torch.device("cpu"))
        (tensor([0.]), 3)
    """
    if device is None:
        return batch
    target = torch.device(device)
    asynchronous = non_blocking and target.type != "cpu"

    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(target, non_blocking=asynchronous)
        return leaf

    return tree.map(move, batch)


def pin_memory(batch: Any) -> Any:
    """Page-lock every CPU tensor leaf so host -> GPU copies can run asynchronously.

    Example:
        >>> batch = pin_memory({"x": torch.ones(2)}) if torch.cuda.is_available() else {"x": torch.ones(2)}
    """

    def pin(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and not leaf.is_pinned():
            return leaf.pin_memory()
        return leaf

    return tree.map(pin, batch)
