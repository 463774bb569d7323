"""`TensorBoardWriter`: real TensorBoard event files through ``torch.utils.tensorboard``.

On resume from a checkpoint taken at step ``S`` the writer passes ``purge_step=S + 1``: TensorBoard
then hides the events a crashed run logged after that checkpoint, so curves do not fold back.

Example:
    >>> import tempfile
    >>> with TensorBoardWriter(tempfile.mkdtemp()) as tb:
    ...     tb.write(1, {"train/loss": 0.5})
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from functrain.logging.writer import LazyWriter, check_scalars, naming_file

__all__ = ["TensorBoardWriter"]


class TensorBoardWriter(LazyWriter):
    """``add_scalar(name, value, step)`` for every scalar; names with ``/`` group into TensorBoard sections."""

    def __init__(self, log_dir: str | os.PathLike[str], *, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # tensorboard is a dependency, but may be missing in a slim install
            raise ImportError(
                "TensorBoardWriter needs the tensorboard package: pip install tensorboard"
            ) from err
        self.log_dir = os.fspath(log_dir)
        self._summary_writer_cls = SummaryWriter
        self._closed = False
        super().__init__(resume_step)

    def _open(self, resume_step: int | None) -> None:
        purge_step = None if resume_step is None else resume_step + 1
        with naming_file(self.log_dir):
            self._writer = self._summary_writer_cls(log_dir=self.log_dir, purge_step=purge_step)

    @property
    def event_file(self) -> str:
        """The event file being written (the log folder until the first write opens one)."""
        writer = getattr(self, "_writer", None)
        file_writer = writer.file_writer if writer is not None else None
        event_writer = getattr(file_writer, "event_writer", None)
        return getattr(event_writer, "_file_name", None) or self.log_dir

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._ensure_open()
        # TensorBoard writes in a thread of its own and re-raises that thread's error (a full disk:
        # ``[Errno 28] No space left on device``, no file named) at the next call: name the file.
        with naming_file(self.event_file):
            for name, value in check_scalars(step, scalars).items():
                self._writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        if self._opened and not self._closed:
            with naming_file(self.event_file):
                self._writer.flush()

    def close(self) -> None:
        if self._opened and not self._closed:
            self._closed = True
            with naming_file(self.event_file):
                self._writer.close()
