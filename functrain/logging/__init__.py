"""Scalar history and writers: console, JSON lines, CSV, TensorBoard; and run plots.

Example:
    >>> import tempfile, torch
    >>> from functrain import logging as flog
    >>> history = flog.History()
    >>> history.put("loss", torch.tensor(0.5), step=1)   # no host sync here
    >>> run = tempfile.mkdtemp()
    >>> with flog.MultiWriter([flog.JSONLWriter(run), flog.CSVWriter(run)]) as writer:
    ...     writer.write(1, {"loss": history.latest("loss")})
"""

from functrain.logging.console import ConsoleWriter
from functrain.logging.csv_writer import CSVWriter
from functrain.logging.history import History, to_floats
from functrain.logging.jsonl import JSONLWriter, read_jsonl
from functrain.logging.members import expand_members
from functrain.logging.plot import plot_run
from functrain.logging.tensorboard import TensorBoardWriter
from functrain.logging.writer import MultiWriter, Writer

__all__ = [
    "CSVWriter",
    "ConsoleWriter",
    "History",
    "JSONLWriter",
    "MultiWriter",
    "TensorBoardWriter",
    "Writer",
    "expand_members",
    "plot_run",
    "read_jsonl",
    "to_floats",
]
