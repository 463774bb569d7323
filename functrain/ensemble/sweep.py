"""Sweeps: a grid of hyperparameter values trained as one ensemble.

``grid`` expands ``{"optimizer.lr": [1e-3, 3e-3], "seed": [0, 1]}`` into one member per combination and
``label`` names a member by its values. Building the sweep's state from config paths (``sweep_state``) and
reporting its results (``results``, ``best_index``, ``write_results``, ``plot_sweep``) live in
:mod:`functrain.trainer.sweep`, above the config and the logs they read; they stay reachable here by their
old names.

Example:
    >>> grid({"optimizer.lr": [1e-3, 3e-3], "seed": [0, 1]})
    [{'optimizer.lr': 0.001, 'seed': 0}, {'optimizer.lr': 0.001, 'seed': 1}, {'optimizer.lr': 0.003, 'seed': 0}, {'optimizer.lr': 0.003, 'seed': 1}]
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["grid", "label"]

# moved to functrain.trainer.sweep; reachable here by their old names (``ft.ensemble.sweep.results``)
_MOVED = ("best_index", "plot_sweep", "results", "sweep_state", "write_results")


def grid(sweep: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the swept values, the last key varying fastest (one dict per member)."""
    keys = list(sweep)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweep[k] for k in keys))]


def label(values: Mapping[str, Any]) -> str:
    """A member's swept values as a short label: ``"lr=0.001 seed=1"``.

    Example:
        >>> label({"optimizer.lr": 0.001, "seed": 1})
        'lr=0.001 seed=1'
    """
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v:g}" for k, v in values.items())


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module("functrain.trainer.sweep"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
