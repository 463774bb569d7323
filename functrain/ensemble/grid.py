"""Grids of hyperparameter values: one ensemble member per combination, named by its values.

Example:
    >>> grid({"optimizer.lr": [1e-3, 3e-3], "seed": [0, 1]})
    [{'optimizer.lr': 0.001, 'seed': 0}, {'optimizer.lr': 0.001, 'seed': 1}, {'optimizer.lr': 0.003, 'seed': 0}, {'optimizer.lr': 0.003, 'seed': 1}]
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["grid", "label"]


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
