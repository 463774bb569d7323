"""Log calls inside a compiled step: ignored by dynamo instead of breaking the one graph.

Models log from ``forward`` (Hugging Face's ``logger.warning_once(...)`` about a default loss type, a
deprecated argument, ...). Dynamo refuses any ``logging.Logger`` method that is not listed in
``torch._dynamo.config.ignore_logging_functions`` (``ignore_logger_methods`` on torch 2.10; a set of
callables: ``logging.Logger.<method>`` covers every logger), so under ``fullgraph=True`` one log call
fails the whole step. :func:`ignored_logging` adds the logger's emitting methods to that set while
functrain's step compiles and runs, and takes them out again after: code compiled outside functrain is
unaffected.
The calls then do nothing inside the compiled graph; an eager step (``jit(..., compile=False)``) logs.

Example (dynamo's ``"eager"`` backend: the trace without an inductor build):
    >>> import torch
    >>> class Head(torch.nn.Module):
    ...     log = logging.getLogger("model")
    ...     def forward(self, x):
    ...         self.log.warning("no loss type given: cross entropy")
    ...         return x + 1
    >>> compiled = torch.compile(torch.nn.Sequential(Head()), fullgraph=True, backend="eager")
    >>> with ignored_logging():
    ...     compiled(torch.zeros(2))  # one graph: the warning is skipped
    tensor([1., 1.])
    >>> logging.Logger.warning in _ignore_set()  # taken out again
    False
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["ignored_logging", "logging_methods"]

_EMITTING = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")
_PREFIXES = tuple(f"{m}_" for m in _EMITTING)
_FOUND: list[Any] = []  # [identities of logging.Logger's attributes, the methods found]


def logging_methods() -> set[Any]:
    """``logging.Logger``'s emitting methods, with those libraries add in the same style
    (``warning_once``, ``info_once``, ``warning_advice``: names that start with an emitting one and ``_``).
    """
    names = vars(logging.Logger)
    # runs before every step call: reuse unless a method was added or replaced (transformers assigns
    # logging.Logger.warning_once when imported, possibly after the first step)
    key = tuple(map(id, names.values()))
    if _FOUND and _FOUND[0] == key:
        return _FOUND[1]
    found = {
        value
        for name, value in names.items()
        if callable(value) and (name in _EMITTING or name.startswith(_PREFIXES))
    }
    _FOUND[:] = [key, found]
    return found


def _ignore_set() -> set[Any] | None:
    import torch._dynamo  # here: importing this module (an eager step's) loads no dynamo

    config = torch._dynamo.config
    for name in ("ignore_logging_functions", "ignore_logger_methods"):  # the older name, torch 2.10's
        value = getattr(config, name, None)
        if isinstance(value, set):
            return value
    return None


@contextlib.contextmanager
def ignored_logging() -> Iterator[None]:
    """Let dynamo skip ``logging.Logger`` calls while the block runs (see the module docstring)."""
    ignored = _ignore_set()
    if ignored is None:  # a torch without the setting: nothing to do
        yield
        return
    added = logging_methods() - ignored
    ignored |= added
    try:
        yield
    finally:
        ignored -= added
