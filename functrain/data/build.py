"""One way from what a user passes (a ``Loader``, a torch ``DataLoader``, a dataset) to a :class:`Loader`: the
loop's ``fit``/``evaluate``/``predict`` and the ``Trainer`` both build theirs here.

Example:
    >>> import torch
    >>> from functrain import random
    >>> len(as_loader(torch.arange(10.0), 4, random.key(0), "fit", shuffle=True))  # batches an epoch
    3
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from functrain import distributed
from functrain.data.loader import Loader
from functrain.data.sources import is_stream

__all__ = ["as_loader"]


def as_loader(
    data: Any,
    batch_size: int | None,
    key: torch.Tensor | None = None,
    what: str = "Loader",
    *,
    shuffle: bool,
    shard: bool = False,
    ranks: tuple[int, int] | None = None,
    device: torch.device | None = None,
    options: Mapping[str, Any] | None = None,
) -> Loader:
    """A Loader over ``data`` whose batches arrive on ``device`` (a Loader with a device of its own keeps it).

    A ``Loader`` is used as it is (moved to ``device`` when it has none), a ``DataLoader`` is wrapped, a
    dataset is batched by ``batch_size``: shuffled by ``key`` when ``shuffle``, each rank reading its slice
    of the same per-epoch permutation when ``shard`` (``batch_size`` is per rank; ``ranks``: the
    ``(rank, world_size)`` slice to read, default this process among all: tensor parallelism's tp groups
    read one slice each, :mod:`functrain.distributed.data_ranks`). ``options`` are the
    dataset Loader's own arguments (``drop_last``, ``collate_fn``, ``num_workers``, ``pin_memory``,
    ``device``: the Trainer's config), used as they are; without them, on CUDA the host batches are pinned
    and copied without blocking, ahead of the step, by the Loader's prefetch thread, and a stream (an
    iterable dataset) is read in its own order.

    Example:
        >>> len(as_loader([1, 2, 3], 2, what="evaluate", shuffle=False))
        2
    """
    if isinstance(data, Loader):
        return data.to(device) if device is not None and data.device is None else data
    if batch_size is None and not isinstance(data, torch.utils.data.DataLoader):
        raise ValueError(
            f"{what}: give a functrain.data.Loader, a torch DataLoader, or a dataset together with "
            "batch_size=..."
        )
    if isinstance(data, torch.utils.data.DataLoader):
        return Loader(data, device=device)
    rank, world = ranks if ranks is not None else (distributed.rank(), distributed.world_size())
    sliced = {"rank": rank, "world_size": world} if shard else {}
    if options is not None:
        return Loader(data, batch_size, key=key, shuffle=shuffle, **sliced, **options)
    pin = device is not None and device.type == "cuda"
    if is_stream(data):  # read in its own order; the key seeds its workers
        return Loader(data, batch_size, key=key, pin_memory=pin, device=device)
    return Loader(data, batch_size, key=key, shuffle=shuffle, pin_memory=pin, device=device, **sliced)
