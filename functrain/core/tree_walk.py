"""A pytree walked by path, the way checkpoints and sharded layouts name its leaves.

Containers are dicts, lists (and deques), tuples, named tuples and :func:`functrain.tree.struct` classes;
a path is the tuple of keys from the root (``("opt_state", 0, "mu", "fc.weight")``). Below both
:mod:`functrain.checkpoint` (whose header is this walk) and :mod:`functrain.distributed` (whose sharded
layout keys its leaves by these paths).

Example:
    >>> leaves_with_paths({"a": [1, None]})
    [(('a', 0), 1), (('a', 1), None)]
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any

from functrain import tree

__all__ = ["Path", "children", "leaves_with_paths", "rebuild", "rebuild_node"]

Path = tuple[Any, ...]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def children(obj: Any) -> tuple[str, list[tuple[Any, Any]]] | None:
    """``(kind, [(key, child), ...])`` for a container (dict, list, tuple, named tuple, struct), ``None``
    for a leaf: what a checkpoint's :func:`~functrain.checkpoint.structure.encode` walks."""
    if tree.is_struct(obj) and not isinstance(obj, type):
        data, _static = obj.__functrain_struct__
        return "struct", [(name, getattr(obj, name)) for name in data]
    if _is_namedtuple(obj):
        return "namedtuple", list(zip(obj._fields, obj))
    if isinstance(obj, dict):
        return "dict", list(obj.items())
    if isinstance(obj, (list, deque)):
        return "list", list(enumerate(obj))
    if isinstance(obj, tuple):
        return "tuple", list(enumerate(obj))
    return None


def leaves_with_paths(obj: Any) -> list[tuple[Path, Any]]:
    """Every leaf of ``obj`` (``None`` included) with its path, in the order a checkpoint header lists them.

    Example:
        >>> leaves_with_paths({"a": [1, None]})
        [(('a', 0), 1), (('a', 1), None)]
    """
    out: list[tuple[Path, Any]] = []

    def walk(node: Any, path: Path) -> None:
        found = children(node)
        if found is None:
            out.append((path, node))
            return
        for key, child in found[1]:
            walk(child, (*path, key))

    walk(obj, ())
    return out


def rebuild(target: Any, leaf_fn: Callable[[Path, Any], Any]) -> Any:
    """A copy of ``target`` with every leaf replaced by ``leaf_fn(path, leaf)``; containers keep their types.

    Struct static fields, named-tuple types and dict subclasses come from ``target``.

    Example:
        >>> rebuild({"a": (1, 2)}, lambda path, leaf: leaf * 10)
        {'a': (10, 20)}
    """

    def walk(node: Any, path: Path) -> Any:
        found = children(node)
        if found is None:
            return leaf_fn(path, node)
        kind, items = found
        return rebuild_node(node, kind, items, [walk(child, (*path, key)) for key, child in items])

    return walk(target, ())


def rebuild_node(node: Any, kind: str, items: list[tuple[Any, Any]], values: list[Any]) -> Any:
    """``node`` (a container, whose ``_children`` are ``kind, items``) with its children replaced by
    ``values``, in order; its type, struct static fields and dict subclass kept."""
    if kind == "struct":
        return dataclasses.replace(node, **{key: v for (key, _), v in zip(items, values)})
    if kind == "namedtuple":
        return type(node)(*values)
    if kind == "dict":
        pairs = [(key, v) for (key, _), v in zip(items, values)]
        if isinstance(node, defaultdict):
            return defaultdict(node.default_factory, pairs)
        if isinstance(node, OrderedDict):
            return type(node)(pairs)
        return dict(pairs) if type(node) is dict else type(node)(pairs)
    if isinstance(node, deque):
        return deque(values, maxlen=node.maxlen)
    return type(node)(values)
