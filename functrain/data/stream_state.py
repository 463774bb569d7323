"""How a stream resumes where it stopped: from its own ``state_dict()`` where it has one, else by a replay
that is checked.

A map-style dataset resumes by arithmetic (:mod:`functrain.data.order`). A stream cannot seek, and
functrain tells two kinds apart:

- **a stateful stream**: anything with ``state_dict()`` and ``load_state_dict()`` — torchdata's
  ``StatefulDataLoader``, Hugging Face ``datasets``' ``IterableDataset`` (read in the main process). Its
  state after each batch is kept (:class:`StreamState`); the one at the saved position goes into the
  checkpoint with the loop's state, and a resume loads it. Exact, and nothing is read twice.
- **any other stream is replayed**: a resume reads the epoch afresh and discards the batches already
  trained on. That is exact only when every pass of an epoch yields the same examples in the same order
  (a file read in order, a generator seeded from ``set_epoch(epoch)``). functrain checks it: the checkpoint
  keeps the :func:`fingerprint` of the last batch trained on, and the resume compares it with the replayed
  batch at that position; where they differ a :class:`~functrain.data.ResumeWarning` says so, once.

Example:
    >>> import torch
    >>> fingerprint({"x": torch.arange(3)}) == fingerprint({"x": torch.arange(3)})
    True
    >>> fingerprint({"x": torch.arange(3)}) == fingerprint({"x": torch.arange(1, 4)})
    False
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections import OrderedDict
from typing import Any

from functrain.core.fingerprint import fingerprint

__all__ = ["ResumeWarning", "StreamState", "fingerprint", "is_stateful", "warn_not_replayed"]

#: Batch boundaries whose state is kept: the prefetch thread runs at most ``prefetch + 1`` batches ahead.
KEPT = 64


class ResumeWarning(UserWarning):
    """Resuming this data in the middle of an epoch may not reproduce the uninterrupted run."""


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` saves and restores its own position (``state_dict()`` and ``load_state_dict()``).

    Example:
        >>> import torch
        >>> is_stateful([1, 2]), is_stateful(torch.optim.SGD([torch.zeros(1, requires_grad=True)], 0.1))
        (False, True)
    """
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class StreamState:
    """A stateful stream's ``state_dict()`` at its last :data:`KEPT` batch boundaries, and the one a resume
    loads before it reads on.

    Example:
        >>> class Counter:
        ...     n = 0
        ...     def state_dict(self): return {"n": self.n}
        ...     def load_state_dict(self, state): self.n = state["n"]
        >>> stream = Counter(); kept = StreamState(stream)
        >>> stream.n = 5; kept.record(0, 1); kept.at(0, 1)
        {'n': 5}
        >>> kept.restore_at(0, 1, {"n": 2}); kept.resume(0, 1), stream.n
        (True, 2)
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self._kept: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._lock = threading.Lock()  # recorded by the prefetch thread, read by the loop's
        self._pending: tuple[tuple[int, int], Any] | None = None

    def record(self, epoch: int, index: int) -> None:
        """Keep the stream's state now that batch ``index`` of ``epoch`` has been read."""
        state = copy.deepcopy(self.owner.state_dict())  # a copy: the stream may keep changing its own
        with self._lock:
            self._kept[(epoch, index)] = state
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)

    def at(self, epoch: int, index: int) -> Any:
        """The state once batch ``index`` of ``epoch`` was read (``None``: not kept)."""
        with self._lock:
            return self._kept.get((epoch, index))

    def restore_at(self, epoch: int, index: int, state: Any) -> None:
        """Load ``state`` when the stream is next read from batch ``index`` of ``epoch``."""
        self._pending = ((epoch, index), state)

    def resume(self, epoch: int, start_index: int) -> bool:
        """Load the pending state if it is this position's: True when the stream now stands there."""
        if self._pending is None or self._pending[0] != (epoch, start_index):
            return False
        state, self._pending = self._pending[1], None
        self.owner.load_state_dict(state)
        return True


def warn_not_replayed(dataset: str, epoch: int, index: int) -> None:
    """The :class:`~functrain.data.ResumeWarning` of a stream whose replay differs from the interrupted run."""
    warnings.warn(
        f"functrain: this resume is not exact: the stream {dataset} replayed a different batch {index} of "
        f"epoch {epoch} than the interrupted run trained on (it does not yield the same examples on every "
        "pass), so training continues on other batches. For an exact resume make each pass of an epoch "
        "repeat (seed its randomness from set_epoch(epoch)), give it state_dict() and load_state_dict() "
        "(Hugging Face streaming datasets and torchdata's StatefulDataLoader have them), or use a map-style "
        "dataset",
        ResumeWarning,
        stacklevel=2,
    )
