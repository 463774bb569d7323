"""A folder of checkpoints: atomic (optionally asynchronous) saves, retention rules, latest and best.

Each checkpoint is one file ``step_<step>.ckpt`` written through a temporary file and a rename, so the
folder only ever holds complete checkpoints under their final names. Only saving modifies the folder:
opening a manager, ``latest()``, ``restore()`` and the other queries never create or delete anything, so a
run can be evaluated while it trains, and read from read-only media. A writer's first save removes the
temporary files that other writers provably abandoned (see :func:`functrain._atomic.is_abandoned`).
Metrics live in each file's header and are read without loading tensors.

Example:
    >>> import tempfile, torch
    >>> manager = CheckpointManager(tempfile.mkdtemp(), max_to_keep=1, best_metric="loss", keep_best=1)
    >>> for step, loss in [(1, 0.5), (2, 0.9), (3, 0.7)]:
    ...     manager.save(step, {"w": torch.ones(1) * step}, metrics={"loss": loss})
    >>> manager.all_steps(), manager.latest(), manager.best()
    ([1, 3], 3, 1)
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from functrain._atomic import TMP_MARKER, drop_cached_pages, fsync_directory, is_abandoned
from functrain.checkpoint import file as checkpoint_file
from functrain.checkpoint import format as fmt
from functrain.checkpoint import structure
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.format import CheckpointHeader
from functrain.distributed.env import is_main_process

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^step_(\d+)\.ckpt$")
# (path, (mtime_ns, size)) of the unreadable checkpoint files already warned about in this process
_WARNED_UNREADABLE: set[tuple[str, tuple[int, int]]] = set()


class CheckpointManager:
    """Save, keep and restore the checkpoints of one run in ``directory``.

    Retention: the newest checkpoint is always kept; also the last ``max_to_keep`` (``None``: all),
    every step that is a multiple of ``keep_every``, and the ``keep_best`` best by ``best_metric``
    (``best_mode`` ``"min"`` or ``"max"``), each rule independent of the others.

    With ``async_save=True``, :meth:`save` returns once tensors are copied to host memory and the file is
    written by a background thread; at most one save is in flight, and a failure in the background is
    raised by the next :meth:`save`, :meth:`wait_until_finished` or :meth:`close`. Only the process for
    which ``is_writer`` is true writes (default: rank 0 of torch.distributed, else this process), and only
    when it saves: opening a manager and every query or restore leave the folder untouched (it need not
    exist, and may be read-only), so another process can read a run while it trains.

    Example:
        >>> with CheckpointManager("runs/a", max_to_keep=3, best_metric="val_loss") as manager:  # doctest: +SKIP
        ...     manager.save(100, state, metrics={"val_loss": 0.31})
        ...     state = manager.restore("best", target=state)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 5,
        keep_every: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        keep_best: int = 1,
        async_save: bool = False,
        fsync: bool = True,
        is_writer: bool | Callable[[], bool] | None = None,
        chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(
                f"max_to_keep={max_to_keep} must be at least 1, or None to keep every checkpoint"
            )
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every={keep_every} must be a positive number of steps, or None")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode={best_mode!r} must be 'min' or 'max'")
        if keep_best < 0:
            raise ValueError(f"keep_best={keep_best} must be 0 or more")
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.keep_every = keep_every
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.keep_best = keep_best
        self.async_save = async_save
        self.fsync = fsync
        self.chunk_bytes = chunk_bytes
        self._is_writer = is_main_process if is_writer is None else is_writer
        self._headers: dict[str, tuple[tuple[int, int], CheckpointHeader | CheckpointError]] = {}
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._prepared = False  # the folder exists and abandoned temporary files are gone (first save)

    # ----------------------------------------------------------------------------------------- queries

    @property
    def is_writer(self) -> bool:
        """Whether this process writes and deletes checkpoints."""
        return bool(self._is_writer() if callable(self._is_writer) else self._is_writer)

    def path(self, step: int) -> str:
        """The file of the checkpoint at ``step`` (it may not exist)."""
        return os.path.join(self.directory, f"step_{step:010d}.ckpt")

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints in the folder, ascending.

        Example:
            >>> manager.all_steps()  # doctest: +SKIP
            [300, 400, 500]
        """
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(match.group(1)) for name in names if (match := _NAME.match(name)))

    def latest(self) -> int | None:
        """The newest step whose header reads, or ``None`` when the folder holds no checkpoint."""
        for step in reversed(self.all_steps()):
            if self._readable_header(step) is not None:
                return step
        return None

    def header(self, step: int) -> CheckpointHeader:
        """The header of the checkpoint at ``step`` (cached; no tensor is read)."""
        header = self._cached_header(step)
        if header is None:
            raise CheckpointError(f"{self.path(step)}: no checkpoint at step {step}")
        if isinstance(header, CheckpointError):
            raise CheckpointError(str(header)) from None  # what is wrong with the file
        return header

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with ``step``, read from its header.

        Example:
            >>> manager.metrics(500)  # doctest: +SKIP
            {'val_loss': 0.31}
        """
        return dict(self.header(step).metrics)

    def best(self, metric: str | None = None, mode: Literal["min", "max"] | None = None) -> int | None:
        """The step with the best ``metric`` (default: ``best_metric``), or ``None`` if none recorded it."""
        metric = metric or self.best_metric
        if metric is None:
            raise ValueError(
                "best() needs a metric: pass best(metric=...) or CheckpointManager(best_metric=...)"
            )
        ranked = self._ranked(metric, mode or self.best_mode)
        return ranked[0] if ranked else None

    def _cached_header(self, step: int) -> CheckpointHeader | CheckpointError | None:
        """The header at ``step``, the error its file gives, or ``None`` without a file; each file version
        is read once."""
        path = self.path(step)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        version = (stat.st_mtime_ns, stat.st_size)
        cached = self._headers.get(path)
        if cached is not None and cached[0] == version:
            return cached[1]
        header: CheckpointHeader | CheckpointError
        try:
            header = checkpoint_file.read_header(path)
        except CheckpointError as error:
            header = error
        self._headers[path] = (version, header)
        return header

    def _readable_header(self, step: int) -> CheckpointHeader | None:
        """The header at ``step``, or ``None``: an unreadable file is skipped, and warned about once per
        process (``latest()``, ``best()`` and retention all ask, from more than one manager)."""
        header = self._cached_header(step)
        if isinstance(header, CheckpointError):
            path = self.path(step)
            seen = (path, self._headers[path][0])  # a new version of the file is news again
            if seen not in _WARNED_UNREADABLE:
                _WARNED_UNREADABLE.add(seen)
                warnings.warn(f"ignoring unreadable checkpoint: {header}", stacklevel=3)
            return None
        return header

    def _ranked(self, metric: str, mode: str) -> list[int]:
        scored = []
        for step in self.all_steps():
            header = self._readable_header(step)
            value = None if header is None else header.metrics.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # not NaN
                scored.append((value if mode == "min" else -value, -step, step))
        return [step for *_, step in sorted(scored)]

    # ----------------------------------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Save ``state`` as the checkpoint of ``step`` (replacing one of the same step), then apply retention.

        ``metrics`` are numbers (0-d tensors are converted); ``metadata`` is JSON-like and stored in the
        header, e.g. ``{"tied_parameters": {"head.weight": "embed.weight"}}``.

        Example:
            >>> manager.save(int(state.step), state, metrics={"loss": loss})  # doctest: +SKIP
        """
        self._check_open()
        self.wait_until_finished()
        if isinstance(step, torch.Tensor):
            step = int(step.item())
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step={step!r} must be a non-negative int")
        _refuse_sharded(state)
        if not self.is_writer:
            return
        node, tensors = structure.encode(state)
        if self.async_save:
            # Copy off the device and away from tensors a donating step may overwrite; then return.
            tensors = [(path, t.detach().to("cpu", copy=True)) for path, t in tensors]
            self._thread = threading.Thread(
                target=self._write_in_background,
                args=(step, node, tensors, metrics, metadata),
                name=f"functrain-checkpoint-step-{step}",
            )
            self._thread.start()
        else:
            self._write(step, node, tensors, metrics, metadata)

    def _write_in_background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as error:  # surfaced to the caller by the next call
            self._failure = error

    def _write(self, step: int, node: Any, tensors: list[Any], metrics: Any, metadata: Any) -> None:
        if not self._prepared:
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError as error:
                raise CheckpointError(
                    f"{self.directory}: cannot create the checkpoint folder: {error}"
                ) from error
            self._remove_abandoned_temporary_files()
            self._prepared = True
        # Earlier checkpoints are on disk and rarely read again: give their page cache to the new file
        # (on a VM, fresh pages cost ~2 s/GiB to fault in; see atomic.drop_cached_pages).
        for earlier in self.all_steps():
            drop_cached_pages(self.path(earlier))
        checkpoint_file.write_encoded(
            self.path(step),
            node,
            tensors,
            step=step,
            metrics=metrics,
            metadata=metadata,
            fsync=self.fsync,
            chunk_bytes=self.chunk_bytes,
        )
        self._apply_retention()

    def _apply_retention(self) -> None:
        steps = self.all_steps()
        if not steps:
            return
        keep = {steps[-1]}
        keep.update(steps if self.max_to_keep is None else steps[-self.max_to_keep :])
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.best_metric is not None and self.keep_best:
            keep.update(self._ranked(self.best_metric, self.best_mode)[: self.keep_best])
        removed = False
        for step in steps:
            if step not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path(step))
                self._headers.pop(self.path(step), None)
                removed = True
        if removed and self.fsync:
            fsync_directory(self.directory)

    def _remove_abandoned_temporary_files(self) -> None:
        """Remove the temporary checkpoint files whose writers are provably gone (best effort).

        Another process may be saving into this folder right now (a second writer); its temporary file
        is live and stays. A file that cannot be removed stays too: it is never read as a checkpoint.
        """
        now = time.time()
        for name in os.listdir(self.directory):
            prefix, marker, _ = name.partition(TMP_MARKER)
            if not (marker and _NAME.match(prefix)):
                continue
            path = os.path.join(self.directory, name)
            with contextlib.suppress(OSError):
                if is_abandoned(path, now=now, mtime=os.stat(path).st_mtime):
                    os.remove(path)

    def wait_until_finished(self) -> None:
        """Block until the save in flight (if any) is written; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            if isinstance(failure, CheckpointError):
                raise failure
            raise CheckpointError(f"the background checkpoint save failed: {failure!r}") from failure

    def close(self) -> None:
        """Finish the save in flight; further saves are refused."""
        if not self._closed:
            self._closed = True
            self.wait_until_finished()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.directory!r}) is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- restore

    def restore(self, which: int | Literal["latest", "best"] = "latest", target: Any = None) -> Any:
        """Load the checkpoint ``"latest"``, ``"best"`` or of a given step (see :func:`functrain.checkpoint.restore`).

        Example:
            >>> state = manager.restore("latest", target=state)  # doctest: +SKIP
        """
        self.wait_until_finished()
        if which == "latest":
            step = self.latest()
        elif which == "best":
            step = self.best()
        elif isinstance(which, int) and not isinstance(which, bool):
            step = which
            if step not in self.all_steps():
                raise CheckpointError(
                    f"no checkpoint of step {step} in {self.directory}; have {self.all_steps()}"
                )
        else:
            raise ValueError(f"which={which!r} must be 'latest', 'best' or a step number")
        if step is None:
            raise CheckpointError(f"no checkpoint to restore as {which!r} in {self.directory}")
        return checkpoint_file.restore(self.path(step), target=target)


def _refuse_sharded(state: Any) -> None:
    """One writer would keep its own shards alone: a state sharded over ranks needs the sharded manager."""
    from functrain.checkpoint.sharded import _layouts

    for _, sharded in _layouts(state):
        world = sharded.layout.request.world_size
        if world > 1:
            raise CheckpointError(
                f"this state is sharded over {world} ranks: CheckpointManager writes one process's file, "
                "which would hold that rank's shards only; use "
                "functrain.checkpoint.sharded.ShardedCheckpointManager(directory, sharding)"
            )
