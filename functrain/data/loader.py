"""``Loader``: deterministic, resumable batches on the device, one epoch or many.

Example:
    >>> import torch
    >>> from functrain import random
    >>> from functrain.data import DataPosition, Loader
    >>> dataset = [{"x": torch.tensor([float(i)]), "y": i % 2} for i in range(10)]
    >>> loader = Loader(dataset, batch_size=4, key=random.key(0), prefetch=0)
    >>> len(loader)
    3
    >>> resumed = [b["x"] for b in loader.epoch(1, start_index=1)]
    >>> all(torch.equal(a, b) for a, b in zip(resumed, [b["x"] for b in loader.epoch(1)][1:]))
    True
    >>> position, batch = next(iter(loader.iterate(DataPosition(epoch=0, index=3))))
    >>> position.as_tuple()  # the position after this batch: epoch 1's first
    (1, 1)
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from functrain import random
from functrain.data.notes import add_note
from functrain.data.padding import pad_batch
from functrain.data.position import DataPosition
from functrain.data.prefetch import Prefetcher
from functrain.data.sources import DataLoaderSource, IterableSource, MapSource, is_stream
from functrain.data.stream_state import fingerprint, warn_not_replayed
from functrain.data.transfer import to_device
from functrain.data.workers import WorkerOptions

__all__ = ["Loader"]


class Loader:
    """Batches of ``data`` from any ``(epoch, index)`` position, moved to ``device`` in the background.

    ``data`` is one of:

    - a **map-style dataset** (``__len__`` and ``__getitem__``; a list works): the main path. Epoch
      ``e`` visits the examples in ``torch.randperm(n, generator=random.generator(random.fold_in(key,
      e)))`` order (``shuffle=True``, the default, needs ``key``), so epochs differ, the same key gives
      the same order, and resume seeks arithmetically. With ``world_size > 1`` each rank reads its
      share of the same permutation (see :mod:`functrain.data.order`): all ranks have the same number
      of batches; with ``drop_last=False`` the final step's remainder is spread over the ranks, so a
      rank's last batch can be smaller or **empty** (zero examples, same structure; see
      :func:`~functrain.data.empty_batch` and :func:`~functrain.data.num_examples`) and no example is
      dropped or repeated. Weight metrics and losses by example count, not by batch.
    - a **stream** (a ``torch.utils.data.IterableDataset``, or anything iterable without
      ``__getitem__``: Hugging Face's streaming datasets): read in its own order (``shuffle`` defaults
      to false), one rank; ``set_epoch(epoch)`` is called on it when it has one. ``shuffle=True`` with
      ``shuffle_buffer=N`` reads it through a buffer of ``N`` examples shuffled by ``(key, epoch)``
      (:mod:`functrain.data.shuffle_buffer`). A stream with ``state_dict()``/``load_state_dict()``
      (read without workers or buffer) resumes from its own state, saved by ``fit`` with the loop's;
      any other resume **skips** ``index`` batches of a fresh pass (loads and discards them), exact only
      if each pass repeats — ``fit`` checks that and warns where it does not
      (:mod:`functrain.data.stream_state`).
    - an existing **``torch.utils.data.DataLoader``**, used as it is (give no batching arguments).
      A stateful one (torchdata's ``StatefulDataLoader``) resumes from its state, saved by ``fit``;
      any other resume skips ``index`` batches; ``set_epoch`` is called on its sampler when it has one. A
      :class:`~functrain.data.ResumeWarning` is raised when a resume (a start past epoch 0, batch 0)
      cannot reproduce its order (e.g. a ``RandomSampler`` without a generator); a run from the start
      does not warn. ``exact_resume`` tells which case applies.

    Randomness inside ``__getitem__`` (augmentation): worker seeds are derived from ``(key, epoch,
    start_index)``, so runs repeat, but a resumed epoch's workers restart their streams. For
    augmentations that survive resume, draw them from the example index, e.g. with
    ``random.generator(random.fold_in(aug_key, index))``. Do not use the global torch RNG there: with
    ``prefetch > 0`` the dataset runs in a background thread while the loop reseeds that RNG every step.

    ``pad_last=True`` (opt-in, for training; evaluation and prediction pad by themselves) yields every
    batch as a :class:`~functrain.data.MaskedBatch`, a short last batch filled up to ``batch_size`` rows
    with a mask of its real rows, so a compiled train step keeps one shape (see
    :mod:`functrain.data.padding`); steps from :func:`functrain.make_train_step` weigh the padded rows
    zero in the loss and the gradient.

    ``prefetch`` batches are loaded and copied to ``device`` ahead by a background thread
    (``prefetch=0``: load in the caller's thread). ``pin_memory`` page-locks host batches for
    asynchronous CUDA copies.

    ``num_workers`` processes load a map-style dataset's examples; ``persistent_workers`` (default)
    keeps them from one epoch to the next (new ones made each epoch's first batch wait 85-140 ms against
    12-17 ms), with the batches of new workers: each epoch reseeds them as torch seeds a new worker. They
    keep the dataset as it was when they started: a change made to it between epochs needs
    ``persistent_workers=False``.
    ``prefetch_factor`` (batches loaded ahead per worker) and ``worker_init_fn`` (called once in each
    new worker with its id) mean what they mean for ``DataLoader``. An iterable dataset gets new
    workers every pass, so that ``set_epoch`` reaches them.

    Example:
        >>> loader = Loader(list(range(10)), batch_size=4, shuffle=False, prefetch=0)
        >>> [b.tolist() for b in loader.epoch(0)]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    def __init__(
        self,
        data: Any,
        batch_size: int | None = None,
        *,
        shuffle: bool | None = None,
        key: torch.Tensor | None = None,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        persistent_workers: bool = True,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        pin_memory: bool = False,
        prefetch: int = 2,
        device: str | torch.device | None = None,
        rank: int = 0,
        world_size: int = 1,
        pad_last: bool = False,
        shuffle_buffer: int | None = None,
    ) -> None:
        _check_options(num_workers, prefetch_factor, prefetch, world_size, rank, shuffle_buffer, key)
        self.device = torch.device(device) if device is not None else None
        self.prefetch = prefetch
        self.pad_last = bool(pad_last)
        #: The rows of a full batch (per rank): what a short batch is padded to. ``None`` when unknown.
        self.batch_size: int | None = data.batch_size if isinstance(data, DataLoader) else batch_size
        self._source: MapSource | IterableSource | DataLoaderSource

        if isinstance(data, DataLoader):
            _refuse_options_beside_a_dataloader(
                {
                    "batch_size": batch_size is not None,
                    "shuffle": shuffle is not None,
                    "key": key is not None,
                    "drop_last": drop_last,
                    "collate_fn": collate_fn is not None,
                    "num_workers": num_workers != 0,
                    "persistent_workers": not persistent_workers,
                    "prefetch_factor": prefetch_factor is not None,
                    "worker_init_fn": worker_init_fn is not None,
                    "pin_memory": pin_memory,
                    "rank/world_size": world_size != 1,
                    "pad_last": pad_last,
                    "shuffle_buffer": shuffle_buffer is not None,
                }
            )
            self._source = DataLoaderSource(data)
            return

        workers = WorkerOptions(num_workers, bool(persistent_workers), prefetch_factor, worker_init_fn)
        options = _DatasetOptions(
            batch_size,
            shuffle,
            key,
            drop_last,
            collate_fn,
            workers,
            pin_memory,
            rank,
            world_size,
            shuffle_buffer,
        )
        self._source = _dataset_source(data, options)

    # ------------------------------------------------------------------------------------------ sizes

    @property
    def batches_per_epoch(self) -> int | None:
        """Batches of one epoch on this rank (equal on every rank); ``None`` if the data has no length."""
        return self._source.batches_per_epoch

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError(
                "Loader: the number of batches per epoch is unknown (an iterable dataset without __len__); "
                "bound training by a number of steps instead of epochs"
            )
        return self.batches_per_epoch

    def require_batches(self, what: str) -> None:
        """Raise ``ValueError`` when an epoch has no batch (an empty dataset, or fewer examples than
        ``batch_size`` with ``drop_last``), naming the dataset's length, ``batch_size`` and ``drop_last``.

        Example:
            >>> Loader(list(range(5)), 4, shuffle=False, drop_last=True).require_batches("fit")  # one batch
            >>> # with 3 examples: ValueError: fit: an epoch of the training data has no batches: the dataset
            >>> # has 3 examples, batch_size=4, drop_last=True; ...
        """
        if self.batches_per_epoch != 0:
            return
        raise ValueError(
            f"{what}: an epoch of the training data has no batches: {self._source.describe()}; "
            "check that the dataset is not empty, give it at least batch_size examples, lower batch_size, "
            "or set drop_last=False"
        )

    @property
    def exact_resume(self) -> bool:
        """True when resuming at any position reproduces the uninterrupted run's batches exactly."""
        return self._source.exact_resume

    @property
    def is_stream(self) -> bool:
        """True for a stream (an iterable dataset), read in its own order (see the class docstring)."""
        return isinstance(self._source, IterableSource)

    @property
    def is_stateful(self) -> bool:
        """True when the data keeps its own position (``state_dict()``/``load_state_dict()``: a torchdata
        ``StatefulDataLoader``, a stream read without workers or buffer), which ``fit`` saves and restores."""
        return getattr(self._source, "stream_state", None) is not None

    def check_replay(self, batch: Any, expected: str, epoch: int, index: int) -> None:
        """Warn (:class:`~functrain.data.ResumeWarning`) when ``batch``, batch ``index`` of ``epoch`` read
        again by a resume, is not the one the interrupted run trained on (``expected``: its
        :func:`~functrain.data.stream_state.fingerprint`): the stream does not replay itself."""
        if fingerprint(batch) != expected:
            warn_not_replayed(type(getattr(self._source, "dataset", self._source)).__name__, epoch, index)

    def stream_state(self, position: DataPosition) -> Any:
        """A stateful stream's ``state_dict()`` once the batch ending at ``position`` was read (``None``
        for other data, or when it is no longer kept): what ``fit`` saves with the loop's state."""
        kept = getattr(self._source, "stream_state", None)
        return None if kept is None else kept.at(*position.as_tuple())

    def restore_stream(self, position: DataPosition, state: Any) -> None:
        """Have a stateful stream load ``state`` (from :meth:`stream_state`) when it is next read from
        ``position``, instead of skipping the batches before it. A stateful DataLoader's state at an epoch's
        end is loaded before the next epoch (it carries its sampler there); a stream's next epoch starts
        afresh (``set_epoch``)."""
        kept = getattr(self._source, "stream_state", None)
        if kept is None:
            return
        if isinstance(self._source, DataLoaderSource) and self.batches_per_epoch is not None:
            position = position.normalized(self.batches_per_epoch)
        kept.restore_at(*position.as_tuple(), state)

    def batch_indices(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` as dataset indices (map-style datasets only).

        Example:
            >>> Loader(list(range(5)), 2, shuffle=False).batch_indices(0)
            [[0, 1], [2, 3], [4]]
        """
        if not isinstance(self._source, MapSource):
            raise TypeError("Loader.batch_indices: only a map-style dataset has batches known by index")
        return self._source.batch_indices(epoch)

    @property
    def key(self) -> torch.Tensor | None:
        """The key that orders this loader's epochs and seeds its workers (``None`` for a DataLoader)."""
        return getattr(self._source, "key", None)

    def with_key(self, key: torch.Tensor) -> Loader:
        """This loader with its epochs ordered by ``key``: a shallow copy sharing the data (a resumed run
        orders its data by the checkpoint's key, whatever key the new run was built with).

        Example:
            >>> rekeyed = Loader(list(range(8)), 4, key=random.key(0)).with_key(random.key(1))
            >>> rekeyed.batch_indices(0) == Loader(list(range(8)), 4, key=random.key(1)).batch_indices(0)
            True
        """
        if not hasattr(self._source, "key"):
            raise TypeError("Loader.with_key: a DataLoader brings its own order; it has no key to set")
        keyed = copy.copy(self)
        keyed._source = copy.copy(self._source)
        keyed._source.key = key
        return keyed

    def to(self, device: str | torch.device | None) -> Loader:
        """This loader with its batches moved to ``device``: a shallow copy sharing the data and its order.

        Example:
            >>> Loader(list(range(4)), 2, shuffle=False).to("cpu").device
            device(type='cpu')
        """
        moved = copy.copy(self)
        moved.device = torch.device(device) if device is not None else None
        return moved

    # ------------------------------------------------------------------------------------------ batches

    def epoch(self, epoch: int, start_index: int = 0) -> Iterator[Any]:
        """Epoch ``epoch``'s batches from batch ``start_index`` on, on the device.

        The iterator has ``close()``; breaking out of a ``for`` loop over it also stops its prefetch
        thread once the iterator is dropped.

        Example:
            >>> [b.tolist() for b in Loader(list(range(5)), 2, shuffle=False).epoch(0, start_index=2)]
            [[4]]
        """
        _check_int("epoch", epoch, minimum=0)
        _check_int("start_index", start_index, minimum=0)
        bpe = self.batches_per_epoch
        if bpe is not None and start_index > bpe:
            raise ValueError(
                f"Loader.epoch: start_index={start_index} is past the end of an epoch of {bpe} batches; "
                "was the position saved with another batch size, dataset or world size?"
            )
        if start_index and isinstance(self._source, DataLoaderSource):
            self._source.warn_if_inexact(epoch, start_index)
        return self._on_device(self._source.batches(epoch, start_index), lambda batch: self._move(batch))

    def iterate(
        self, position: DataPosition | None = None, *, num_epochs: int | None = None
    ) -> Iterator[tuple[DataPosition, Any]]:
        """``(position_after, batch)`` pairs from ``position`` on, across epoch boundaries.

        ``position_after`` is where the stream stands once ``batch`` is consumed: save it with the
        state that ``batch`` produced, and pass it back here to resume. At an epoch's last batch it is
        ``(epoch, batches_per_epoch)``. Stops before epoch ``num_epochs`` (never, when ``None``).

        Example:
            >>> loader = Loader(list(range(4)), 2, shuffle=False, prefetch=0)
            >>> [(p.as_tuple(), b.tolist()) for p, b in loader.iterate(num_epochs=2)][1:3]
            [((0, 2), [2, 3]), ((1, 1), [0, 1])]
        """
        position = DataPosition() if position is None else position
        if not isinstance(position, DataPosition):
            raise TypeError(f"Loader.iterate: position must be a DataPosition, got {type(position).__name__}")
        if num_epochs is not None:
            _check_int("num_epochs", num_epochs, minimum=0)
        self.require_batches("Loader.iterate")
        if self.batches_per_epoch is not None:
            position = position.normalized(self.batches_per_epoch)
        epoch, index = position.as_tuple()
        if isinstance(self._source, DataLoaderSource):
            self._source.warn_if_inexact(epoch, index)
        host = self._host_positions(epoch, index, num_epochs)
        return self._on_device(host, lambda item: (item[0], self._move(item[1])))

    def _host_positions(
        self, epoch: int, index: int, num_epochs: int | None
    ) -> Iterator[tuple[DataPosition, Any]]:
        while num_epochs is None or epoch < num_epochs:
            start = index
            try:
                for batch in self._source.batches(epoch, start):
                    index += 1
                    yield DataPosition(epoch, index), batch
            except Exception as error:  # raised by the dataset or collate, not by the consumer
                where = self._source.where(epoch, index)
                add_note(error, f"functrain.data.Loader: while loading batch {index} of epoch {epoch}{where}")
                raise
            if start == 0 and index == 0:
                raise ValueError(f"Loader.iterate: epoch {epoch} produced no batches; is the dataset empty?")
            epoch, index = epoch + 1, 0

    def _move(self, batch: Any) -> Any:
        if self.pad_last and self.batch_size is not None:
            batch = pad_batch(batch, self.batch_size)
        return to_device(batch, self.device)

    def _on_device(self, items: Iterator[Any], transfer: Callable[[Any], Any]) -> Iterator[Any]:
        if self.prefetch > 0:
            return Prefetcher(items, transfer=transfer, size=self.prefetch, device=self.device)
        return _mapped(items, transfer)


def _mapped(items: Iterator[Any], transfer: Callable[[Any], Any]) -> Iterator[Any]:
    try:
        for item in items:
            yield transfer(item)
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Loader: {name} must be an int >= {minimum}, got {value!r}")


def _check_options(
    num_workers: Any,
    prefetch_factor: Any,
    prefetch: Any,
    world_size: Any,
    rank: Any,
    shuffle_buffer: Any,
    key: Any,
) -> None:
    """Refuse the Loader options that are wrong whatever the data (counts, the rank, the key)."""
    _check_int("num_workers", num_workers, minimum=0)
    if prefetch_factor is not None:
        _check_int("prefetch_factor", prefetch_factor, minimum=1)
        if num_workers == 0:
            raise ValueError(
                f"Loader: prefetch_factor={prefetch_factor} needs worker processes (num_workers > 0); "
                "set num_workers, or leave prefetch_factor unset (prefetch= sets how many batches "
                "the loading thread keeps ready)"
            )
    _check_int("prefetch", prefetch, minimum=0)
    _check_int("world_size", world_size, minimum=1)
    _check_int("rank", rank, minimum=0)
    if shuffle_buffer is not None:
        _check_int("shuffle_buffer", shuffle_buffer, minimum=1)
    if rank >= world_size:
        raise ValueError(f"Loader: rank must be < world_size={world_size}, got rank={rank}")
    if key is not None and not random.is_key(key):
        raise TypeError(
            f"Loader: key must be a functrain random key (CPU int64 tensor of shape (2,)), got "
            f"{type(key).__name__}; make one with functrain.random.key(seed)"
        )


@dataclasses.dataclass(frozen=True)
class _DatasetOptions:
    """The Loader's options for a dataset (not a DataLoader), as given: what its source is built from."""

    batch_size: int | None
    shuffle: bool | None
    key: torch.Tensor | None
    drop_last: bool
    collate_fn: Callable[[list[Any]], Any] | None
    workers: WorkerOptions
    pin_memory: bool
    rank: int
    world_size: int
    shuffle_buffer: int | None


def _dataset_source(data: Any, options: _DatasetOptions) -> MapSource | IterableSource:
    """A dataset's source (not a DataLoader's): a stream's (:func:`_stream_source`) or a map-style
    dataset's (:func:`_map_source`), each batch of ``batch_size`` examples."""
    if options.pin_memory and not torch.cuda.is_available():
        warnings.warn(
            "Loader: pin_memory=True has no effect without CUDA; it is ignored", UserWarning, stacklevel=3
        )
        options = dataclasses.replace(options, pin_memory=False)
    if options.batch_size is None:
        raise ValueError("Loader: batch_size is required for a dataset (only a DataLoader brings its own)")
    _check_int("batch_size", options.batch_size, minimum=1)
    return _stream_source(data, options) if is_stream(data) else _map_source(data, options)


def _refuse_options_beside_a_dataloader(given: dict[str, bool]) -> None:
    """A DataLoader is used as it is: refuse the Loader options that would be ignored, naming them."""
    if any(given.values()):
        names = ", ".join(name for name, is_given in given.items() if is_given)
        raise ValueError(
            f"Loader: got a DataLoader together with {names}; a DataLoader is used as it is. "
            "Set those on the DataLoader, or pass its dataset to Loader instead"
        )


def _stream_source(data: Any, options: _DatasetOptions) -> IterableSource:
    """An iterable dataset's source, read in its own order or through a seeded shuffle buffer."""
    shuffle = options.shuffle
    if shuffle and not options.shuffle_buffer:
        raise ValueError(
            f"Loader: shuffle=True on a stream ({type(data).__name__}: an iterable dataset, read in "
            "its own order) needs shuffle_buffer=N, a buffer of N examples shuffled by key and "
            "epoch (TrainerConfig.shuffle_buffer_size); or pass shuffle=False"
        )
    if shuffle and options.key is None:
        raise ValueError("Loader: a shuffle buffer needs key= (e.g. functrain.random.key(0))")
    if options.world_size != 1:
        raise ValueError(
            "Loader: an iterable dataset cannot be sharded by Loader (world_size > 1); have the "
            "dataset yield only this rank's examples and pass world_size=1"
        )
    return IterableSource(
        data,
        options.batch_size,
        drop_last=options.drop_last,
        collate_fn=options.collate_fn,
        workers=options.workers,
        pin_memory=options.pin_memory,
        key=options.key,
        shuffle_buffer=options.shuffle_buffer if shuffle else None,
    )


def _map_source(data: Any, options: _DatasetOptions) -> MapSource:
    """A map-style dataset's source, permuted whole every epoch by ``key`` unless ``shuffle=False``."""
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(
            f"Loader: data must be a map-style dataset (__len__ and __getitem__), an IterableDataset or "
            f"a DataLoader, got {type(data).__name__}"
        )
    if options.shuffle_buffer is not None:
        raise ValueError(
            "Loader: shuffle_buffer is for streams (iterable datasets); a map-style dataset is permuted "
            "whole every epoch (shuffle=True)"
        )
    shuffle = True if options.shuffle is None else options.shuffle
    if shuffle and options.key is None:
        raise ValueError(
            "Loader: shuffle=True needs key= (e.g. functrain.random.key(0), or a key split from the "
            "train state's rng) so that every epoch's order can be recomputed on resume; "
            "or pass shuffle=False"
        )
    return MapSource(
        data,
        options.batch_size,
        shuffle=shuffle,
        key=options.key,
        drop_last=options.drop_last,
        collate_fn=options.collate_fn,
        workers=options.workers,
        pin_memory=options.pin_memory,
        rank=options.rank,
        world_size=options.world_size,
    )
