"""How a pytree's shape is written into a checkpoint header, and read back, without pickle.

A tree is described by nested msgpack lists, one per node, tagged by kind: containers (``dict``,
``list``, ``tuple``, ``namedtuple``, ``struct``) hold their children; Python leaves (``None``, bools,
ints, floats, complex numbers, strings, bytes) are stored inline; a tensor leaf holds the index of its
entry in the header's tensor table. Only these tags exist, so reading a header can build nothing but
plain containers, scalars and tensors.

Paths name leaves the way :func:`functrain.tree.path_str` prints them; struct and named-tuple children
are named by field (``opt_state[0].mu['fc.weight']``), which keeps error messages readable.

Example:
    >>> import torch
    >>> node, tensors = encode({"w": torch.ones(2), "step": 3})
    >>> [path for path, _ in tensors]
    [('w',)]
    >>> decode(node, [torch.zeros(2)])
    {'w': tensor([0., 0.]), 'step': 3}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from functrain import tree
from functrain.checkpoint.errors import CheckpointError
from functrain.core.tree_walk import Path, children

__all__ = ["decode", "encode"]

_KEY_TYPES = (str, int, float, bool, type(None))
_CONTAINER_TAGS = ("dict", "list", "tuple", "namedtuple", "struct")
_INT_RANGE = (-(2**63), 2**64 - 1)  # what a msgpack integer holds


def _where(path: Path) -> str:
    return tree.path_str(path)


def _encode_leaf(obj: Any, path: Path, tensors: list[tuple[Path, torch.Tensor]]) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        tensors.append((path, obj))
        return ["tensor", len(tensors) - 1]
    if obj is None:
        return ["none"]
    if isinstance(obj, bool):
        return ["bool", obj]
    if isinstance(obj, int):
        if not _INT_RANGE[0] <= obj <= _INT_RANGE[1]:
            raise CheckpointError(
                f"{_where(path)}: the integer {obj} does not fit in 64 bits; store it as a string or a tensor"
            )
        return ["int", int(obj)]
    if isinstance(obj, float):
        return ["float", float(obj)]
    if isinstance(obj, complex):
        return ["complex", obj.real, obj.imag]
    if isinstance(obj, str):
        return ["str", str(obj)]
    if isinstance(obj, (bytes, bytearray)):
        return ["bytes", bytes(obj)]
    raise CheckpointError(
        f"{_where(path)}: cannot save a leaf of type {type(obj).__qualname__}; checkpoints hold tensors, "
        "Python scalars, strings, bytes, None and containers (dict, list, tuple, named tuple, "
        "@functrain.tree.struct). Convert it, or make its class a @functrain.tree.struct"
    )


def encode(obj: Any) -> tuple[list[Any], list[tuple[Path, torch.Tensor]]]:
    """Describe ``obj`` as a msgpack-ready node; return it with its tensors and their paths, in order.

    Static fields of a struct are configuration, not data, and are not saved.

    Example:
        >>> encode((1, None))[0]
        ['tuple', [['int', 1], ['none']]]
    """
    tensors: list[tuple[Path, torch.Tensor]] = []

    def walk(node: Any, path: Path) -> list[Any]:
        found = children(node)
        if found is None:
            return _encode_leaf(node, path, tensors)
        kind, items = found
        if kind == "dict":
            for key, _ in items:
                if not isinstance(key, _KEY_TYPES):
                    raise CheckpointError(
                        f"{_where(path)}: dict key {key!r} has type {type(key).__qualname__}; "
                        "checkpoint dict keys must be str, int, float, bool or None"
                    )
            return ["dict", [[key, walk(child, (*path, key))] for key, child in items]]
        encoded = [walk(child, (*path, key)) for key, child in items]
        if kind in ("namedtuple", "struct"):
            return [kind, type(node).__qualname__, [key for key, _ in items], encoded]
        return [kind, encoded]

    return walk(obj, ()), tensors


def decode(
    node: Any,
    tensors: Sequence[Any],
    *,
    skipped: Any = None,
    leaves: list[tuple[Path, Any]] | None = None,
    name: str = "checkpoint",
) -> Any:
    """Rebuild plain containers from a node made by :func:`encode`; tensor leaves come from ``tensors``.

    Structs and named tuples come back as a dict of their fields and a tuple respectively; ``skipped``
    stands in for a tensor whose slot in ``tensors`` is ``None`` (one that was not loaded). When
    ``leaves`` is a list, every leaf is appended to it with its path (struct and named-tuple children
    named by field, as :func:`leaves_with_paths` names them). ``name`` (the file) starts error messages.

    Example:
        >>> decode(["struct", "Point", ["x"], [["float", 1.0]]], [])
        {'x': 1.0}
    """
    reader = _Reader(tensors, skipped, leaves, name)
    try:
        result = reader.walk(node, ())
    except RecursionError:
        raise CheckpointError(f"{name}: malformed tree in header: nested too deeply") from None
    if len(reader.used) != len(tensors):
        raise CheckpointError(
            f"{name}: malformed tree in header: {len(tensors) - len(reader.used)} tensor(s) of the table are "
            "not in the tree"
        )
    return result


@dataclasses.dataclass
class _Reader:
    """One :func:`decode`: what it reads from (``tensors``), what it gives (``skipped``, ``leaves``), and the
    tensor slots used so far (each once). A node is read by the function its tag names (``_READERS``)."""

    tensors: Sequence[Any]
    skipped: Any
    leaves: list[tuple[Path, Any]] | None
    name: str
    used: set[int] = dataclasses.field(default_factory=set)

    def expect(self, condition: bool, path: Path, what: str) -> None:
        if not condition:
            raise CheckpointError(f"{self.name}: malformed tree in header at {_where(path)}: {what}")

    def walk(self, item: Any, path: Path) -> Any:
        """The value of node ``item`` at ``path``; a leaf is also added to ``leaves``."""
        self.expect(
            isinstance(item, list) and item and isinstance(item[0], str), path, "expected a tagged list"
        )
        tag, args = item[0], item[1:]
        read = _READERS.get(tag)
        if read is None:
            raise CheckpointError(
                f"{self.name}: malformed tree in header at {_where(path)}: unknown node kind {tag!r:.80}"
            )
        try:
            value = read(self, tag, args, path)
        except (ValueError, TypeError) as error:  # wrong number of arguments in a crafted node
            raise CheckpointError(
                f"{self.name}: malformed tree in header at {_where(path)}: {tag!r:.80} node: {error}"
            ) from None
        if self.leaves is not None and tag not in _CONTAINER_TAGS:
            self.leaves.append((path, value))
        return value


def _read_tensor(reader: _Reader, tag: str, args: list[Any], path: Path) -> Any:
    (index,) = args
    reader.expect(
        type(index) is int and 0 <= index < len(reader.tensors), path, f"bad tensor index {index!r}"
    )
    reader.expect(index not in reader.used, path, f"tensor {index} is used twice")
    reader.used.add(index)
    value = reader.tensors[index]
    return reader.skipped if value is None else value


def _read_none(reader: _Reader, tag: str, args: list[Any], path: Path) -> None:
    reader.expect(not args, path, "'none' takes no value")


_SCALAR_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "bytes": bytes}


def _read_scalar(reader: _Reader, tag: str, args: list[Any], path: Path) -> Any:
    (value,) = args
    reader.expect(type(value) is _SCALAR_TYPES[tag], path, f"{tag} leaf holds a {type(value).__qualname__}")
    return value


def _read_complex(reader: _Reader, tag: str, args: list[Any], path: Path) -> complex:
    real, imag = args
    reader.expect(type(real) is float and type(imag) is float, path, "complex parts must be floats")
    return complex(real, imag)


def _read_dict(reader: _Reader, tag: str, args: list[Any], path: Path) -> dict:
    (pairs,) = args
    reader.expect(isinstance(pairs, list), path, "dict items must be a list")
    out = {}
    for pair in pairs:
        reader.expect(isinstance(pair, list) and len(pair) == 2, path, "dict item must be [key, value]")
        key, child = pair
        reader.expect(isinstance(key, _KEY_TYPES), path, f"dict key of type {type(key).__qualname__}")
        out[key] = reader.walk(child, (*path, key))
    return out


def _read_sequence(reader: _Reader, tag: str, args: list[Any], path: Path) -> list | tuple:
    (children,) = args
    reader.expect(isinstance(children, list), path, f"{tag} children must be a list")
    values = [reader.walk(child, (*path, i)) for i, child in enumerate(children)]
    return values if tag == "list" else tuple(values)


def _read_fields(reader: _Reader, tag: str, args: list[Any], path: Path) -> tuple | dict:
    """A named tuple (as a tuple) or a struct (as a dict of its fields)."""
    _name, fields, children = args
    reader.expect(
        isinstance(fields, list)
        and isinstance(children, list)
        and len(fields) == len(children)
        and all(isinstance(f, str) for f in fields),
        path,
        f"{tag} needs as many string field names as children",
    )
    values = [reader.walk(child, (*path, f)) for f, child in zip(fields, children)]
    return tuple(values) if tag == "namedtuple" else dict(zip(fields, values))


_READERS = {
    "tensor": _read_tensor,
    "none": _read_none,
    **dict.fromkeys(_SCALAR_TYPES, _read_scalar),
    "complex": _read_complex,
    "dict": _read_dict,
    "list": _read_sequence,
    "tuple": _read_sequence,
    "namedtuple": _read_fields,
    "struct": _read_fields,
}
