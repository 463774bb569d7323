"""Which examples each batch holds: the per-epoch order and its split into per-rank batches.

Everything here is a pure function of its arguments, which is what makes resume arithmetic: the order
of epoch ``e`` is ``torch.randperm(n, generator=random.generator(random.fold_in(key, e)))``, the same on
every rank, and batch ``i`` of rank ``r`` is a fixed slice of it.

How an epoch is split across ``world_size`` ranks: step ``i`` takes the ``batch_size * world_size``
examples ``order[i * G:(i + 1) * G]`` (``G = batch_size * world_size``) — exactly what one process with
batch size ``G`` would take — and rank ``r`` gets its contiguous share. In a full step every share is
``batch_size``. In the final, short step of ``drop_last=False`` the ``m`` remaining examples are shared
as evenly as possible: the first ``m % world_size`` ranks get ``m // world_size + 1``, the others
``m // world_size``, which is **zero** when ``m < world_size``. No example is dropped or duplicated, and
every rank has the same number of batches.

Example:
    >>> from functrain import random
    >>> batches = shard_batches(list(range(10)), batch_size=2, rank=1, world_size=2)
    >>> batches
    [[2, 3], [6, 7], [9]]
    >>> len(epoch_order(5, 0, random.key(0)))
    5
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functrain import random
from functrain.data.position import num_batches

__all__ = ["epoch_order", "shard_batches"]


def epoch_order(size: int, epoch: int, key: torch.Tensor | None, shuffle: bool = True) -> list[int]:
    """The order in which epoch ``epoch`` visits ``range(size)``: a permutation drawn from ``(key, epoch)``.

    Example:
        >>> k = random.key(0)
        >>> epoch_order(6, 0, k) == epoch_order(6, 0, k), epoch_order(6, 0, k) != epoch_order(6, 1, k)
        (True, True)
        >>> epoch_order(3, 7, None, shuffle=False)
        [0, 1, 2]
    """
    if not shuffle:
        return list(range(size))
    if key is None:
        raise ValueError("epoch_order: shuffle=True needs a key; make one with functrain.random.key(seed)")
    generator = random.generator(random.fold_in(key, epoch))
    return torch.randperm(size, generator=generator).tolist()


def shard_batches(
    order: Sequence[int],
    batch_size: int,
    *,
    drop_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> list[list[int]]:
    """Rank ``rank``'s batches of one epoch, as lists of dataset indices (see the module docstring).

    The last batch may be shorter, or empty when fewer examples than ranks are left.

    Example:
        >>> [shard_batches([5, 4, 3, 2, 1], batch_size=2, rank=r, world_size=3) for r in range(3)]
        [[[5, 4]], [[3, 2]], [[1]]]
        >>> [shard_batches([9, 8], batch_size=2, rank=r, world_size=3) for r in range(3)]
        [[[9]], [[8]], [[]]]
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
    count = num_batches(len(order), batch_size, drop_last, world_size)
    per_step = batch_size * world_size
    batches = []
    for step in range(count):
        step_start = step * per_step
        remaining = min(per_step, len(order) - step_start)
        base, extra = divmod(remaining, world_size)
        start = step_start + rank * base + min(rank, extra)
        size = base + (1 if rank < extra else 0)
        batches.append(list(order[start : start + size]))
    return batches
