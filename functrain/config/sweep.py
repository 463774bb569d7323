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

The paths name fields of the config class given as ``root`` (``TrainerConfig`` passes itself), so this
module needs no import of the config it checks.

Example:
    >>> from functrain.config import TrainerConfig
    >>> normalize_sweep({"optimizer": {"lr": "1e-3,3e-3"}, "seed": [0, 1]}, "sweep", TrainerConfig)
    {'optimizer.lr': [0.001, 0.003], 'seed': [0, 1]}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from functrain.config.errors import ConfigError, Problem, suggestion

__all__ = ["SWEEPABLE", "normalize_sweep"]

# Each sweepable path -> the optimizer-state hyperparameter that carries it in the ensemble's state
# (None: the seed, carried by each member's initialisation and random key).
SWEEPABLE: dict[str, str | None] = {
    "optimizer.lr": "learning_rate",
    "optimizer.weight_decay": "weight_decay",
    "seed": None,
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


def _field(root: type, path: str) -> tuple[dataclasses.Field[Any], Any]:
    """The config field at a dotted ``path`` of the config class ``root`` and its type hint."""
    from functrain.config.section import section_of, type_hints

    cls: Any = root
    *sections, name = path.split(".")
    for section in sections:
        cls = section_of(type_hints(cls)[section])
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    return field, type_hints(cls)[name]


def _values(root: type, raw: Any, path: str, where: str) -> tuple[list[Any], list[Problem]]:
    """The values listed for ``path``, each converted and checked as the field itself would be."""
    from functrain.config.section import checked_value

    if isinstance(raw, str):
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    elif not isinstance(raw, list | tuple):
        raw = [raw]
    if not raw:
        return [], [Problem(where, "has no values", "give at least one value, e.g. [1e-3, 3e-3]")]
    field, hint = _field(root, path)
    out, problems = [], []
    for i, item in enumerate(raw):
        try:
            out.append(checked_value(field, hint, item, f"{where}[{i}]"))
        except ConfigError as err:
            problems += err.problems
    if len(set(out)) != len(out):
        problems.append(Problem(where, f"lists a value twice: {raw}", "give each value once"))
    return out, problems


def normalize_sweep(value: Any, path: str, root: type) -> dict[str, list[Any]]:
    """The ``sweep`` mapping as ``{dotted path: [values]}``, checked: sweepable fields, and each value as
    its field of the config class ``root`` checks it (type, finiteness, bounds)."""
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
        values, bad = _values(root, raw, key, where)
        problems += bad
        out[key] = values
    if problems:
        raise ConfigError(problems)
    return out
