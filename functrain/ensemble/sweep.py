"""Sweeps, at their old address: :func:`grid` and :func:`label` (:mod:`functrain.ensemble.grid`), and the
sweep's state and results (``sweep_state``, ``results``, ``best_index``, ``write_results``,
``plot_sweep``), which live in :mod:`functrain.trainer.sweep` above the config and the logs they read and
are looked up there on first use.

Example:
    >>> grid({"optimizer.lr": [1e-3, 3e-3], "seed": [0, 1]})
    [{'optimizer.lr': 0.001, 'seed': 0}, {'optimizer.lr': 0.001, 'seed': 1}, {'optimizer.lr': 0.003, 'seed': 0}, {'optimizer.lr': 0.003, 'seed': 1}]
"""

from __future__ import annotations

import importlib
from typing import Any

from functrain.ensemble.grid import grid, label

__all__ = ["grid", "label"]  # and, looked up on first use, the names in _MOVED

_MOVED = ("best_index", "plot_sweep", "results", "sweep_state", "write_results")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module("functrain.trainer.sweep"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
