"""Which models run with DTensor params (placed by :mod:`functrain.distributed.tensor_parallel`), and the
switch their forward needs while a step runs: kept apart so that ``functrain.jit`` asks without importing
DTensor (2 s of imports).

Example:
    >>> import torch
    >>> with tensor_parallel_forward(torch.nn.Linear(2, 2)):  # not placed: nothing changes
    ...     pass
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["mark_placed", "tensor_parallel_forward"]

_PLACED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def mark_placed(model: nn.Module) -> None:
    """Record that ``model``'s params are DTensors in some state (``TensorParallel.place``)."""
    _PLACED.add(model)


@contextlib.contextmanager
def tensor_parallel_forward(model: Any) -> Iterator[None]:
    """While a step of a model whose params were placed as DTensors is traced or run, plain tensors (the
    batch, masks its forward makes) meet them as replicated (DTensor's implicit replication). Entered by
    ``functrain.jit`` outside the compiled call: dynamo cannot trace the switch. Nothing for other models."""
    if not (isinstance(model, nn.Module) and model in _PLACED):
        yield
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    if DTensor._op_dispatcher._allow_implicit_replication:  # entered already: torch's switch, left, turns
        yield  # it off, not back to what it was (a step entering it inside jit's would end jit's)
        return
    with implicit_replication():
        yield
