"""`JSONLWriter`: ``metrics.jsonl``, one JSON object per logged step (``{"step": 10, "loss": 0.5}``).

Every line is flushed to the OS as it is written, so a crash loses at most the line being written.
On resume (``resume_step=S``), lines with ``step > S`` — logged after the checkpoint the run restarts
from — and a torn last line are dropped, and writing continues in the same file, so the file never
holds a step twice. Without ``resume_step`` the file starts empty. NaN/inf are written as ``NaN`` /
``Infinity``, which Python's ``json`` reads back.

Example:
    >>> import json, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with JSONLWriter(d) as w:
    ...     w.write(1, {"loss": 0.5})
    >>> [json.loads(line) for line in open(f"{d}/metrics.jsonl")]
    [{'step': 1, 'loss': 0.5}]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from functrain.core.atomic import replace_text
from functrain.logging.writer import FileWriter, check_scalars, naming_file

__all__ = ["JSONLWriter", "read_jsonl"]


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file; a torn (partial) line is skipped.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> _ = p.write_text('{"step": 1, "loss": 2.0}\\n{"step": 2, "lo')
        >>> read_jsonl(p)
        [{'step': 1, 'loss': 2.0}]
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


class JSONLWriter(FileWriter):
    """Appends ``{"step": step, **scalars}`` lines to ``log_dir/filename``."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        filename: str = "metrics.jsonl",
        resume_step: int | None = None,
    ) -> None:
        super().__init__(log_dir, filename, resume_step)

    def _open(self, resume_step: int | None) -> None:
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r["step"] <= resume_step]
            replace_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        else:
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._ensure_open()
        record = {"step": step, **check_scalars(step, scalars)}
        with naming_file(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def flush(self) -> None:
        if self._opened and not self._file.closed:
            with naming_file(self.path):
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._opened and not self._file.closed:
            try:
                self.flush()
            finally:
                self._file.close()
