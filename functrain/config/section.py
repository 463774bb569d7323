"""Config sections: frozen, keyword-only dataclasses that check and convert every field when built.

A section declares its fields with :func:`option` (a default, a one-line ``doc``, numeric bounds) and
its cross-field checks with :func:`rule`. Building one, directly or through ``from_dict``, coerces each
field to its type hint (see :mod:`functrain.config.coerce`), checks bounds, runs the rules, and raises
one :class:`ConfigError` with every problem. Sections are frozen: setting a misspelled attribute
(``config.epoch_num = 3``) fails instead of being silently ignored; use ``replace``.

Example:
    >>> @config_section("demo")
    ... class Demo(ConfigSection):
    ...     size: int = option(8, doc="Items per batch.", minimum=1)
    >>> Demo.from_dict({"size": "16"}).size
    16
    >>> Demo(size=0)
    Traceback (most recent call last):
    ...
    functrain.config.errors.ConfigError: 1 problem in the trainer config:
      - demo.size: must be >= 1, got 0. Fix: set demo.size to 1 or more
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from functrain.config.coerce import coerce, is_section
from functrain.config.errors import ConfigError, Problem, did_you_mean
from functrain.config.names import RENAMED_FIELDS

__all__ = [
    "ConfigSection",
    "checked_value",
    "config_section",
    "field_docs",
    "leaf_paths",
    "option",
    "rule",
    "section_of",
    "type_hints",
]

S = TypeVar("S", bound="ConfigSection")
RuleFn = Callable[[Any], Iterable[Problem]]

_MISSING: Any = dataclasses.MISSING


def option(
    default: Any = _MISSING,
    *,
    doc: str,
    default_factory: Callable[[], Any] = _MISSING,
    minimum: float | None = None,
    greater_than: float | None = None,
    maximum: float | None = None,
    less_than: float | None = None,
    normalize: Callable[[Any, str], Any] | None = None,
) -> Any:
    """A section field: its default, a one-line ``doc`` (its ``help``), optional bounds and a normalizer.

    ``normalize(value, path)`` runs before type coercion and turns accepted shorthands into the
    canonical form (e.g. a metric name into ``{name: {}}``).

    Example:
        >>> f = option(1, doc="Micro-batches per optimizer step.", minimum=1)
        >>> f.metadata["help"]
        'Micro-batches per optimizer step.'
    """
    metadata = {
        "help": doc,
        "minimum": minimum,
        "greater_than": greater_than,
        "maximum": maximum,
        "less_than": less_than,
        "normalize": normalize,
    }
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def rule(*fields: str) -> Callable[[RuleFn], RuleFn]:
    """Mark a method ``(self) -> Iterable[Problem]`` as a cross-field check reading ``fields``.

    A rule is skipped when one of its fields already failed its own check, so one mistake is
    reported once, not again by every rule that reads the field.

    Example:
        >>> @rule("warmup_steps", "warmup_ratio")
        ... def _one_warmup(self):
        ...     return []
    """

    def mark(fn: RuleFn) -> RuleFn:
        fn.__config_rule_fields__ = frozenset(fields)  # type: ignore[attr-defined]
        return fn

    return mark


class ConfigSection:
    """Base of every config section; subclasses are made with :func:`config_section`.

    Example:
        >>> from functrain.config import OptimizerConfig
        >>> OptimizerConfig(lr=3e-4).replace(name="sgd").to_dict()["name"]
        'sgd'
    """

    __config_path__: ClassVar[str] = ""
    __config_rules__: ClassVar[tuple[RuleFn, ...]] = ()

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        failed: set[str] = set()
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            path = type(self).field_path(f.name)
            try:
                value = checked_value(f, hints[f.name], getattr(self, f.name), path)
            except ConfigError as err:
                problems += err.problems
                failed.add(f.name)
                continue
            object.__setattr__(self, f.name, value)
        for check in type(self).__config_rules__:
            if check.__config_rule_fields__ & failed:  # type: ignore[attr-defined]
                continue
            problems += list(check(self))
        if problems:
            raise ConfigError(problems)

    @classmethod
    def field_path(cls, name: str) -> str:
        """The dotted path of field ``name`` from the top of the config (``"optimizer.lr"``)."""
        return f"{cls.__config_path__}.{name}" if cls.__config_path__ else name

    @classmethod
    def from_dict(cls: type[S], data: Mapping[str, Any]) -> S:
        """Build from a mapping (parsed YAML), reporting unknown keys with "did you mean".

        Example:
            >>> from functrain.config import OptimizerConfig
            >>> OptimizerConfig.from_dict({"name": "AdamW", "lr": "3e-4"})
            OptimizerConfig(name='adamw', lr=0.0003, weight_decay=0.0, args={})
        """
        where = cls.__config_path__
        if not isinstance(data, Mapping):
            raise ConfigError.single(
                where, f"expected a mapping of fields, got {type(data).__name__} {data!r}", _mapping_fix(cls)
            )
        bad_keys = [k for k in data if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError.single(where, f"keys {bad_keys!r} are not strings", "use field names as keys")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (nested dicts, lists, scalars) that ``from_dict`` turns back into an equal config."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def replace(self: S, **changes: Any) -> S:
        """A validated copy with ``changes`` applied (the section itself is frozen).

        Example:
            >>> from functrain.config import OptimizerConfig
            >>> OptimizerConfig().replace(lr=0.1).lr
            0.1
        """
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def shorthand(cls, value: Any) -> Mapping[str, Any] | None:
        """The mapping a non-mapping ``value`` stands for (``"sgd"`` -> ``{"name": "sgd"}``), or None."""
        return None

    @classmethod
    def coerce_value(cls: type[S], value: Any, path: str) -> S:
        """``value`` (an instance, a mapping, or a shorthand) as an instance of this section."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        expanded = cls.shorthand(value)
        if expanded is not None:
            return cls.from_dict(expanded)
        raise ConfigError.single(
            path, f"expected a mapping of fields, got {type(value).__name__} {value!r}", _mapping_fix(cls)
        )


