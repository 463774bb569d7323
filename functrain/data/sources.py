"""Host-side batch sources: how one epoch's batches are produced, from a given batch index on.

Three kinds of data, three ways to seek:

- :class:`MapSource` (``__len__`` + ``__getitem__``): exact and arithmetic. The epoch's batches are
  index lists computed by :mod:`functrain.data.order`; starting at batch ``i`` loads nothing before it.
- :class:`IterableSource` (a stream: ``torch.utils.data.IterableDataset``, or anything iterable without
  ``__getitem__``, as Hugging Face's streaming datasets): read in its own order, or through a seeded
  :class:`~functrain.data.shuffle_buffer.ShuffleBuffer`. A stream with ``state_dict()``/
  ``load_state_dict()`` read in the main process resumes from its saved state; any other *skips* ``i``
  batches of a fresh pass (loaded and collated, then discarded), exact only when the stream yields the same
  examples in the same order on every pass of the same epoch (checked: :mod:`functrain.data.stream_state`).
- :class:`DataLoaderSource` (an existing ``torch.utils.data.DataLoader``, as it is): a stateful one
  (torchdata's ``StatefulDataLoader``) resumes from its saved state; any other skips ``i`` batches too, and
  is exact only if the loader's order depends on nothing but the epoch.

All of them hand index lists or datasets to ``torch.utils.data.DataLoader`` for worker processes and
pinned memory rather than managing processes themselves.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from functrain import random
from functrain.data.collate import collate, empty_batch
from functrain.data.notes import add_note
from functrain.data.order import epoch_order, shard_batches
from functrain.data.position import num_batches
from functrain.data.shuffle_buffer import ShuffleBuffer
from functrain.data.stream_state import ResumeWarning, StreamState, is_stateful
from functrain.data.workers import BatchRunner, WorkerOptions

__all__ = ["DataLoaderSource", "IterableSource", "MapSource", "ResumeWarning", "is_stream"]


def is_stream(data: Any) -> bool:
    """Whether ``data`` is read as a stream (in its own order, without random access): an
    ``IterableDataset``, or anything iterable without ``__getitem__`` (Hugging Face's streaming datasets).

    Example:
        >>> is_stream([1, 2]), is_stream(iter([1, 2])), is_stream(torch.utils.data.DataLoader([1]))
        (False, True, False)
    """
    if isinstance(data, DataLoader):
        return False
    return isinstance(data, IterableDataset) or (
        hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
    )


def _recorded(batches: Any, state: StreamState | None, epoch: int, start_index: int) -> Iterator[Any]:
    """``batches`` as they are, the stream's state kept after each one (when it has one)."""
    if state is None:
        yield from batches
        return
    for index, batch in enumerate(batches, start=start_index + 1):
        state.record(epoch, index)
        yield batch


def _worker_generator(key: torch.Tensor | None, epoch: int, start_index: int) -> torch.Generator:
    # DataLoader draws each worker's base seed from this generator. Giving it one derived from the
    # position keeps worker seeds reproducible and leaves the global RNG (seeded per step) untouched.
    base = key if key is not None else random.key(0)
    return random.generator(random.fold_in(random.fold_in(base, epoch), start_index))


def shown_indices(indices: Sequence[int], limit: int = 8) -> str:
    """``[3, 57, ...]``: at most ``limit`` dataset indices, for an error note."""
    head = ", ".join(str(i) for i in indices[:limit])
    return f"[{head}{', ...' if len(indices) > limit else ''}]"


class NotingDataset:
    """The dataset as the DataLoader reads it: an error raised by ``dataset[i]`` leaves with a note naming
    ``i`` (its type, message and traceback unchanged). In a worker process the note travels in the text
    that torch re-raises in the main process."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as error:
            add_note(error, f"functrain.data: raised by dataset[{index}] (example index {index})")
            raise


class NotingBatchDataset(NotingDataset):
    """:class:`NotingDataset` of a dataset that loads a batch at once (``__getitems__``, as HF datasets)."""

    def __getitems__(self, indices: list[int]) -> Any:
        try:
            return self.dataset.__getitems__(indices)
        except Exception as error:
            add_note(
                error,
                f"functrain.data: raised by dataset.__getitems__ for example indices {shown_indices(indices)}",
            )
            raise


class MapSource:
    """Batches of a map-style dataset: per-epoch permutation, sharded by rank, seekable by arithmetic."""

    exact_resume = True

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool,
        key: torch.Tensor | None,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        workers: WorkerOptions,
        pin_memory: bool,
        rank: int,
        world_size: int,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.key = key
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.rank = rank
        self.world_size = world_size
        self.batches_per_epoch: int | None = num_batches(len(dataset), batch_size, drop_last, world_size)
        noting = NotingBatchDataset if getattr(dataset, "__getitems__", None) else NotingDataset
        self._runner = BatchRunner(
            noting(dataset), collate_fn=collate_fn or collate, pin_memory=pin_memory, options=workers
        )

    def batch_indices(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` as dataset indices (the last may be short or empty)."""
        order = epoch_order(len(self.dataset), epoch, self.key, self.shuffle)
        return shard_batches(
            order, self.batch_size, drop_last=self.drop_last, rank=self.rank, world_size=self.world_size
        )

    def batches(self, epoch: int, start_index: int) -> Iterator[Any]:
        plan = self.batch_indices(epoch)[start_index:]
        # Only the final step can leave this rank with nothing; DataLoader cannot collate zero samples.
        trailing_empty = bool(plan) and not plan[-1]
        if trailing_empty:
            plan = plan[:-1]
        if plan:
            yield from self._runner.batches(plan, _worker_generator(self.key, epoch, start_index))
        if trailing_empty:
            yield self._empty_batch()

    def describe(self) -> str:
        """The sizes that decide the number of batches, for error messages."""
        ranks = f", world_size={self.world_size}" if self.world_size > 1 else ""
        return (
            f"the dataset has {len(self.dataset)} examples, batch_size={self.batch_size}, "
            f"drop_last={self.drop_last}{ranks}"
        )

    def where(self, epoch: int, index: int) -> str:
        """Which examples batch ``index`` of ``epoch`` holds, for an error note."""
        plan = self.batch_indices(epoch)
        return f"; its examples: dataset indices {shown_indices(plan[index])}" if index < len(plan) else ""

    def _empty_batch(self) -> Any:
        if self.collate_fn is not None:
            return self.collate_fn([])
        return empty_batch(self.dataset[0])


class IterableSource:
    """Batches of a stream, in its own order or through a seeded shuffle buffer of ``shuffle_buffer``
    examples; resume loads the stream's own state where it has one (and no buffer, no workers: their
    examples in flight are in no state), else skips batches (not arithmetic)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        workers: WorkerOptions,
        pin_memory: bool,
        key: torch.Tensor | None,
        shuffle_buffer: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.key = key
        self.shuffle_buffer = shuffle_buffer
        stateful = is_stateful(dataset) and not shuffle_buffer and workers.num_workers == 0
        self.stream_state = StreamState(dataset) if stateful else None
        self.exact_resume = stateful
        self._loader_args = dict(
            batch_size=batch_size,
            drop_last=drop_last,
            collate_fn=collate_fn or collate,
            pin_memory=pin_memory,
            **workers.loader_args(),  # new workers every pass: set_epoch must reach them
        )
        self.batches_per_epoch: int | None = None
        if hasattr(dataset, "__len__"):
            self.batches_per_epoch = num_batches(len(dataset), batch_size, drop_last)

    def describe(self) -> str:
        """The sizes that decide the number of batches, for error messages."""
        args = self._loader_args
        return (
            f"the iterable dataset has {len(self.dataset)} examples, batch_size={args['batch_size']}, "
            f"drop_last={args['drop_last']}"
        )

    def where(self, epoch: int, index: int) -> str:
        return ""

    def batches(self, epoch: int, start_index: int) -> Iterator[Any]:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        restored = self.stream_state is not None and self.stream_state.resume(epoch, start_index)
        stream = self.dataset if isinstance(self.dataset, IterableDataset) else _Stream(self.dataset)
        if self.shuffle_buffer:
            stream = ShuffleBuffer(self.dataset, self.shuffle_buffer, self.key, epoch)
        loader = DataLoader(stream, generator=_worker_generator(self.key, epoch, 0), **self._loader_args)
        batches = iter(loader) if restored else itertools.islice(loader, start_index, None)
        yield from _recorded(batches, self.stream_state, epoch, start_index)


class _Stream(IterableDataset):
    """An iterable that is no ``IterableDataset`` (a duck-typed stream), as the DataLoader reads a stream."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[Any]:
        return iter(self.stream)


class DataLoaderSource:
    """An existing ``DataLoader``, used as it is; resume skips batches (not arithmetic).

    Each epoch calls ``set_epoch(epoch)`` on the sampler (or batch sampler, or dataset) when it has one,
    as ``DistributedSampler`` does, so its order is the epoch's order whenever the process started.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        try:
            self.batches_per_epoch: int | None = len(loader)
        except TypeError:
            self.batches_per_epoch = None
        self.stream_state = StreamState(loader) if is_stateful(loader) else None
        self.exact_resume, self.inexact_reason = _resume_exactness(loader)
        self._warned = False

    def warn_if_inexact(self, epoch: int, start_index: int) -> None:
        """Warn (once) when starting at ``(epoch, start_index)`` — a resume — may not reproduce the run."""
        if self.exact_resume or self._warned or (epoch, start_index) == (0, 0):
            return
        self._warned = True
        warnings.warn(
            f"Loader: resuming this DataLoader at epoch {epoch}, batch {start_index} may not reproduce the "
            f"uninterrupted run: {self.inexact_reason}. For exact, arithmetic resume pass the dataset "
            "itself: functrain.data.Loader(dataset, batch_size, key=...)",
            ResumeWarning,
            stacklevel=4,
        )

    def describe(self) -> str:
        """The sizes that decide the number of batches, for error messages."""
        try:
            size = f"the DataLoader's dataset has {len(self.loader.dataset)} examples"
        except TypeError:
            size = "the DataLoader has no batch"
        return f"{size}, batch_size={self.loader.batch_size}, drop_last={self.loader.drop_last}"

    def where(self, epoch: int, index: int) -> str:
        return ""

    def batches(self, epoch: int, start_index: int) -> Iterator[Any]:
        for owner in _epoch_owners(self.loader):
            owner.set_epoch(epoch)
        restored = self.stream_state is not None and self.stream_state.resume(epoch, start_index)
        batches = iter(self.loader) if restored else itertools.islice(self.loader, start_index, None)
        yield from _recorded(batches, self.stream_state, epoch, start_index)


def _epoch_owners(loader: DataLoader) -> Sequence[Any]:
    candidates = (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None))
    owners = [c for c in candidates if c is not None and hasattr(c, "set_epoch")]
    if hasattr(loader.dataset, "set_epoch"):
        owners.append(loader.dataset)
    return list({id(o): o for o in owners}.values())


def _resume_exactness(loader: DataLoader) -> tuple[bool, str]:
    if is_stateful(loader) or _epoch_owners(loader):
        return True, ""
    if isinstance(loader.dataset, IterableDataset):
        return False, "it reads an IterableDataset, whose order is its own (it must repeat it each pass)"
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    if isinstance(sampler, SequentialSampler):
        return True, ""
    if isinstance(sampler, RandomSampler):
        if sampler.generator is None:
            return False, (
                "its RandomSampler has no generator, so each pass's order comes from the global RNG"
            )
        return False, (
            "its RandomSampler's generator advances every epoch, so a restarted process draws "
            "epoch 0's order again"
        )
    return False, f"its sampler {type(sampler).__name__} has no set_epoch(epoch)"
