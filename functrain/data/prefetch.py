"""Background prefetching: produce the next batches (and copy them to the device) while the step runs.

A daemon thread pulls items from an iterable, applies ``transfer`` (usually :func:`to_device`) and
hands them over through a queue of at most ``size`` items. Three guarantees:

- an exception raised while producing an item is re-raised in the consumer, with its original
  traceback (the frames of the producing thread), at the position where that item would have come;
- closing the iterator — ``close()``, leaving a ``with`` block, or dropping it after ``break`` — stops
  the thread after the item it is producing, and closes the source iterator in that thread;
- the thread is a daemon, so an abandoned producer never keeps the interpreter from exiting.

On CUDA the copies are issued on a side stream; the consumer's stream waits for them before the
batch is handed out, so copy and compute overlap without a race.

Example:
    >>> with Prefetcher(range(3), transfer=lambda x: x * 10) as items:
    ...     list(items)
    [0, 10, 20]
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from functrain.data.transfer import to_device

__all__ = ["Prefetcher", "prefetch_to_device"]

T = TypeVar("T")

_ITEM, _END, _ERROR = "item", "end", "error"
_POLL_S = 0.05  # how often a blocked producer or consumer re-checks whether the other side is gone
# close() waits this long for the item being produced; a source stuck longer is left to the daemon thread
# (it stops at its next item) rather than hanging the consumer.
_JOIN_TIMEOUT_S = 10.0


def _produce(
    source: Iterable[Any],
    transfer: Callable[[Any], Any],
    cuda_device: torch.device | None,
    out: queue.Queue,
    stop: threading.Event,
) -> None:
    # A module-level function holding no reference to the Prefetcher: the consumer object must be
    # collectable (and its __del__ able to stop us) while this thread runs.
    iterator = None
    stream = torch.cuda.Stream(cuda_device) if cuda_device is not None else None
    try:
        iterator = iter(source)
        for item in iterator:
            if stream is not None:
                with torch.cuda.stream(stream):
                    moved = transfer(item)
                message = (_ITEM, (moved, stream.record_event()))
            else:
                message = (_ITEM, (transfer(item), None))
            if not _put(out, message, stop):
                return
        _put(out, (_END, None), stop)
    except BaseException as error:  # handed to the consumer, who re-raises it
        _put(out, (_ERROR, error), stop)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _put(out: queue.Queue, message: tuple[str, Any], stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(message, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class Prefetcher(Generic[T]):
    """An iterator over ``transfer(item) for item in source``, computed ``size`` items ahead in a thread.

    Example:
        >>> items = Prefetcher([1, 2, 3], size=2)
        >>> next(items), next(items)
        (1, 2)
        >>> items.close()  # stops the thread; no more items
    """

    def __init__(
        self,
        source: Iterable[Any],
        *,
        transfer: Callable[[Any], T] | None = None,
        size: int = 2,
        device: str | torch.device | None = None,
    ) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"Prefetcher: size must be an int >= 1, got {size!r}")
        target = torch.device(device) if device is not None else None
        self._cuda_device = target if target is not None and target.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_produce,
            args=(source, transfer or (lambda item: item), self._cuda_device, self._queue, self._stop),
            name="functrain-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        while True:
            try:
                kind, payload = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("Prefetcher: the producer thread ended without a result") from None
        if kind == _END:
            self.close()
            raise StopIteration
        if kind == _ERROR:
            self.close()
            # Raising the producer's exception object keeps its traceback (the thread's frames).
            raise payload
        item, event = payload
        if event is not None:
            consumer_stream = torch.cuda.current_stream(self._cuda_device)
            consumer_stream.wait_event(event)
            _record_stream(item, consumer_stream)
        return item

    def close(self) -> None:
        """Stop the producer thread and drop prefetched items; later ``next`` calls raise StopIteration."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        # During interpreter shutdown daemon threads are frozen: joining one would only wait out the timeout.
        if self._thread is not threading.current_thread() and not sys.is_finalizing():
            self._thread.join(timeout=_JOIN_TIMEOUT_S)

    @property
    def running(self) -> bool:
        """Whether the producer thread is still alive."""
        return self._thread.is_alive()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self.close()


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    # The copies were allocated on the side stream; tell the caching allocator that the consumer's
    # stream uses them too, so their memory is not reused before the step has read it.
    from functrain import tree

    for leaf in tree.leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            leaf.record_stream(stream)


def prefetch_to_device(
    batches: Iterable[Any], device: str | torch.device | None, size: int = 2, non_blocking: bool = True
) -> Prefetcher[Any]:
    """Iterate ``batches`` with ``size`` batches loaded and moved to ``device`` ahead of the consumer.

    Example:
        >>> [b["x"].device.type for b in prefetch_to_device([{"x": torch.ones(1)}], "cpu")]
        ['cpu']
    """
    return Prefetcher(
        batches, transfer=lambda batch: to_device(batch, device, non_blocking), size=size, device=device
    )
