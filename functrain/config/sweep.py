"""The ``sweep`` field: config values trained side by side as one ensemble (``functrain.ensemble``).

A sweep maps field paths to the values to try; the run trains every combination (the grid) at once, one
ensemble member per combination, in one compiled step. Only fields whose value lives in the train state
can differ between members: the learning rate and weight decay (0-d tensors in the optimizer state) and
the seed (each member's initialisation and random key). Anything else (a batch size, a model width, an
optimizer name) changes the graph, and is refused with the field named.

YAML (nested or dotted keys, lists or comma-separated strings)::

    sweep:
      optimizer.lr: [1e-3, 3e-3, 1e-2]
      seed: 0,1,2

Example:
    >>> normalize_sweep({"optimizer": {"lr": "1e-3,3e-3"}, "seed": [0, 1]}, "sweep")
    {'optimizer.lr': [0.001, 0.003], 'seed': [0, 1]}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from functrain.config.errors import ConfigError, Problem, suggestion

__all__ = ["SWEEPABLE", "normalize_sweep"]

# path -> (type, smallest allowed value, whether the smallest is allowed)
SWEEPABLE: dict[str, tuple[type, float, bool]] = {
    "optimizer.lr": (float, 0.0, False),
    "optimizer.weight_decay": (float, 0.0, True),
    "seed": (int, 0, True),
}


def _flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        path = f"{prefix}{key}"
        if isinstance(item, Mapping):
            out.update(_flatten(item, f"{path}."))
        else:
            out[path] = item
    return out


def _values(raw: Any, kind: type, where: str) -> tuple[list[Any], list[Problem]]:
    if isinstance(raw, str):
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    elif not isinstance(raw, list | tuple):
        raw = [raw]
    if not raw:
        return [], [Problem(where, "has no values", "give at least one value, e.g. [1e-3, 3e-3]")]
    out, problems = [], []
    for i, item in enumerate(raw):
        try:
            if isinstance(item, bool):
                raise ValueError
            number = kind(float(item)) if kind is int and float(item).is_integer() else kind(item)
        except (TypeError, ValueError):
            problems.append(Problem(f"{where}[{i}]", f"{item!r} is not a {kind.__name__}", "give numbers"))
            continue
        out.append(number)
    if len(set(out)) != len(out):
        problems.append(Problem(where, f"lists a value twice: {raw}", "give each value once"))
    return out, problems


def normalize_sweep(value: Any, path: str) -> dict[str, list[Any]]:
    """The ``sweep`` mapping as ``{dotted path: [values]}``, checked: sweepable fields, numbers, bounds."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError.single(
            path,
            f"expected a mapping of field paths to values, got {value!r}",
            "write e.g. {optimizer.lr: [1e-3, 3e-3]}",
        )
    problems: list[Problem] = []
    out: dict[str, list[Any]] = {}
    for key, raw in _flatten(value).items():
        where = f"{path}.{key}"
        if key not in SWEEPABLE:
            hint = suggestion(key, SWEEPABLE)
            problems.append(
                Problem(
                    where,
                    f"{key!r} cannot be swept in one ensemble: only fields that live in the train state can "
                    f"differ between members ({', '.join(SWEEPABLE)})",
                    f"{hint + ' ' if hint else ''}run one training per value of {key!r} instead",
                )
            )
            continue
        kind, low, inclusive = SWEEPABLE[key]
        values, bad = _values(raw, kind, where)
        problems += bad
        for i, v in enumerate(values):
            if v < low or (v == low and not inclusive):
                bound = f">= {low}" if inclusive else f"> {low}"
                problems.append(Problem(f"{where}[{i}]", f"{v} is out of range", f"give values {bound}"))
        out[key] = values
    if problems:
        raise ConfigError(problems)
    return out
