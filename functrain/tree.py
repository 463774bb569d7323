"""Pytrees: the `struct` dataclass decorator and the tree helpers functrain needs.

Every container functrain produces (the train state, optimizer states, metric states) is a pytree that
both optree (our helpers, checkpoints) and ``torch.utils._pytree`` (``torch.func`` and ``torch.compile``)
understand. A class registered with only one of them is an opaque leaf to the other, so :func:`struct`
registers with both.

optree sorts dict keys while torch's pytree keeps insertion order: never pair leaf lists produced by the
two libraries. Every helper here goes through optree in the ``"functrain"`` namespace.

Example:
    >>> import torch
    >>> from functrain import tree
    >>> @tree.struct
    ... class Point:
    ...     x: torch.Tensor
    ...     name: str = tree.field(static=True, default="p")
    >>> p = Point(torch.ones(2))
    >>> tree.leaves(p.replace(x=torch.zeros(2)))
    [tensor([0., 0.])]
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import itertools
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import optree
import torch
import torch.utils._pytree as torch_pytree

from functrain.core import foreach

NAMESPACE = "functrain"

PyTree = Any
T = TypeVar("T")

__all__ = [
    "NAMESPACE",
    "DictSpec",
    "PyTree",
    "cast",
    "field",
    "flatten",
    "global_norm",
    "keep_where",
    "leaves",
    "map",
    "map_with_path",
    "num_bytes",
    "num_elements",
    "path_str",
    "paths",
    "same_structure",
    "struct",
    "structure",
    "unflatten",
    "zeros_like",
]


# --------------------------------------------------------------------------------------------- struct


def field(*, static: bool = False, **kwargs: Any) -> Any:
    """A dataclass field for :func:`struct`; ``static=True`` keeps it out of the pytree's leaves.

    Static fields hold configuration (functions, names, flags): they are part of the tree's structure,
    are not traced by ``torch.compile`` as tensors, and are not saved in checkpoints.

    Example:
        >>> @struct
        ... class Scaled:
        ...     value: torch.Tensor
        ...     how: str = field(static=True, default="mean")
    """
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata["static"] = static
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self: T, **changes: Any) -> T:
    """Return a copy with the given fields changed (the instance itself is never mutated).

    While dynamo traces, a struct's fields are read with builtins (see :func:`_traced_leaves`):
    ``dataclasses.replace``'s loop over the fields cost it ~40 instructions a field."""
    fields = _struct_fields(type(self))
    if fields is None or not torch.compiler.is_dynamo_compiling():
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]
    names = fields[0] + fields[1]
    current = _dict(names, builtins.map(getattr, itertools.repeat(self), names))
    return type(self)(**{**current, **changes})


