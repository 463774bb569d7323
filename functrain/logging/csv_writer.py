"""`CSVWriter`: ``metrics.csv`` in wide format, one row per logged step, one column per scalar.

Wide rows are what people open in a spreadsheet. When a scalar appears that has no column yet (eval
metrics first logged after some training steps), the file is rewritten once, atomically, with the
wider header; earlier rows get empty cells there. Rows are appended and flushed as they come. Resume
works as for :class:`~functrain.logging.JSONLWriter`: rows with ``step > resume_step`` are dropped.

Example:
    >>> import csv, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with CSVWriter(d) as w:
    ...     w.write(1, {"loss": 0.5})
    ...     w.write(2, {"loss": 0.4, "eval/accuracy": 0.9})
    >>> list(csv.DictReader(open(f"{d}/metrics.csv")))[0]
    {'step': '1', 'loss': '0.5', 'eval/accuracy': ''}
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping

from functrain.core.atomic import replace_text
from functrain.logging.writer import FileWriter, check_scalars, naming_file

__all__ = ["CSVWriter"]


class CSVWriter(FileWriter):
    """Writes ``step`` plus one column per scalar name to ``log_dir/filename``."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        filename: str = "metrics.csv",
        resume_step: int | None = None,
    ) -> None:
        super().__init__(log_dir, filename, resume_step)

    def _open(self, resume_step: int | None) -> None:
        self._columns: list[str] = ["step"]
        rows: list[dict[str, str]] = []
        if resume_step is not None and self.path.exists():
            with open(self.path, encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or ["step"])
                for row in reader:
                    try:
                        if int(row["step"]) <= resume_step:
                            rows.append(row)
                    except (TypeError, ValueError):
                        continue  # a torn last row
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self._columns, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        if hasattr(self, "_file"):
            self._file.close()
        replace_text(self.path, buffer.getvalue())
        self._file = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115 (kept open; closed by close())
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._ensure_open()
        scalars = check_scalars(step, scalars)
        new = [name for name in scalars if name not in self._columns]
        if new:
            self._file.close()
            with open(self.path, encoding="utf-8", newline="") as f:
                rows = list(csv.DictReader(f))
            self._columns += new
            with naming_file(self.path):
                self._rewrite(rows)
        with naming_file(self.path):
            self._writer.writerow({"step": step, **scalars})
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
