"""What both checkpoint managers share: a folder of step checkpoints, the retention rules, latest and best.

:class:`~functrain.checkpoint.CheckpointManager` (one file a step) and
:class:`~functrain.checkpoint.sharded.ShardedCheckpointManager` (a folder of rank files and a manifest a
step) differ in how a step is written and removed; which steps exist, which header holds a step's metrics,
how steps rank by a metric, which steps retention keeps and which step ``"latest"``/``"best"`` names are
one logic, here. A NaN (or a missing, or a non-number) metric is never best and never kept as best.

Example:
    >>> import tempfile, torch
    >>> from functrain.checkpoint import CheckpointManager
    >>> manager = CheckpointManager(tempfile.mkdtemp(), max_to_keep=1, best_metric="loss")
    >>> for step, loss in [(1, 0.5), (2, float("nan")), (3, 0.7)]:
    ...     manager.save(step, {"w": torch.ones(1)}, metrics={"loss": loss})
    >>> manager.all_steps(), manager.best(), manager.best(mode="max")
    ([1, 3], 1, 3)
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

from functrain.checkpoint import file as checkpoint_file
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.format import CheckpointHeader

__all__ = ["CheckpointFolder"]

# (path, (mtime_ns, size)) of the unreadable checkpoint files already warned about in this process
_WARNED_UNREADABLE: set[tuple[str, tuple[int, int]]] = set()


class CheckpointFolder:
    """The base of the checkpoint managers: retention arguments, headers, ranking, latest/best.

    A subclass names each step's header file (:meth:`path`) and the steps present (:meth:`all_steps`);
    it saves, and removes the steps :meth:`_kept` leaves out. Retention: the newest checkpoint is always
    kept; also the last ``max_to_keep`` (``None``: all), every step that is a multiple of ``keep_every``,
    and the ``keep_best`` best by ``best_metric`` (``best_mode`` ``"min"`` or ``"max"``), each rule
    independent of the others.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_to_keep: int | None,
        keep_every: int | None,
        best_metric: str | None,
        best_mode: Literal["min", "max"],
        keep_best: int,
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
        self._headers: dict[str, tuple[tuple[int, int], CheckpointHeader | CheckpointError]] = {}

    def path(self, step: int) -> str:
        """The file whose header holds the checkpoint of ``step`` (it may not exist)."""
        raise NotImplementedError

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints in the folder, ascending."""
        raise NotImplementedError

    def _read_header(self, step: int) -> CheckpointHeader:
        """The header of ``step``'s file, read from disk (raises :class:`CheckpointError`)."""
        return checkpoint_file.read_header(self.path(step))

    # ----------------------------------------------------------------------------------------- queries

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
        """The step with the best ``metric`` (default: ``best_metric``) by ``mode`` (default:
        ``best_mode``), or ``None`` if no checkpoint recorded it as a number (NaN never is best). The
        manager's own ``best_metric`` and ``best_mode`` stay as they are.

        Example:
            >>> manager.best(), manager.best(metric="eval/accuracy", mode="max")  # doctest: +SKIP
            (400, 500)
        """
        metric = metric or self.best_metric
        if metric is None:
            raise ValueError(
                f"best() needs a metric: pass best(metric=...) or {type(self).__name__}(best_metric=...)"
            )
        ranked = self._ranked(metric, mode or self.best_mode)
        return ranked[0] if ranked else None

    # ------------------------------------------------------------------------------- for subclasses

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
            header = self._read_header(step)
        except CheckpointError as error:
            header = error
        self._headers[path] = (version, header)
        return header

    def _readable_header(self, step: int) -> CheckpointHeader | None:
        """The header at ``step``, or ``None``: an unreadable file is skipped, and warned about once per
        file version per process (``latest()``, ``best()`` and retention all ask, from more than one
        manager)."""
        header = self._cached_header(step)
        if isinstance(header, CheckpointError):
            path = self.path(step)
            seen = (path, self._headers[path][0])  # a new version of the file is news again
            if seen not in _WARNED_UNREADABLE:
                _WARNED_UNREADABLE.add(seen)
                warnings.warn(f"ignoring unreadable checkpoint: {header}", stacklevel=3)
            return None
        return header

    def _forget(self, step: int) -> None:
        """Drop the cached header of a removed step."""
        self._headers.pop(self.path(step), None)

    def _ranked(self, metric: str, mode: str) -> list[int]:
        """Steps recording ``metric`` as a number (not NaN, not a bool), best first; ties: newest first."""
        scored = []
        for step in self.all_steps():
            header = self._readable_header(step)
            value = None if header is None else header.metrics.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # not NaN
                scored.append((value if mode == "min" else -value, -step, step))
        return [step for *_, step in sorted(scored)]

    def _kept(self, steps: list[int]) -> set[int]:
        """The steps of ``steps`` (ascending, not empty) that retention keeps."""
        keep = {steps[-1]}
        keep.update(steps if self.max_to_keep is None else steps[-self.max_to_keep :])
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.best_metric is not None and self.keep_best:
            keep.update(self._ranked(self.best_metric, self.best_mode)[: self.keep_best])
        return keep

    def _step_of(self, which: int | str) -> int:
        """The step ``which`` (``"latest"``, ``"best"`` or a step number) names; raises when there is none."""
        if which == "latest":
            step = self.latest()
        elif which == "best":
            step = self.best()
        elif isinstance(which, int) and not isinstance(which, bool):
            if which not in self.all_steps():
                raise CheckpointError(
                    f"no checkpoint of step {which} in {self.directory}; have {self.all_steps()}"
                )
            return which
        else:
            raise ValueError(f"which={which!r} must be 'latest', 'best' or a step number")
        if step is None:
            raise CheckpointError(f"no checkpoint to restore as {which!r} in {self.directory}")
        return step
