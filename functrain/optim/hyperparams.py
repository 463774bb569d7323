"""Hyperparameters that live in the optimizer state as 0-d tensors.

A transformation that has a tunable hyperparameter (the learning rate, the weight decay) keeps it in its
state as a 0-d tensor instead of closing over a Python float. A compiled step therefore reads it as an
input: a callback can log it with :func:`hyperparams` and change it with :func:`set_hyperparams`, and the
next step uses the new value without a recompile.

Names: a hyperparameter is found by its field name (``learning_rate``, ``weight_decay``, ...). When the same
name occurs more than once (``multi_transform`` with one learning rate per group), each is qualified by the
group label: ``"head/learning_rate"``, ``"backbone/learning_rate"``.

Scheduled learning rates: the state's ``learning_rate`` is the value the *last* update used (before any
update: the schedule at step 0), kept for logging. It is recomputed from the schedule at every update, so
it is read-only: :func:`set_hyperparams` refuses it and points to ``learning_rate_scale``, a multiplier on
the schedule (1.0 by default) that is settable.

Dtype: hyperparameters are float32, or float64 when any param is float64 (build the state from float64
params, e.g. ``TrainState.create(model, tx, dtype=torch.float64)``): a float64 run then applies the exact
rates and decays, in double as torch.optim does, and matches it to ~1e-15 (tests/test_optim_float64.py).
Casting a float32 state afterwards (``TrainState.to(dtype=torch.float64)``) casts the float32-rounded values
(1e-3 becomes 0.0010000000474974513); :func:`set_hyperparams` then sets exact ones.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> tx = optim.adamw(1e-3)
    >>> state = tx.init({"w": torch.zeros(2)})
    >>> sorted(optim.hyperparams(state))
    ['learning_rate', 'weight_decay']
    >>> state = optim.set_hyperparams(state, learning_rate=3e-4)
    >>> float(optim.hyperparams(state)["learning_rate"])
    0.0003000000142492354
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch

from functrain import tree
from functrain.optim.base import OptState

__all__ = ["hyperparam_field", "hyperparams", "names_of", "set_hyperparams"]

_SETTABLE = "settable"
_READ_ONLY = "read_only"


def hyperparam_field(*, read_only: bool = False) -> Any:
    """Declare a 0-d tensor field of a ``tree.struct`` state as a hyperparameter.

    ``read_only=True`` marks a value derived at every update (a scheduled learning rate): it is reported
    by :func:`hyperparams` but :func:`set_hyperparams` refuses to set it.

    Example:
        >>> @tree.struct
        ... class MyState:
        ...     momentum: torch.Tensor = hyperparam_field()
    """
    return tree.field(metadata={"hyperparam": _READ_ONLY if read_only else _SETTABLE})


@dataclasses.dataclass
class _Entry:
    labels: tuple[str, ...]
    name: str
    read_only: bool
    value: torch.Tensor
    where: str


def _walk(node: Any, labels: tuple[str, ...], where: str, visit: Callable[[_Entry], torch.Tensor]) -> Any:
    """Rebuild ``node`` with every hyperparameter replaced by ``visit(entry)``, depth first, in leaf order."""
    if tree.is_struct(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            if f.metadata.get("static", False):
                continue
            value = getattr(node, f.name)
            kind = f.metadata.get("hyperparam")
            if kind is not None:
                entry = _Entry(labels, f.name, kind == _READ_ONLY, value, f"{where}.{f.name}")
                new = visit(entry)
            else:
                new = _walk(value, labels, f"{where}.{f.name}", visit)
            if new is not value:
                changes[f.name] = new
        return node.replace(**changes) if changes else node
    if node is None or optree.tree_is_leaf(node, namespace=tree.NAMESPACE):
        return node
    children, metadata, entries, unflatten = optree.tree_flatten_one_level(node, namespace=tree.NAMESPACE)
    is_dict = isinstance(node, dict)
    new_children = []
    for key, child in zip(entries, children):
        child_labels = (*labels, str(key)) if is_dict else labels
        child_where = f"{where}[{key!r}]" if is_dict else f"{where}[{key}]"
        new_children.append(_walk(child, child_labels, child_where, visit))
    if all(a is b for a, b in zip(new_children, children)):
        return node
    return unflatten(metadata, new_children)


def _collect(opt_state: OptState) -> list[_Entry]:
    found: list[_Entry] = []

    def visit(entry: _Entry) -> torch.Tensor:
        found.append(entry)
        return entry.value

    _walk(opt_state, (), "opt_state", visit)
    return found


def _names(entries: list[_Entry]) -> list[str]:
    """Bare names where unique; ``label/name`` where a bare name repeats; ``#k`` suffixes as a last resort."""
    bare_counts: dict[str, int] = {}
    for e in entries:
        bare_counts[e.name] = bare_counts.get(e.name, 0) + 1
    names = ["/".join((*e.labels, e.name)) if bare_counts[e.name] > 1 else e.name for e in entries]
    seen: dict[str, int] = {}
    unique = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        unique.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return unique