_SHOWN_UNKNOWN = 20  # unknown fields reported one by one (with "did you mean") before a count


def config_section(path: str) -> Callable[[type[S]], type[S]]:
    """Make ``cls`` a frozen, keyword-only dataclass section found at dotted ``path`` in the config.

    Unknown keyword arguments raise `ConfigError` with a "did you mean" (not a bare ``TypeError``).

    Example:
        >>> from functrain.config import OptimizerConfig
        >>> OptimizerConfig.__config_path__
        'optimizer'
    """

    def make(cls: type[S]) -> type[S]:
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        cls.__config_path__ = path
        cls.__config_rules__ = tuple(
            member for member in vars(cls).values() if hasattr(member, "__config_rule_fields__")
        )
        generated_init = cls.__init__
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

        @functools.wraps(generated_init)
        def __init__(self: Any, **kwargs: Any) -> None:
            unknown = [k for k in kwargs if k not in names]
            if not unknown:
                generated_init(self, **kwargs)
                return
            problems = [_unknown_field(cls, k) for k in unknown[:_SHOWN_UNKNOWN]]
            if len(unknown) > _SHOWN_UNKNOWN:  # a file of 100,000 keys: say so without 100,000 suggestions
                problems.append(
                    Problem(
                        cls.__config_path__,
                        f"{len(unknown) - _SHOWN_UNKNOWN:,} more unknown fields",
                        "`functrain train --help-config` lists every field",
                    )
                )
            try:  # report the known fields' problems too, in the same error
                generated_init(self, **{k: v for k, v in kwargs.items() if k in names})
            except ConfigError as err:
                problems += err.problems
            raise ConfigError(problems)

        cls.__init__ = __init__  # type: ignore[method-assign]
        return cls

    return make


