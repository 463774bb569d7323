"""A seeded shuffle buffer: a stream's examples in a random order that a key and an epoch decide.

A stream (an ``IterableDataset``, a Hugging Face streaming dataset) cannot be permuted as a whole. A buffer
of ``size`` examples is filled from it; each next example replaces a randomly chosen one, which is yielded
(``tf.data``'s and Hugging Face datasets' ``shuffle(buffer_size=)``). The draws come from
``random.fold_in(key, epoch)`` (and the DataLoader worker's id), so the same stream, key and epoch give
the same order: a resume that replays the stream replays the shuffle too. Larger buffers mix further: an
example moves at most about ``size`` places earlier.

Example:
    >>> from functrain import random
    >>> stream = ShuffleBuffer(range(10), size=4, key=random.key(0), epoch=0)
    >>> sorted(stream) == list(range(10)), list(stream) == list(stream)
    (True, True)
    >>> list(stream) != list(ShuffleBuffer(range(10), size=4, key=random.key(0), epoch=1))
    True
"""

from __future__ import annotations

import random as _py_random
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from functrain import random

__all__ = ["ShuffleBuffer"]


class ShuffleBuffer(IterableDataset):
    """``stream``'s examples through a shuffle buffer of ``size``, seeded by ``(key, epoch)``."""

    def __init__(self, stream: Iterable[Any], size: int, key: torch.Tensor, epoch: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"ShuffleBuffer: size must be an int >= 1, got {size!r}")
        self.stream, self.size, self.key, self.epoch = stream, size, key, epoch

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        key = random.fold_in(self.key, self.epoch)
        if worker is not None:  # each worker reads its own copy of the stream: its own draws
            key = random.fold_in(key, worker.id)
        draw = _py_random.Random(random.seed_of(key))  # a host RNG: one draw per example, no tensor op
        buffer: list[Any] = []
        for example in self.stream:
            if len(buffer) < self.size:
                buffer.append(example)
                continue
            slot = draw.randrange(self.size)
            yield buffer[slot]
            buffer[slot] = example
        draw.shuffle(buffer)
        yield from buffer
