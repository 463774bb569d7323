"""Where the data stream stands: ``DataPosition`` and the batch/step arithmetic built on it.

Exact resume is arithmetic. A position is ``(epoch, index)``: ``index`` batches of ``epoch`` have been
consumed. Every epoch's order is a function of ``(key, epoch)`` (see :mod:`functrain.data.order`), so a
loader seeks straight to a position without replaying the batches before it. A stream cannot seek: it
resumes from its own saved state or by a replay that is checked (:mod:`functrain.data.stream_state`).

Example:
    >>> from functrain.data import DataPosition, num_batches
    >>> per_epoch = num_batches(10, 4)  # 4 + 4 + 2
    >>> DataPosition.from_batch_count(7, per_epoch).as_tuple()
    (2, 1)
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from functrain import tree

__all__ = ["DataPosition", "num_batches", "num_steps"]


def _as_count(value: Any, name: str) -> Any:
    # Only plain integers are converted and checked: tensors pass untouched because the same class is
    # rebuilt by pytree unflattening with fake or traced tensors, which must not be inspected.
    if isinstance(value, bool):
        raise TypeError(f"DataPosition.{name} must be an int or a 0-d int64 tensor, got bool")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ValueError(f"DataPosition.{name} must be >= 0, got {value}")
        return torch.tensor(int(value), dtype=torch.int64)
    return value


@tree.struct
class DataPosition:
    """How far the data stream has gone: ``index`` batches of epoch ``epoch`` are consumed.

    Both fields are 0-d ``int64`` CPU tensors (plain ints are converted): the position lives in the
    train state, which passes through compiled steps, where a changing Python int would force a
    recompile, and it is saved in msgpack checkpoints, which take tensors.

    ``index == batches_per_epoch`` means "epoch finished"; resuming from there starts the next epoch
    at batch 0. :meth:`Loader.iterate <functrain.data.Loader.iterate>` yields, with each batch, the
    position *after* that batch: save that one with the state the batch produced.

    Example:
        >>> p = DataPosition(epoch=1, index=3)
        >>> p.advance(batches_per_epoch=4).as_tuple()
        (1, 4)
        >>> p.advance(batches_per_epoch=4, num=2).as_tuple()
        (2, 1)
    """

    epoch: Any = 0
    index: Any = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "epoch", _as_count(self.epoch, "epoch"))
        object.__setattr__(self, "index", _as_count(self.index, "index"))

    @classmethod
    def from_batch_count(cls, count: int, batches_per_epoch: int) -> DataPosition:
        """The position after ``count`` batches in total, counted from the start of epoch 0.

        Example:
            >>> DataPosition.from_batch_count(8, 4).as_tuple()
            (1, 4)
        """
        _check_positive(batches_per_epoch, "batches_per_epoch")
        if count < 0:
            raise ValueError(f"DataPosition.from_batch_count: count must be >= 0, got {count}")
        if count == 0:
            return cls(0, 0)
        # Land on (e, batches_per_epoch) rather than (e + 1, 0): the epoch just finished is the one
        # the last batch belonged to.
        epoch, index = divmod(count - 1, batches_per_epoch)
        return cls(epoch, index + 1)

    def as_tuple(self) -> tuple[int, int]:
        """``(epoch, index)`` as Python ints."""
        return int(self.epoch), int(self.index)

    def batch_count(self, batches_per_epoch: int) -> int:
        """Total batches consumed since the start of epoch 0 (inverse of :meth:`from_batch_count`)."""
        epoch, index = self.as_tuple()
        return epoch * batches_per_epoch + index

    def normalized(self, batches_per_epoch: int) -> DataPosition:
        """The same place with ``index < batches_per_epoch``: a finished epoch becomes the next one's start.

        Example:
            >>> DataPosition(2, 5).normalized(5).as_tuple()
            (3, 0)
        """
        _check_positive(batches_per_epoch, "batches_per_epoch")
        epoch, index = self.as_tuple()
        if index > batches_per_epoch:
            raise ValueError(
                f"DataPosition.index={index} is past the end of an epoch of {batches_per_epoch} batches; "
                "was the position saved with another batch size, dataset or world size?"
            )
        if index == batches_per_epoch:
            return DataPosition(epoch + 1, 0)
        return self

    def advance(self, batches_per_epoch: int, num: int = 1) -> DataPosition:
        """The position after ``num`` more batches (ends on ``index == batches_per_epoch`` at an epoch end)."""
        return DataPosition.from_batch_count(self.batch_count(batches_per_epoch) + num, batches_per_epoch)

    def __repr__(self) -> str:
        epoch, index = self.as_tuple() if _is_concrete(self) else (self.epoch, self.index)
        return f"DataPosition(epoch={epoch}, index={index})"


def _is_concrete(position: DataPosition) -> bool:
    return all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in (position.epoch, position.index))


def _check_positive(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def num_batches(dataset_len: int, batch_size: int, drop_last: bool = False, world_size: int = 1) -> int:
    """Batches per epoch on every rank when ``world_size`` ranks each take ``batch_size`` examples a step.

    One step consumes ``batch_size * world_size`` examples across ranks; with ``drop_last=False`` a
    final, smaller step takes what is left. Every rank gets the same count, so all ranks step together.

    Example:
        >>> num_batches(10, 4), num_batches(10, 4, drop_last=True), num_batches(10, 2, world_size=4)
        (3, 2, 2)
    """
    if not isinstance(dataset_len, int) or dataset_len < 0:
        raise ValueError(f"num_batches: dataset_len must be an int >= 0, got {dataset_len!r}")
    _check_positive(batch_size, "batch_size")
    _check_positive(world_size, "world_size")
    per_step = batch_size * world_size
    return dataset_len // per_step if drop_last else -(-dataset_len // per_step)


def num_steps(batches: int, accumulation_steps: int = 1) -> int:
    """Optimizer steps that ``batches`` micro-batches make with gradient accumulation.

    A trailing group shorter than ``accumulation_steps`` still makes one step. Count schedules in
    these optimizer steps: ``num_epochs * num_steps(num_batches(...), accumulation_steps)`` when
    accumulation restarts at every epoch, ``num_steps(num_epochs * num_batches(...), ...)`` when it
    runs across epoch boundaries.

    Example:
        >>> num_steps(10, accumulation_steps=4)
        3
    """
    if not isinstance(batches, int) or batches < 0:
        raise ValueError(f"num_steps: batches must be an int >= 0, got {batches!r}")
    _check_positive(accumulation_steps, "accumulation_steps")
    return -(-batches // accumulation_steps)