def struct(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass registered as a pytree with optree and torch.

    Data fields are the children; fields declared with ``field(static=True)`` travel in the tree's
    structure. Instances compare by identity (tensors have no useful ``==``) and gain ``.replace(**kw)``.

    Example:
        >>> @struct
        ... class Average:
        ...     total: torch.Tensor
        ...     count: torch.Tensor
        >>> a = Average(torch.tensor(3.0), torch.tensor(2.0))
        >>> a.replace(count=torch.tensor(4.0)).count
        tensor(4.)
    """
    if "replace" not in cls.__dict__:
        cls.replace = _replace  # type: ignore[attr-defined]
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    static = tuple(f.name for f in fields if f.metadata.get("static", False))
    init_data = tuple(f.name for f in fields if f.init and f.name in data)
    init_static = tuple(f.name for f in fields if f.init and f.name in static)
    if len(init_data) != len(data) or len(init_static) != len(static):
        raise TypeError(f"struct {cls.__name__}: every field must be an __init__ field (init=True)")

    def flatten_fn(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, n) for n in data], tuple(getattr(obj, n) for n in static)

    def unflatten_fn(children: Iterable[Any], context: tuple[Any, ...]) -> Any:
        kwargs = dict(zip(data, children))
        kwargs.update(zip(static, context))
        return cls(**kwargs)

    def flatten_with_keys_fn(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        children, context = flatten_fn(obj)
        return [(torch_pytree.GetAttrKey(n), c) for n, c in zip(data, children)], context

    optree.register_pytree_node(
        cls,
        lambda obj: (tuple(getattr(obj, n) for n in data), tuple(getattr(obj, n) for n in static), data),
        lambda context, children: unflatten_fn(children, context),
        path_entry_type=optree.GetAttrEntry,
        namespace=NAMESPACE,
    )
    torch_pytree.register_pytree_node(
        cls,
        flatten_fn,
        unflatten_fn,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys_fn,
    )
    cls.__functrain_struct__ = (data, static)  # type: ignore[attr-defined]
    cls.__functrain_struct_class__ = cls  # type: ignore[attr-defined]  # a subclass inherits both
    return cls


def _struct_fields(kind: type) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """``(data, static)`` field names of a class made by :func:`struct` (not of a subclass: optree and
    torch know only the class registered), else None. Not ``kind.__dict__``: a mapping proxy breaks
    dynamo's graph once the trace has mutated a dict."""
    if getattr(kind, "__functrain_struct_class__", None) is not kind:
        return None
    return kind.__functrain_struct__  # type: ignore[attr-defined]


def is_struct(obj: Any) -> bool:
    """True when ``obj`` is an instance (or class) made by :func:`struct`."""
    return hasattr(obj, "__functrain_struct__")


# --------------------------------------------------------------------------------------------- optree


def map(
    fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> PyTree:
    """``optree.tree_map`` in functrain's namespace (``None`` is an empty subtree, not a leaf).

    Example:
        >>> map(lambda x: x * 2, {"a": torch.ones(1)})
        {'a': tensor([2.])}
    """
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def keep_where(pred: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``pred`` holds, else ``old``, leaf by leaf: ``torch.where(pred, new_leaf, old_leaf)``
    for each tensor leaf of ``new`` (``pred``, a bool tensor that broadcasts to it, is moved to its
    device), ``new``'s own leaf for any other. How a step keeps its old state where the update is not
    finite (fp16 overflow, ``skip_nonfinite``, ``optim.skip_not_finite``) with no branch, so no host sync.

    Eagerly, with ``pred`` one element in CPU memory and no ``torch.func`` transform active, reading it
    costs no device sync: the kept tensors are then returned as they are (``new`` itself where ``pred``
    holds), without a ``torch.where`` per leaf (a tiny BERT's skipping step made ~130 of them, ~7% of its
    eager step; benchmarks/eager_step.py).

    Example:
        >>> keep_where(torch.tensor(False), {"w": torch.ones(2), "n": 3}, {"w": torch.zeros(2), "n": 0})
        {'w': tensor([0., 0.]), 'n': 3}
    """
    if _readable_on_host(pred):
        if bool(pred):
            return new
        return map(
            lambda new_leaf, old_leaf: old_leaf if isinstance(new_leaf, torch.Tensor) else new_leaf, new, old
        )

    def pick(new_leaf: Any, old_leaf: Any) -> Any:
        if not isinstance(new_leaf, torch.Tensor):
            return new_leaf
        return torch.where(pred.to(new_leaf.device), new_leaf, old_leaf)

    return map(pick, new, old)


def _readable_on_host(pred: torch.Tensor) -> bool:
    """Whether ``pred``'s value can be read now, eagerly and without a device sync: one element of a
    plain CPU tensor, outside any compile and ``torch.func`` transform."""
    return (
        type(pred) is torch.Tensor
        and pred.device.type == "cpu"
        and pred.numel() == 1
        and not torch.compiler.is_dynamo_compiling()
        and torch._C._functorch.peek_interpreter_stack() is None
    )


def map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Like :func:`map`, with the leaf's path (a tuple of keys) as the first argument."""
    return optree.tree_map_with_path(fn, tree, *rest, namespace=NAMESPACE)


@dataclasses.dataclass(frozen=True)
class DictSpec:
    """The structure of a flat ``{str: tensor}`` dict, as :func:`flatten` gives it inside a compiled step.

    Tracing ``optree.tree_flatten`` under ``torch.compile`` runs optree's Python polyfill node by node
    (~0.6 s per flatten of a 30-leaf dict on the CPU here): the optimizer's flattens of params, grads
    and moments were half of dynamo's trace time of a train step. This spec holds the keys in insertion
    order (``keys``, what :func:`unflatten` restores) and in optree's sorted leaf order (``order``); leaf
    order and equality between two such specs are those of optree's specs.
    """

    keys: tuple[str, ...]
    order: tuple[str, ...]


def _flat_dict(tree: PyTree) -> bool:
    """Whether ``tree`` is a ``dict`` of tensors with string keys, inside dynamo's trace.

    ``is_dynamo_compiling()``, not ``torch.compiler.is_compiling``: the latter reads a process-global
    flag set for the whole compile, so a host thread (the prefetch thread's collate, the async
    checkpoint writer) asking while the main thread compiles was told "compiling" and flattened some
    samples the traced way (a ``CollateError`` between two structures that print identically). Every
    functrain branch on tracing asks dynamo's own question for the same reason
    (tests/test_compile_threads.py).
    """
    if type(tree) is not dict or not torch.compiler.is_dynamo_compiling():
        return False
    return _str_keys(tree) and _all_true(builtins.map(torch.is_tensor, tree.values()))


# Inside a trace, per-leaf work goes through builtins mapped over a whole list (``map``, ``filter``,
# ``frozenset``, ``getattr``, a dict's ``__getitem__``/``__setitem__``): dynamo runs those in its own
# code. A Python loop or comprehension, and ``set()``, ``all()``, ``dict(zip())`` (which dynamo replaces
# by Python polyfills), are interpreted instruction by instruction, ~10-20 a leaf
# (benchmarks/warm_start.py --instructions). ``builtins.map``: this module's ``map`` is the tree map.
_STR = frozenset((str,))
_TRUE = frozenset((True,))


def _str_keys(d: dict) -> bool:
    return frozenset(builtins.map(type, d)) <= _STR


def _all_true(flags: Iterable[Any]) -> bool:
    """``all(flags)`` for booleans, without the interpreted ``all``."""
    return frozenset(flags) <= _TRUE


def _values(d: dict, keys: Iterable[Any]) -> list[Any]:
    """``[d[k] for k in keys]``."""
    return list(builtins.map(d.__getitem__, keys))


def _dict(keys: Iterable[Any], values: Iterable[Any]) -> dict:
    """``dict(zip(keys, values))``."""
    out: dict = {}
    list(builtins.map(out.__setitem__, keys, values))
    return out


def _traced_leaves(tree: PyTree) -> list[Any]:
    """optree's leaves of ``tree`` (functrain's namespace) for dynamo to trace: tuples, lists, ``None``,
    dicts with string keys (sorted, as optree) and structs walked here; any other node (a namedtuple, an
    ``OrderedDict``, a subclass) by optree, whose polyfill costs dynamo ~2k instructions for a few nodes
    (the optimizer's rate and decay states, on every step's trace)."""
    out: list[Any] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = type(node)
        if isinstance(node, torch.Tensor):
            out.append(node)
            continue
        if node is None:
            continue
        if kind is tuple or kind is list:
            children = node
        elif kind is dict and _str_keys(node):
            children = _values(node, sorted(node))
        elif _struct_fields(kind) is not None:
            children = list(builtins.map(getattr, itertools.repeat(node), _struct_fields(kind)[0]))
        else:
            out.extend(optree.tree_leaves(node, namespace=NAMESPACE))
            continue
        stack.extend(children[::-1])  # (``reversed`` is a polyfill)
    return out


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in optree order."""
    if _flat_dict(tree):
        return _values(tree, sorted(tree))
    if torch.compiler.is_dynamo_compiling():
        return _traced_leaves(tree)
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec | DictSpec]:
    """``(leaves, treespec)``; rebuild with :func:`unflatten`.

    Inside a compiled step a flat dict of tensors gets a :class:`DictSpec` (cheap to trace) instead of
    an optree ``PyTreeSpec``; the leaves are the same, in the same order.
    """
    if _flat_dict(tree):
        order = tuple(sorted(tree))
        return _values(tree, order), DictSpec(tuple(tree), order)
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec | DictSpec, leaves_: Iterable[Any]) -> PyTree:
    """Inverse of :func:`flatten`."""
    if isinstance(spec, DictSpec):
        by_key = _dict(spec.order, leaves_)
        return _dict(spec.keys, builtins.map(by_key.__getitem__, spec.keys))
    return optree.tree_unflatten(spec, leaves_)


def structure(tree: PyTree) -> optree.PyTreeSpec:
    """The tree's structure (a hashable ``PyTreeSpec``)."""
    return optree.tree_structure(tree, namespace=NAMESPACE)


def same_structure(a: Any, b: Any) -> bool:
    """Whether two treespecs describe the same tree structure; safe inside a compiled step.

    ``a`` and ``b`` come from :func:`flatten` / :func:`structure` (optree) or both from
    ``torch.utils._pytree.tree_flatten``. Use this instead of ``a == b`` in code that runs inside a
    compiled step: on torch 2.10-2.12 dynamo replaces optree's treespec with a dataclass holding each
    node's unflatten function, and its ``==`` fails ("Polyfill handler <method-wrapper '__eq__' of
    function object> does not have a traceable function"). While compiling, the two specs are walked
    node by node instead: node type, keys, leaf counts, the node's data (dict keys, a struct's static
    fields; functions by identity, as Python compares them), ``None`` handling and namespace. Eagerly
    this is the libraries' own ``==``.

    Example:
        >>> same_structure(structure({"w": torch.ones(1)}), structure({"w": torch.zeros(3)}))
        True
        >>> same_structure(structure({"w": 1}), structure({"b": 1}))
        False
    """
    if isinstance(a, DictSpec) or isinstance(b, DictSpec):
        return _same_dict_spec(a, b)
    if not torch.compiler.is_dynamo_compiling():
        return bool(a == b)
    return _same_nodes(a, b)


def _same_dict_spec(a: Any, b: Any) -> bool:
    """:func:`same_structure` where one spec is a :class:`DictSpec` (a flat dict seen while compiling):
    the same keys in the same leaf order, against another DictSpec or an optree spec of a flat dict."""
    # Tuples of strings: one comparison of constants for dynamo, not a walk key by key.
    if isinstance(a, DictSpec) and isinstance(b, DictSpec):
        return a.order == b.order
    flat, other = (a, b) if isinstance(a, DictSpec) else (b, a)
    if isinstance(other, torch_pytree.TreeSpec) or other.type is not dict:
        return False
    n = len(flat.order)
    return other.num_leaves == n and other.num_nodes == n + 1 and tuple(other.entries()) == flat.order


def _same_nodes(a: Any, b: Any) -> bool:
    """The node-by-node comparison behind :func:`same_structure`, written for dynamo to trace."""
    if a.type is not b.type or a.num_leaves != b.num_leaves or a.num_nodes != b.num_nodes:
        return False
    torch_a, torch_b = isinstance(a, torch_pytree.TreeSpec), isinstance(b, torch_pytree.TreeSpec)
    if torch_a or torch_b:
        if not (torch_a and torch_b) or not _same_value(a.context, b.context):
            return False
    else:
        if a.none_is_leaf != b.none_is_leaf or a.namespace != b.namespace or a.entries() != b.entries():
            return False
        # Dynamo's stand-in for optree's spec keeps the node's data (dict keys, static fields) here.
        if not _same_value(getattr(a, "_metadata", None), getattr(b, "_metadata", None)):
            return False
    a_children, b_children = a.children(), b.children()
    if len(a_children) != len(b_children):
        return False
    return all(_same_nodes(x, y) for x, y in zip(a_children, b_children))


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def _same_value(x: Any, y: Any) -> bool:
    """``x == y`` for a node's data, with functions compared as Python does (by identity) without calling
    their ``==``, which dynamo cannot trace."""
    # Sequences first: torch 2.10's dynamo cannot trace ``is`` between two tuples.
    if (isinstance(x, tuple) and isinstance(y, tuple)) or (isinstance(x, list) and isinstance(y, list)):
        if len(x) != len(y):
            return False
        return all(_same_value(u, v) for u, v in zip(x, y))
    if x is y:
        return True
    if isinstance(x, types.MethodType) and isinstance(y, types.MethodType):
        return x.__func__ is y.__func__ and x.__self__ is y.__self__
    if isinstance(x, _FUNCTIONS) or isinstance(y, _FUNCTIONS):
        return False
    return bool(x == y)


def path_str(path: Sequence[Any]) -> str:
    """A readable dotted path: ``("opt_state", 0, "mu", "fc.weight")`` -> ``opt_state[0].mu['fc.weight']``."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        elif isinstance(key, str) and key.isidentifier():
            out += f".{key}" if out else key
        else:
            out += f"[{key!r}]"
    return out or "<root>"


def paths(tree: PyTree) -> list[str]:
    """Readable paths of every leaf, in leaf order."""
    return [path_str(p) for p in optree.tree_paths(tree, namespace=NAMESPACE)]


# --------------------------------------------------------------------------------------------- math


def _tensors(tree: PyTree) -> list[torch.Tensor]:
    xs = leaves(tree)
    if _all_true(builtins.map(torch.is_tensor, xs)):  # (``filter`` is a polyfill)
        return xs
    return [x for x in xs if isinstance(x, torch.Tensor)]


def zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of zeros with the shapes (and devices) of ``tree``'s tensor leaves."""
    return map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def cast(tree: PyTree, dtype: torch.dtype, *, floating_only: bool = True) -> PyTree:
    """Cast tensor leaves to ``dtype``; integer and bool leaves are kept when ``floating_only``.

    Example:
        >>> cast({"w": torch.ones(1), "n": torch.ones(1, dtype=torch.int64)}, torch.bfloat16)["n"].dtype
        torch.int64
    """

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if floating_only and not (x.is_floating_point() or x.is_complex()):
            return x
        return x.to(dtype)

    return map(one, tree)


def global_norm(
    tree: PyTree, norm: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
) -> torch.Tensor:
    """The L2 norm of all tensor leaves taken together, with one foreach kernel: a 0-d float32 tensor, or
    float64 where a leaf is float64 (a float64 run's clipping factor keeps its precision).

    ``norm`` takes the per-leaf norms (``functrain.optim.NormFn``; default each leaf's own): a sharded
    step's are over all ranks' rows of each leaf.

    Example:
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
        tensor(5.)
    """
    xs = _tensors(tree)
    if not xs:
        return torch.zeros(())
    norms = (foreach.norm if norm is None else norm)(xs)
    dtypes = frozenset(builtins.map(getattr, norms, itertools.repeat("dtype")))
    dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    if dtypes != {dtype}:  # else each ``.to`` would return its tensor (one node each in a trace)
        norms = [n.to(dtype) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def num_elements(tree: PyTree) -> int:
    """Total number of elements over all tensor leaves."""
    return sum(x.numel() for x in _tensors(tree))


def num_bytes(tree: PyTree) -> int:
    """Total storage, in bytes, over all tensor leaves."""
    return sum(x.numel() * x.element_size() for x in _tensors(tree))
