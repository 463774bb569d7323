"""Worker processes for a map-style dataset: started once and reused by every epoch.

A ``torch.utils.data.DataLoader`` made per epoch starts its worker processes per epoch (the first batch
of the second epoch waited 85-140 ms for them, 12-17 ms with persistent workers: benchmarks/README.md).
:class:`BatchRunner` keeps one DataLoader with ``persistent_workers=True`` whose batch plan is replaced
before each pass, so the workers outlive the epoch.

Persistent workers give the batches that fresh workers would: each pass carries the base seed a fresh
DataLoader would draw from the pass's generator, and a worker whose RNGs were seeded for another pass
reseeds Python's, numpy's and torch's RNGs exactly as torch seeds a new worker (``base_seed + worker_id``)
before loading the pass's first batch. ``worker_init_fn`` runs once per worker, when it starts (torch's
meaning): RNGs it seeds itself are reseeded the torch way from the worker's second pass on.

Example:
    >>> import torch
    >>> options = WorkerOptions()
    >>> runner = BatchRunner(list(range(6)), collate_fn=torch.tensor, pin_memory=False, options=options)
    >>> [b.tolist() for b in runner.batches([[4, 5], [0, 1]], torch.Generator().manual_seed(0))]
    [[4, 5], [0, 1]]
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

# torch's own seeding of a new worker's numpy RNG: reused so a reseeded worker matches a fresh one.
from torch.utils.data._utils.worker import _generate_state

__all__ = ["BatchRunner", "WorkerOptions"]


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """How batches are loaded in worker processes; the fields mean what DataLoader's arguments mean.

    ``persistent``: keep the workers from one epoch to the next (map-style datasets; without workers it
    has nothing to keep). ``prefetch_factor``: batches loaded ahead per worker (``None``: torch's 2).

    Example:
        >>> WorkerOptions(num_workers=2).loader_args()["prefetch_factor"] is None
        True
    """

    num_workers: int = 0
    persistent: bool = True
    prefetch_factor: int | None = None
    init_fn: Callable[[int], None] | None = None

    def loader_args(self) -> dict[str, Any]:
        """DataLoader keyword arguments for a DataLoader made for one pass (its workers end with it)."""
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "worker_init_fn": self.init_fn,
        }


class _Batch(NamedTuple):
    """A batch's dataset indices and the base seed of the pass it belongs to, sent to a worker."""

    base_seed: int
    indices: list[int]


class _Plan:
    """The batch sampler of the persistent DataLoader: the current pass's batches (DataLoader forbids
    replacing its sampler, so the sampler's batches are replaced)."""

    def __init__(self) -> None:
        self.batches: list[_Batch] = []

    def __iter__(self) -> Iterator[_Batch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _Reseeding:
    """The dataset as a persistent worker reads it: a batch of another pass reseeds the worker first."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.base_seed: int | None = None  # the pass this process's RNGs are seeded for

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, batch: _Batch) -> list[Any]:
        info = get_worker_info()
        if info is not None:
            if self.base_seed is None:
                self.base_seed = info.seed - info.id  # as the worker was started
            if batch.base_seed != self.base_seed:
                _seed_worker(batch.base_seed, info.id)
                self.base_seed = batch.base_seed
        if getattr(self.dataset, "__getitems__", None):
            return self.dataset.__getitems__(batch.indices)
        return [self.dataset[i] for i in batch.indices]


def _seed_worker(base_seed: int, worker_id: int) -> None:
    # torch.utils.data._utils.worker._worker_loop's seeding of a new worker.
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, worker_id))


def _base_seed(generator: torch.Generator) -> int:
    """The base seed a new DataLoader iterator draws from ``generator`` (without advancing it)."""
    copy = torch.Generator()
    copy.set_state(generator.get_state())
    return int(torch.empty((), dtype=torch.int64).random_(generator=copy).item())


class BatchRunner:
    """Loads batch plans (lists of dataset indices) of one dataset, each pass on the same workers.

    Without workers, or with ``persistent=False``, each pass gets a DataLoader of its own. A pass that
    starts while another is still open (a for loop left without closing its iterator) also gets its own,
    since the persistent workers are busy; after a pass that failed, the next starts new workers.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        collate_fn: Callable[[list[Any]], Any],
        pin_memory: bool,
        options: WorkerOptions,
    ) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.options = options
        self._plan = _Plan()
        self._loader: DataLoader | None = None
        self._busy = False
        self._lock = threading.Lock()

    @property
    def persistent(self) -> bool:
        return self.options.persistent and self.options.num_workers > 0

    def batches(self, plan: list[list[int]], generator: torch.Generator) -> Iterator[Any]:
        """The collated batches of ``plan``; ``generator`` seeds workers as it seeds a new DataLoader's."""
        with self._lock:
            reuse = self.persistent and not self._busy
            self._busy = self._busy or reuse
        if not reuse:
            yield from DataLoader(
                self.dataset,
                batch_sampler=plan,
                collate_fn=self.collate_fn,
                pin_memory=self.pin_memory,
                generator=generator,
                **self.options.loader_args(),
            )
            return
        try:
            seed = _base_seed(generator)
            self._plan.batches = [_Batch(seed, indices) for indices in plan]
            if self._loader is None:
                self._loader = DataLoader(
                    _Reseeding(self.dataset),
                    batch_sampler=self._plan,
                    collate_fn=self.collate_fn,
                    pin_memory=self.pin_memory,
                    generator=generator,  # the first pass's workers start seeded for it
                    persistent_workers=True,
                    **self.options.loader_args(),
                )
            yield from self._loader
        except Exception:
            self._loader = None  # its workers may be gone or mid-batch: the next pass starts new ones
            raise
        finally:
            self._busy = False