def names_of(bare: str, names: Iterable[str]) -> list[str]:
    """The names among ``names`` (from :func:`hyperparams`) under which ``bare`` occurs: itself, and
    qualified by group labels or a position (``"head/learning_rate"``, ``"learning_rate#1"``).

    Example:
        >>> names_of("learning_rate", ["head/learning_rate", "body/learning_rate", "weight_decay"])
        ['head/learning_rate', 'body/learning_rate']
    """
    return [n for n in names if n.split("/")[-1].split("#")[0] == bare]


def hyperparams(opt_state: OptState) -> dict[str, torch.Tensor]:
    """Every hyperparameter in ``opt_state`` (however nested), by name, as the 0-d tensors themselves.

    Reading a value (``float(...)``) waits for the device: do it when logging, not inside a step.

    Example:
        >>> from functrain import optim
        >>> state = optim.sgd(0.1).init({"w": torch.zeros(1)})
        >>> optim.hyperparams(state)
        {'learning_rate': tensor(0.1000)}
    """
    entries = _collect(opt_state)
    return {name: e.value for name, e in zip(_names(entries), entries)}


def _as_like(name: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"set_hyperparams: {name} must be a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        return value.to(dtype=like.dtype, device=like.device).reshape(()).clone()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"set_hyperparams: {name} must be a number or a 0-d tensor, got {type(value).__name__}"
        )
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def set_hyperparams(opt_state: OptState, **values: float | torch.Tensor) -> OptState:
    """A new optimizer state with the named hyperparameters set; ``opt_state`` itself is unchanged.

    The new values are fresh 0-d tensors of the old dtype and device, so a compiled step does not
    recompile. A tensor value keeps its autograd history: ``torch.func.grad`` of a loss after train steps
    w.r.t. a rate set here is the hypergradient (examples/09_hypergradient.py). A bare name that is qualified by group labels here (``learning_rate`` under
    ``multi_transform``) is an error naming the qualified ones; pass those with ``**{"head/learning_rate": x}``.

    Example:
        >>> from functrain import optim
        >>> state = optim.sgd(0.1).init({"w": torch.zeros(1)})
        >>> optim.hyperparams(optim.set_hyperparams(state, learning_rate=0.01))["learning_rate"]
        tensor(0.0100)
    """
    entries = _collect(opt_state)
    names = _names(entries)
    known = set(names)
    for key in values:
        if key in known:
            continue
        qualified = names_of(key, names)
        if qualified:
            raise KeyError(
                f"set_hyperparams: {key!r} is ambiguous in this optimizer state; it occurs as {qualified}. "
                f"Set one of those, e.g. set_hyperparams(state, **{{{qualified[0]!r}: value}})"
            )
        raise KeyError(
            f"set_hyperparams: unknown hyperparameter {key!r}; this optimizer state has {sorted(known)}"
        )
    for name, e in zip(names, entries):
        if name in values and e.read_only:
            raise ValueError(
                f"set_hyperparams: {name!r} ({e.where}) follows a schedule and is recomputed at every update; "
                f"set {name.replace('learning_rate', 'learning_rate_scale')!r} to scale the schedule instead, or "
                "build the optimizer with a constant learning rate"
            )
    position = iter(names)

    def visit(entry: _Entry) -> torch.Tensor:
        name = next(position)
        if name in values:
            return _as_like(name, values[name], entry.value)
        return entry.value

    return _walk(opt_state, (), "opt_state", visit)
