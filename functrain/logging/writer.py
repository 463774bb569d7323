"""The writer protocol: ``write(step, scalars)``, ``flush()``, ``close()``; and `MultiWriter`.

Writers are host-side: they receive plain Python numbers (convert tensors first with
:func:`functrain.logging.to_floats` or a :class:`~functrain.logging.History`).

Example:
    >>> import io
    >>> from functrain.logging import ConsoleWriter
    >>> out = io.StringIO()
    >>> with MultiWriter([ConsoleWriter(out)]) as writer:
    ...     writer.write(3, {"loss": 0.5})
    >>> out.getvalue()
    'step 3 | loss 0.5\\n'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from functrain.core.atomic import replace_text

__all__ = ["MultiWriter", "Writer", "WriterBase", "as_writer", "check_scalars", "naming_file"]


@contextlib.contextmanager
def naming_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """An ``OSError`` raised inside the block leaves naming ``path``, the file being written.

    A write into a full disk or a read-only file raises ``OSError`` without a file name (``[Errno 28] No
    space left on device``); the error, kept as it is, then ends with the file's name as ``open``'s errors
    do (or, when its arguments leave no room for one, carries it in a note).

    Example:
        >>> import errno
        >>> try:
        ...     with naming_file("logs/metrics.jsonl"):
        ...         raise OSError(errno.ENOSPC, "No space left on device")
        ... except OSError as err:
        ...     str(err)
        "[Errno 28] No space left on device: 'logs/metrics.jsonl'"
    """
    try:
        yield
    except OSError as error:
        name = os.fspath(path)
        if error.filename is None and error.errno is not None:
            error.filename = name
        elif error.filename is None:
            from functrain.data.notes import add_note  # here: functrain.logging imports no torch

            note = f"functrain.logging: while writing {name}"
            if note not in getattr(error, "__notes__", ()):  # the same error may surface at write and close
                add_note(error, note)
        raise


def check_scalars(step: Any, scalars: Any) -> dict[str, int | float]:
    """Validate a ``write`` call: ``step`` an int >= 0, ``scalars`` a ``{str: number}`` mapping.

    Example:
        >>> check_scalars(1, {"loss": 2})
        {'loss': 2}
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"write: step must be an int >= 0, got {step!r}")
    if not isinstance(scalars, Mapping):
        raise TypeError(f"write: scalars must be a mapping {{name: number}}, got {type(scalars).__name__}")
    out: dict[str, int | float] = {}
    for name, value in scalars.items():
        if not isinstance(name, str) or not name or name == "step":
            raise ValueError(f"write: scalar names must be non-empty strings other than 'step', got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"write: scalar {name!r} is a {type(value).__name__}; pass a Python number "
                "(convert tensors once with functrain.logging.to_floats)"
            )
        out[name] = value
    return out


@runtime_checkable
class Writer(Protocol):
    """Anything that takes ``write(step, {name: number})``, ``flush()`` and ``close()``."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class WriterBase:
    """What a writer supports, declared here with its defaults (override what a writer does itself), and
    context-manager support: ``with JSONLWriter(dir) as w: ...`` closes ``w``."""

    def resume_from(self, step: int | None) -> None:
        """The step a resumed run restarts from (``None``: a fresh run), told by ``fit`` before the first
        write. A writer that keeps no files of its own has nothing to trim: ignored by default."""

    def flush(self) -> None:
        """Nothing buffered by default."""

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Adapted(WriterBase):
    """A writer of the user's own that is no :class:`WriterBase`: only ``write`` is required; its
    ``flush`` and ``resume_from`` are called when it has them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.inner.write(step, scalars)

    def resume_from(self, step: int | None) -> None:
        if hasattr(self.inner, "resume_from"):
            self.inner.resume_from(step)

    def flush(self) -> None:
        if hasattr(self.inner, "flush"):
            self.inner.flush()


def as_writer(writer: Any) -> WriterBase:
    """``writer`` as a :class:`WriterBase` (whose ``resume_from`` and ``flush`` may be called): itself,
    or an adapter over an object with only ``write(step, scalars)``.

    Example:
        >>> class Printer:
        ...     def write(self, step, scalars): print(step, scalars)
        >>> as_writer(Printer()).flush()  # Printer has no flush: nothing to do
    """
    return writer if isinstance(writer, WriterBase) else _Adapted(writer)


class LazyWriter(WriterBase):
    """A writer that opens its files at the first write, so that ``fit`` can first tell it, with
    :meth:`resume_from`, the step a resumed run restarts from (later entries are then dropped, earlier
    ones kept). Without a resume step the files start empty.
    """

    def __init__(self, resume_step: int | None = None) -> None:
        self._resume_step = resume_step
        self._opened = False

    def resume_from(self, step: int | None) -> None:
        """Keep entries up to ``step`` (``None``: start fresh); must come before the first write."""
        if self._opened:
            raise RuntimeError(f"{type(self).__name__}.resume_from: the writer has already been written to")
        self._resume_step = step

    def _ensure_open(self) -> None:
        if not self._opened:
            self._open(self._resume_step)
            self._opened = True

    def _open(self, resume_step: int | None) -> None:
        raise NotImplementedError


class FileWriter(LazyWriter):
    """A :class:`LazyWriter` of one file ``log_dir/filename``. Nothing is written, not even the folder,
    before the first write: a run refused after its writers were made leaves its directory as it was."""

    def __init__(
        self, log_dir: str | os.PathLike[str], filename: str, resume_step: int | None = None
    ) -> None:
        self.path = Path(log_dir) / filename
        super().__init__(resume_step)

    def _ensure_open(self) -> None:
        if not self._opened:
            with naming_file(self.path):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                super()._ensure_open()


class RunIdWriter(FileWriter):
    """A :class:`FileWriter` whose file keeps the id of a run in an outside tracker (W&B, MLflow), so that a
    resumed functrain run logs into the same tracker run instead of starting a new one.
    """

    def stored_run_id(self, resume_step: int | None) -> str | None:
        """The id a previous run stored, when resuming (``resume_step`` is not ``None``) and there is one."""
        if resume_step is None or not self.path.exists():
            return None
        return self.path.read_text().strip() or None

    def store_run_id(self, run_id: str) -> None:
        """Keep ``run_id`` for a later resume (atomically: a crash leaves the old id or the new one)."""
        replace_text(self.path, run_id)


class MultiWriter(WriterBase):
    """Fan one ``write`` out to several writers.

    Example:
        >>> MultiWriter([]).write(0, {"loss": 1.0})
    """

    def __init__(self, writers: Iterable[Writer]) -> None:
        self.writers = list(writers)
        for w in self.writers:
            if not isinstance(w, Writer):
                raise TypeError(f"MultiWriter: {type(w).__name__} lacks write/flush/close")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for w in self.writers:
            w.write(step, scalars)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()
