"""A folder of checkpoints: atomic (optionally asynchronous) saves, retention rules, latest and best.

Each checkpoint is one file ``step_<step>.ckpt`` written through a temporary file and a rename, so the
folder only ever holds complete checkpoints under their final names. Only saving modifies the folder:
opening a manager, ``latest()``, ``restore()`` and the other queries never create or delete anything, so a
run can be evaluated while it trains, and read from read-only media. A writer's first save removes the
temporary files that other writers provably abandoned (see :func:`functrain.core.atomic.is_abandoned`).
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
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from functrain.checkpoint import file as checkpoint_file
from functrain.checkpoint import format as fmt
from functrain.checkpoint import structure
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.folder import CheckpointFolder
from functrain.checkpoint.placed import gather_placed
from functrain.checkpoint.shard_shapes import sharded_states
from functrain.core.atomic import TMP_MARKER, drop_cached_pages, fsync_directory, is_abandoned
from functrain.distributed.env import is_main_process

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^step_(\d+)\.ckpt$")


class CheckpointManager(CheckpointFolder):
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
        super().__init__(directory, max_to_keep, keep_every, best_metric, best_mode, keep_best)
        self.async_save = async_save
        self.fsync = fsync
        self.chunk_bytes = chunk_bytes
        self._is_writer = is_main_process if is_writer is None else is_writer
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
        header, e.g. ``{"tied_parameters": {"head.weight": "embed.weight"}}``. A tensor-parallel state is
        gathered whole first (every rank calls ``save``; the writer writes; see
        :mod:`functrain.checkpoint.placed`).

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
        state, layouts = gather_placed(state)  # a tensor-parallel state whole: every rank takes part
        metadata = {**dict(metadata or {}), **layouts}
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
        keep = self._kept(steps)
        removed = False
        for step in steps:
            if step not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path(step))
                self._forget(step)
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
        return checkpoint_file.restore(self.path(self._step_of(which)), target=target)


def _refuse_sharded(state: Any) -> None:
    """One writer would keep its own shards alone: a state sharded over ranks needs the sharded manager."""
    for _, sharded in sharded_states(state):
        world = sharded.layout.request.world_size
        if world > 1:
            raise CheckpointError(
                f"this state is sharded over {world} ranks: CheckpointManager writes one process's file, "
                "which would hold that rank's shards only; use "
                "functrain.checkpoint.sharded.ShardedCheckpointManager(directory, sharding)"
            )
