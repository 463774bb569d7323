"""Dotted ``key=value`` overrides, as typed after ``functrain train cfg.yaml``.

The value is parsed as YAML (safely, with the checks of :mod:`functrain.config.yaml_io`), so ``3e-4``, ``true``, ``null``, ``[accuracy, f1]`` and
``{momentum: 0.9}`` mean what they mean in the YAML file. Paths may reach into sections
(``optimizer.lr``) and into mappings (``optimizer.args.momentum``); a section that is off
(``early_stopping: null``) or given as a shorthand (``optimizer: sgd``) is expanded first, so
``early_stopping.patience=5`` turns early stopping on. Unknown paths are reported by the config
itself, with "did you mean".

Example:
    >>> from functrain.config import TrainerConfig
    >>> apply_overrides({"optimizer": "sgd"}, ["optimizer.lr=0.1", "metrics=[accuracy, f1]"], TrainerConfig)
    {'optimizer': {'name': 'sgd', 'lr': 0.1}, 'metrics': ['accuracy', 'f1']}
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from functrain.config.errors import ConfigError, Problem
from functrain.config.section import ConfigSection, section_of, type_hints
from functrain.config.yaml_io import load_yaml

__all__ = ["apply_overrides", "apply_well_formed_overrides", "parse_override"]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optimizer.lr=3e-4"`` -> ``(["optimizer", "lr"], "3e-4")`` (YAML 1.1 keeps that one a string).

    Example:
        >>> parse_override("epochs=5")
        (['epochs'], 5)
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        raise ConfigError.single(
            key or text, f"override {text!r} is not of the form key=value", "write e.g. optimizer.lr=3e-4"
        )
    try:
        value = load_yaml(raw, f"the override {key}") if raw.strip() else None
    except ConfigError as exc:
        raise ConfigError.single(
            key,
            f"the value {raw[:80]!r} is not valid YAML ({exc.problems[0].message})",
            "quote it: key='value'",
        ) from exc
    return parts, value


def apply_overrides(
    data: dict[str, Any], overrides: Iterable[str], root: type[ConfigSection] | None = None
) -> dict[str, Any]:
    """A copy of the config mapping ``data`` with ``overrides`` applied in order (later ones win).

    ``root`` (the section class of ``data``) lets shorthands and null sections be expanded on the way.

    Example:
        >>> apply_overrides({"scheduler": {"name": "cosine"}}, ["scheduler.args.alpha=0.1"])
        {'scheduler': {'name': 'cosine', 'args': {'alpha': 0.1}}}
    """
    out, problems = apply_well_formed_overrides(data, overrides, root)
    if problems:
        raise ConfigError(problems)
    return out


def apply_well_formed_overrides(
    data: dict[str, Any], overrides: Iterable[str], root: type[ConfigSection] | None = None
) -> tuple[dict[str, Any], list[Problem]]:
    """Like :func:`apply_overrides`, but malformed overrides are skipped and returned as problems.

    The caller can then report them together with the problems of the resulting config.

    Example:
        >>> apply_well_formed_overrides({}, ["epochs=2", "oops"])[1][0].path
        'oops'
    """
    out = copy.deepcopy(data)
    problems: list[Problem] = []
    for text in overrides:
        try:
            parts, value = parse_override(text)
            _set(out, parts, value, root)
        except ConfigError as err:
            problems += err.problems
    return out, problems


def _set(data: dict[str, Any], parts: list[str], value: Any, section: type[ConfigSection] | None) -> None:
    container = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        hint = type_hints(section).get(part) if section is not None else None
        child_section = section_of(hint) if hint is not None else None
        current = container.get(part)
        if current is None:
            current = {}
        elif not isinstance(current, dict):
            expanded = child_section.shorthand(current) if child_section is not None else None
            if expanded is None:
                raise ConfigError.single(
                    where,
                    f"is a {type(current).__name__} ({current!r}), so {'.'.join(parts)} cannot be set inside it",
                    f"set the whole value instead: {where}=...",
                )
            current = dict(expanded)
        container[part] = current
        container = current
        section = child_section
    container[parts[-1]] = value
