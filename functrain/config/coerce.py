"""Checking a value against a field's type hint, with the few conversions that are safe and obvious.

YAML and the command line deliver text and YAML 1.1 scalars, so a config must accept:

- ``"3e-4"`` for a float (PyYAML reads exponent notation without a dot as a string) and ints for floats;
- ``"1e5"`` or ``100000.0`` for an int when the value is a whole number;
- ``"true"``/``"false"`` for a bool;
- ``false`` for the choice ``"no"`` (YAML 1.1 reads a bare ``no`` as false: ``eval_strategy: no``);
- any case for lower-case choices (``"BF16"`` -> ``"bf16"``); a single item for a list; tuples as lists.

Everything else is refused with the field path, what was expected and what to write.

Example:
    >>> coerce("3e-4", float, "optimizer.lr")
    0.0003
    >>> coerce(False, Literal["no", "steps", "epoch"], "eval_strategy")
    'no'
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from functrain.config.errors import ConfigError, suggestion

__all__ = ["coerce", "describe_type", "is_section", "plain_data"]

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def is_section(hint: Any) -> bool:
    """Whether ``hint`` is a config section class (see :mod:`functrain.config.section`)."""
    return isinstance(hint, type) and hasattr(hint, "__config_path__")


def describe_type(hint: Any) -> str:
    """A short readable name for a type hint, as shown in errors and in ``config_help``.

    Example:
        >>> describe_type(int | None), describe_type(Literal["no", "bf16"])
        ('int | null', "'no' | 'bf16'")
    """
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    if is_section(hint):
        return "section"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(describe_type(a) for a in args)
    if origin is list:
        return f"list[{describe_type(args[0])}]"
    if origin is dict:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def coerce(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked against ``hint`` (and converted where safe); raises `ConfigError` naming ``path``.

    Example:
        >>> coerce("true", bool, "compile")
        True
    """
    if hint is Any:
        return value
    if is_section(hint):
        return hint.coerce_value(value, path)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(hint), path)
    if origin is Literal:
        return _coerce_choice(value, typing.get_args(hint), path)
    if origin is list:
        return _coerce_list(value, typing.get_args(hint)[0], path)
    if origin is dict:
        return _coerce_mapping(value, path)
    if hint is bool:
        return _coerce_bool(value, path)
    if hint is int:
        return _coerce_int(value, path)
    if hint is float:
        return _coerce_float(value, path)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _wrong(value, "a string", path)
    raise TypeError(f"functrain.config: no coercion for type hint {hint!r} at {path}")  # a bug in a section


def plain_data(value: Any, path: str) -> Any:
    """``value`` as YAML-safe plain data (tuples become lists), or `ConfigError` naming ``path``.

    Example:
        >>> plain_data({"betas": (0.9, 0.999)}, "optimizer.args")
        {'betas': [0.9, 0.999]}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_data(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError.single(path, f"key {k!r} is not a string", "use string keys")
            out[k] = plain_data(v, f"{path}.{k}")
        return out
    raise ConfigError.single(
        path,
        f"holds a {type(value).__name__}, which a YAML config cannot store",
        "use numbers, strings, booleans, null, lists and mappings only",
    )


def _wrong(value: Any, expected: str, path: str) -> ConfigError:
    return ConfigError.single(
        path, f"expected {expected}, got {type(value).__name__} {shown(value)}", f"set {path} to {expected}"
    )


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters (a 5,000-digit int has no repr).

    Example:
        >>> shown(10**5000)
        '<an integer of about 5001 digits>'
    """
    try:
        text = repr(value)
    except ValueError:  # int -> str refused beyond sys.get_int_max_str_digits()
        return f"<an integer of about {math.floor(abs(value).bit_length() * math.log10(2)) + 1} digits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _coerce_union(value: Any, members: tuple[Any, ...], path: str) -> Any:
    if value is None and type(None) in members:
        return None
    candidates = [m for m in members if m is not type(None)]
    errors: list[ConfigError] = []
    for member in candidates:
        try:
            return coerce(value, member, path)
        except ConfigError as err:
            errors.append(err)
    if len(errors) == 1:
        raise errors[0]
    # a bool member reads as YAML writes it: "true or false or 'auto'"
    raise _wrong(
        value, " or ".join("true or false" if m is bool else describe_type(m) for m in members), path
    )


def _coerce_choice(value: Any, choices: tuple[Any, ...], path: str) -> Any:
    if value is False and "no" in choices:
        return "no"
    if isinstance(value, str):
        if value in choices:
            return value
        if value.lower() in choices:
            return value.lower()
    choices_shown = ", ".join(repr(c) for c in choices)
    hint = suggestion(value, [str(c) for c in choices]) if isinstance(value, str) else ""
    fix = f"{hint} " if hint else ""
    raise ConfigError.single(
        path,
        f"must be one of {choices_shown}, got {shown(value)}",
        f"{fix}set {path} to one of {choices_shown}",
    )


def _coerce_list(value: Any, item: Any, path: str) -> list[Any]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out, problems = [], []
    for i, v in enumerate(items):
        try:
            out.append(coerce(v, item, f"{path}[{i}]"))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return out


def _coerce_mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _wrong(value, "a mapping such as {momentum: 0.9}", path)
    return plain_data(value, path)


def _coerce_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise _wrong(value, "true or false", path)


def _coerce_int(value: Any, path: str) -> int:
    if isinstance(value, bool):
        raise _wrong(value, "an integer", path)
    if isinstance(value, int):
        return value
    number = _parse_float(value)
    if number is not None and math.isfinite(number) and number == int(number):
        return int(number)
    raise _wrong(value, "an integer", path)


def _coerce_float(value: Any, path: str) -> float:
    if isinstance(value, bool):
        raise _wrong(value, "a number", path)
    number = _parse_float(value)
    if number is None:
        raise _wrong(value, "a number", path)
    if not math.isfinite(number):
        raise ConfigError.single(
            path, f"must be a finite number, got {shown(value)}", f"set {path} to a finite number"
        )
    return number


def _parse_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # beyond float's range (~1.8e308)
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None
