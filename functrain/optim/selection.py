"""Choosing parameters by name: masks and labels for :func:`freeze`, :func:`masked`, :func:`multi_transform`.

A parameter's name is its path in the params tree joined with dots: for the flat ``dict`` from
``model.named_parameters()`` that is the key itself (``"encoder.fc.weight"``). Patterns are shell globs
(``fnmatch``: ``*`` also matches dots, so ``"backbone.*"`` covers every depth) or compiled regular
expressions (``re.compile(r"...")``, matched with ``fullmatch``). A pattern that matches nothing is an
error: it is almost always a typo.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 1))
    >>> params = dict(model.named_parameters())
    >>> optim.names_by_module_index(model, [0, -1])
    ['0.weight', '0.bias', '2.weight', '2.bias']
    >>> optim.mask_by_name(params, optim.batchnorm_param_names(model))["1.weight"]
    True
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence

import optree
import torch

from functrain import tree
from functrain.tree import PyTree

__all__ = [
    "Pattern",
    "batchnorm_param_names",
    "labels_by_name",
    "mask_by_name",
    "names_by_module_index",
    "param_names",
]

Pattern = str | re.Pattern[str]


def param_names(params: PyTree) -> list[str]:
    """The dotted name of every leaf of ``params``, in leaf order.

    Example:
        >>> param_names({"fc": {"weight": torch.ones(1), "bias": torch.ones(1)}})
        ['fc.bias', 'fc.weight']
    """
    return [".".join(str(k) for k in path) for path in optree.tree_paths(params, namespace=tree.NAMESPACE)]


def _matches(pattern: Pattern, name: str) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _as_patterns(who: str, patterns: Pattern | Iterable[Pattern]) -> list[Pattern]:
    if isinstance(patterns, (str, re.Pattern)):
        return [patterns]
    out = list(patterns)
    for p in out:
        if not isinstance(p, (str, re.Pattern)):
            raise TypeError(
                f"{who}: a pattern must be a str glob or a compiled re.Pattern, got {type(p).__name__} {p!r}"
            )
    return out


def _no_match_error(who: str, pattern: Pattern, names: list[str]) -> ValueError:
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    text = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
    return ValueError(
        f"{who}: pattern {text!r} matches no parameter; names are: {shown}. Fix the pattern (globs use "
        "fnmatch, e.g. 'encoder.*'; regular expressions must match the whole name)"
    )


def mask_by_name(params: PyTree, patterns: Pattern | Iterable[Pattern]) -> PyTree:
    """A pytree of bools like ``params``: True where the leaf's name matches any of ``patterns``.

    Exact names (such as those from :func:`names_by_module_index`) are patterns that match themselves.
    Raises ``ValueError`` naming a pattern that matches no parameter.

    Example:
        >>> mask_by_name({"fc.weight": torch.ones(1), "fc.bias": torch.ones(1)}, "*.bias")
        {'fc.weight': False, 'fc.bias': True}
    """
    who = "mask_by_name"
    pats = _as_patterns(who, patterns)
    names = param_names(params)
    matched = [False] * len(names)
    for pattern in pats:
        hits = [i for i, name in enumerate(names) if _matches(pattern, name)]
        if not hits:
            raise _no_match_error(who, pattern, names)
        for i in hits:
            matched[i] = True
    return tree.unflatten(tree.structure(params), matched)


def labels_by_name(
    params: PyTree,
    rules: Mapping[Pattern, Hashable] | Sequence[tuple[Pattern, Hashable]],
    default: Hashable = "default",
) -> PyTree:
    """A pytree of labels like ``params`` for :func:`functrain.optim.multi_transform`.

    ``rules`` maps patterns to labels and is tried in order: the first pattern that matches a name gives
    its label; names that match none get ``default``. Raises ``ValueError`` naming a pattern that matches
    no parameter.

    Example:
        >>> params = {"backbone.0.weight": torch.ones(1), "head.weight": torch.ones(1)}
        >>> labels_by_name(params, {"backbone.*": "frozen"}, default="trained")
        {'backbone.0.weight': 'frozen', 'head.weight': 'trained'}
    """
    who = "labels_by_name"
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    _as_patterns(who, [p for p, _ in items])
    names = param_names(params)
    labels: list[Hashable | None] = [None] * len(names)
    for pattern, label in items:
        hits = [i for i, name in enumerate(names) if _matches(pattern, name)]
        if not hits:
            raise _no_match_error(who, pattern, names)
        for i in hits:
            if labels[i] is None:
                labels[i] = label
    return tree.unflatten(tree.structure(params), [default if lab is None else lab for lab in labels])


def names_by_module_index(model: torch.nn.Module, indices: int | Iterable[int]) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the parameters of ``list(model.children())[i]`` for each index.

    Negative indices count from the end, as in Python. Raises ``IndexError`` for an index out of range and
    ``ValueError`` when a chosen child has no parameters.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> names_by_module_index(model, -1)
        ['2.weight', '2.bias']
    """
    who = "names_by_module_index"
    wanted = [indices] if isinstance(indices, int) else list(indices)
    children = list(model.named_children())
    names: list[str] = []
    for index in wanted:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"{who}: indices must be ints, got {type(index).__name__} {index!r}")
        if not -len(children) <= index < len(children):
            raise IndexError(
                f"{who}: index {index} is out of range for {type(model).__name__} with {len(children)} children "
                f"({[n for n, _ in children]}); valid indices are {-len(children)}..{len(children) - 1}"
            )
        child_name, child = children[index]
        child_params = [f"{child_name}.{n}" for n, _ in child.named_parameters()]
        if not child_params:
            raise ValueError(
                f"{who}: child {index} ({child_name!r}, {type(child).__name__}) has no parameters; "
                "choose a child that does"
            )
        names.extend(n for n in child_params if n not in names)
    return names


def batchnorm_param_names(model: torch.nn.Module) -> list[str]:
    """Names of the affine parameters of every batch-norm layer of ``model`` (for "freeze BN").

    Freezing these parameters does not stop the running statistics from updating: that is the layer's
    train/eval mode, decided where the forward pass runs. Raises ``ValueError`` when the model has no
    batch-norm parameters.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
        >>> batchnorm_param_names(model)
        ['1.weight', '1.bias']
    """
    names = [
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        for param_name, _ in module.named_parameters(recurse=False)
    ]
    if not names:
        raise ValueError(
            f"batchnorm_param_names: {type(model).__name__} has no batch-norm layers with parameters "
            "(affine=False layers have none); nothing to freeze"
        )
    return names
