"""Scalar history and writers: console, JSON lines, CSV, TensorBoard, W&B, MLflow; and run plots.

Example:
    >>> import tempfile, torch
    >>> from functrain import logging as flog
    >>> history = flog.History()
    >>> history.put("loss", torch.tensor(0.5), step=1)   # no host sync here
    >>> run = tempfile.mkdtemp()
    >>> with flog.MultiWriter([flog.JSONLWriter(run), flog.CSVWriter(run)]) as writer:
    ...     writer.write(1, {"loss": history.latest("loss")})
"""

from typing import TYPE_CHECKING

from functrain.core import lazy as _lazy

# imported on first use, so `functrain plot --help` (and `functrain --help`) load no torch
_lazy.install(
    __name__,
    {
        "ConsoleWriter": "functrain.logging.console",
        "CSVWriter": "functrain.logging.csv_writer",
        **dict.fromkeys(("History", "to_floats"), "functrain.logging.history"),
        **dict.fromkeys(("JSONLWriter", "read_jsonl"), "functrain.logging.jsonl"),
        "expand_members": "functrain.core.member_names",
        **dict.fromkeys(("find_metrics", "plot_run"), "functrain.logging.plot"),
        "MLflowWriter": "functrain.logging.mlflow",
        "TensorBoardWriter": "functrain.logging.tensorboard",
        "WandbWriter": "functrain.logging.wandb",
        **dict.fromkeys(("MultiWriter", "Writer"), "functrain.logging.writer"),
    },
)

if TYPE_CHECKING:
    from functrain.core.member_names import expand_members
    from functrain.logging.console import ConsoleWriter
    from functrain.logging.csv_writer import CSVWriter
    from functrain.logging.history import History, to_floats
    from functrain.logging.jsonl import JSONLWriter, read_jsonl
    from functrain.logging.mlflow import MLflowWriter
    from functrain.logging.plot import find_metrics, plot_run
    from functrain.logging.tensorboard import TensorBoardWriter
    from functrain.logging.wandb import WandbWriter
    from functrain.logging.writer import MultiWriter, Writer

__all__ = [
    "CSVWriter",
    "ConsoleWriter",
    "History",
    "JSONLWriter",
    "MLflowWriter",
    "MultiWriter",
    "TensorBoardWriter",
    "WandbWriter",
    "Writer",
    "expand_members",
    "find_metrics",
    "plot_run",
    "read_jsonl",
    "to_floats",
]