def leaf_paths(cls: type[ConfigSection]) -> list[str]:
    """Every field path under ``cls`` (sections expanded), relative to ``cls``, in declaration order.

    Example:
        >>> from functrain.config import OptimizerConfig
        >>> leaf_paths(OptimizerConfig)
        ['name', 'lr', 'weight_decay', 'args']
    """
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        section = section_of(type_hints(cls)[f.name])
        if section is None:
            out.append(f.name)
        else:
            out += [f"{f.name}.{sub}" for sub in leaf_paths(section)]
    return out


def field_docs(cls: type[ConfigSection]) -> list[tuple[dataclasses.Field[Any], Any]]:
    """``(field, resolved type hint)`` for each field of ``cls``, in declaration order."""
    hints = type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


def section_of(hint: Any) -> type[ConfigSection] | None:
    """The section class in ``hint`` (``OptimizerConfig`` or ``EarlyStoppingConfig | None``), if any."""
    if is_section(hint):
        return hint
    for member in typing.get_args(hint):
        if is_section(member):
            return member
    return None


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a section's fields (cached: sections are built often)."""
    return typing.get_type_hints(cls)


def checked_value(field: dataclasses.Field[Any], hint: Any, value: Any, path: str) -> Any:
    """``value`` for a section's ``field`` (type ``hint``) as the section stores it: normalized,
    converted and checked against the field's bounds; raises :class:`ConfigError` naming ``path``."""
    if field.metadata.get("normalize") is not None:
        value = field.metadata["normalize"](value, path)
    value = coerce(value, hint, path)
    _check_bounds(value, field.metadata, path)
    return value


def _check_bounds(value: Any, metadata: Mapping[str, Any], path: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    checks = [
        ("minimum", lambda v, b: v >= b, ">=", "{b} or more"),
        ("greater_than", lambda v, b: v > b, ">", "a value above {b}"),
        ("maximum", lambda v, b: v <= b, "<=", "{b} or less"),
        ("less_than", lambda v, b: v < b, "<", "a value below {b}"),
    ]
    for key, holds, op, wanted in checks:
        bound = metadata.get(key)
        if bound is not None and not holds(value, bound):
            raise ConfigError.single(
                path, f"must be {op} {bound}, got {value!r}", f"set {path} to {wanted.format(b=bound)}"
            )


def _unknown_field(cls: type[ConfigSection], key: str) -> Problem:
    path = cls.field_path(key)
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    renamed = RENAMED_FIELDS.get(path)
    if renamed is not None:
        hint = f"functrain calls this field {renamed!r}"
    else:
        close = did_you_mean(key, known)
        hint = ("did you mean " + " or ".join(repr(cls.field_path(c)) for c in close) + "?") if close else ""
        if not hint:
            nested = leaf_paths(cls)
            same_leaf = [p for p in nested if p.rpartition(".")[2] == key]
            close = same_leaf or [
                p
                for p in nested
                if p.rpartition(".")[2] in did_you_mean(key, [p.rpartition(".")[2] for p in nested])
            ]
            if close:
                hint = "did you mean " + " or ".join(repr(cls.field_path(p)) for p in close[:3]) + "?"
        # a pass-through section: optimizer.args, scheduler.args, criterion.args
        if not hint and "args" in known:
            args_path = cls.field_path("args")
            hint = (
                f"if it is an argument of the {path.partition('.')[0]}, move it into {args_path} "
                f"({args_path}: {{{key}: ...}}, or {args_path}.{key}=... on the command line); "
                f"the fields here are {', '.join(known)}"
            )
        if not hint:
            hint = f"remove it; the fields here are {', '.join(known)}"
    return Problem(path, "unknown field", f"{hint} (`functrain train --help-config` lists every field)")


def _mapping_fix(cls: type[ConfigSection]) -> str:
    names = ", ".join(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    return f"write a mapping with some of: {names}"
