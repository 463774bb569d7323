"""Gradient transformations: the ``(init, update)`` pair, ``chain``, ``apply_updates`` and ``apply_gradients``.

A gradient transformation turns gradients into parameter updates and keeps its own state::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

Both functions are pure: they return new tensors and never modify their inputs, so an update compiles
into one ``torch.compile(fullgraph=True)`` graph together with the forward and backward pass.
Updates are already signed (``scale_by_learning_rate`` multiplies by ``-lr``), so applying is a sum.
A transformation may also carry ``apply(grads, state, params) -> (params, state)``, the same step done at
once (``adam``/``adamw`` run torch's fused kernel there); :func:`apply_gradients` uses it when present.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> params = {"w": torch.ones(2)}
    >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.scale_by_learning_rate(0.1))
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": torch.ones(2)}, state, params)
    >>> optim.apply_updates(params, updates)["w"]
    tensor([0.9293, 0.9293])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from functrain import _foreach as foreach
from functrain import tree
from functrain.optim._leaves import describe_mismatch
from functrain.tree import PyTree

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "OptState",
    "ScalarOrSchedule",
    "Schedule",
    "apply_gradients",
    "apply_updates",
    "chain",
    "identity",
    "set_to_zero",
    "stateless_leafwise",
]

OptState = Any
"""An optimizer state: a ``tree.struct``, a tuple of states, or another pytree of tensors."""

Schedule = Callable[[Any], torch.Tensor]
"""A function ``count -> value``: a 0-d int tensor (or a Python int) to a 0-d float tensor."""

ScalarOrSchedule = float | Schedule


class InitFn(Protocol):
    def __call__(self, params: PyTree) -> OptState: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: PyTree, state: OptState, params: PyTree | None = None
    ) -> tuple[PyTree, OptState]: ...


class ApplyFn(Protocol):
    def __call__(self, grads: PyTree, state: OptState, params: PyTree) -> tuple[PyTree, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and ``update(updates, state, params) -> (updates, state)``.

    ``apply``, when given, is ``update`` followed by :func:`apply_updates` done in one go (same state,
    same result up to rounding): an optional fast path that :func:`apply_gradients` takes.

    Example:
        >>> double = GradientTransformation(
        ...     init=lambda params: EmptyState(),
        ...     update=lambda updates, state, params=None: (tree.map(lambda u: 2 * u, updates), state),
        ... )
        >>> double.update({"w": torch.ones(1)}, double.init({}))[0]
        {'w': tensor([2.])}
    """

    init: InitFn
    update: UpdateFn
    apply: ApplyFn | None = None


@tree.struct
class EmptyState:
    """The state of a transformation that keeps nothing."""


def stateless_leafwise(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> GradientTransformation:
    """A transformation with no state that maps the list of update leaves with ``fn`` (foreach ops).

    Example:
        >>> halve = stateless_leafwise(lambda leaves: torch._foreach_mul(leaves, 0.5))
        >>> halve.update({"w": torch.ones(2)}, halve.init({}))[0]
        {'w': tensor([0.5000, 0.5000])}
    """

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None) -> tuple[PyTree, EmptyState]:
        leaves, spec = tree.flatten(updates)
        if not leaves:
            return updates, state
        return tree.unflatten(spec, fn(leaves)), state

    return GradientTransformation(init, update)


def identity() -> GradientTransformation:
    """Pass updates through unchanged.

    Example:
        >>> identity().update({"w": torch.ones(1)}, EmptyState())[0]
        {'w': tensor([1.])}
    """
    return stateless_leafwise(lambda leaves: leaves)


def set_to_zero() -> GradientTransformation:
    """Replace every update with zeros (the parameters do not move; used for frozen groups).

    Example:
        >>> set_to_zero().update({"w": torch.ones(2)}, EmptyState())[0]
        {'w': tensor([0., 0.])}
    """
    return stateless_leafwise(lambda leaves: [torch.zeros_like(x) for x in leaves])


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other; the state is the tuple of their states.

    When the last transformation has an ``apply`` (``adam``, ``adamw``), so has the chain: the others'
    updates, then that ``apply``.

    Example:
        >>> from functrain import optim
        >>> tx = optim.chain(optim.clip(0.5), optim.scale(-1.0))
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-0.5000])}
    """
    for i, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is a {type(tx).__name__}, not a GradientTransformation; "
                "pass transformations such as optim.scale_by_adam() (called, not the function itself)"
            )

    def init(params: PyTree) -> tuple[OptState, ...]:
        return tuple(tx.init(params) for tx in transforms)

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain: expected a tuple of {len(transforms)} states (from this chain's init), "
                f"got {type(state).__name__} of length {len(state) if isinstance(state, tuple) else '?'}"
            )

    def run(
        txs: tuple[GradientTransformation, ...], states: tuple[OptState, ...], updates: PyTree, params: PyTree
    ) -> tuple[PyTree, tuple[OptState, ...]]:
        new_states = []
        for tx, s in zip(txs, states):
            updates, s = tx.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    def update(
        updates: PyTree, state: tuple[OptState, ...], params: PyTree | None = None
    ) -> tuple[PyTree, tuple[OptState, ...]]:
        check(state)
        return run(transforms, state, updates, params)

    last_apply = transforms[-1].apply if transforms else None

    def apply(
        grads: PyTree, state: tuple[OptState, ...], params: PyTree
    ) -> tuple[PyTree, tuple[OptState, ...]]:
        check(state)
        grads, head = run(transforms[:-1], state[:-1], grads, params)
        params, last = last_apply(grads, state[-1], params)  # type: ignore[misc]
        return params, (*head, last)

    return GradientTransformation(init, update, apply if last_apply is not None else None)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf by leaf, as new tensors in the params' dtypes (one foreach kernel).

    Example:
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    param_leaves, spec = tree.flatten(params)
    update_leaves, update_spec = tree.flatten(updates)
    if not tree.same_structure(update_spec, spec):
        raise ValueError(
            "apply_updates: updates and params have different structures: "
            f"{describe_mismatch(updates, params, 'updates', 'params')}"
        )
    if not param_leaves:
        return params
    update_leaves = [u if u.dtype == p.dtype else u.to(p.dtype) for p, u in zip(param_leaves, update_leaves)]
    return tree.unflatten(spec, foreach.add(param_leaves, update_leaves))


def apply_gradients(
    tx: GradientTransformation, grads: PyTree, opt_state: OptState, params: PyTree
) -> tuple[PyTree, OptState]:
    """One optimizer step: ``(new_params, new_opt_state)``; ``tx.apply`` when it has one, else
    ``tx.update`` followed by :func:`apply_updates`.

    Example:
        >>> from functrain import optim
        >>> tx = optim.sgd(0.5)
        >>> params = {"w": torch.ones(2)}
        >>> optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params), params)[0]
        {'w': tensor([0.5000, 0.5000])}
    """
    if tx.apply is not None:
        return tx.apply(grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state
