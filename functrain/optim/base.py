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

Norms are an argument, not a setting: a transformation that takes a norm over its leaves
(``clip_by_global_norm``, LAMB's trust ratio) accepts ``update(..., norm=fn)``, with ``fn`` a
:data:`NormFn` (per-leaf L2 norms; the default is each leaf's own). A ZeRO-sharded step, whose leaves hold
only this rank's rows, passes a ``fn`` that all-reduces them, so clipping is global
(``functrain.distributed.sharded_step``). ``chain`` and the wrappers (``masked``, ``freeze``,
``multi_transform``, ``skip_not_finite``) forward ``norm`` to the transformations that accept it (their
update has a ``norm`` parameter; optax forwards its ``extra_args`` the same way); the others are called as
before. This keeps ``update(updates, state, params)`` the whole protocol for everything else, and the
transform's result a function of its arguments only.

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

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from functrain import tree
from functrain.core import foreach
from functrain.optim._leaves import describe_mismatch
from functrain.tree import PyTree

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "NormFn",
    "OptState",
    "ScalarOrSchedule",
    "Schedule",
    "apply_gradients",
    "apply_updates",
    "chain",
    "identity",
    "set_to_zero",
    "stateless_leafwise",
    "takes_norm",
    "update_with_norm",
]

OptState = Any
"""An optimizer state: a ``tree.struct``, a tuple of states, or another pytree of tensors."""

Schedule = Callable[[Any], torch.Tensor]
"""A function ``count -> value``: a 0-d int tensor (or a Python int) to a 0-d float tensor."""

ScalarOrSchedule = float | Schedule

NormFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]
"""Per-leaf L2 norms: ``fn(leaves) -> [norm of each leaf]`` (0-d tensors). ``functrain.core.foreach.norm``
(each leaf's own) by default; a sharded step's all-reduces the squares over the ranks' rows."""


class InitFn(Protocol):
    def __call__(self, params: PyTree) -> OptState: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: PyTree, state: OptState, params: PyTree | None = None
    ) -> tuple[PyTree, OptState]: ...


class ApplyFn(Protocol):
    """``apply(grads, state, params, *, norm=None, in_place=False)``: ``in_place=True`` lets it write the
    new params and state into the given tensors (a donated state's; nothing reads the old ones after)."""

    def __call__(
        self,
        grads: PyTree,
        state: OptState,
        params: PyTree,
        *,
        norm: NormFn | None = None,
        in_place: bool = False,
    ) -> tuple[PyTree, OptState]: ...


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
        n: int, states: tuple[OptState, ...], updates: PyTree, params: PyTree, norm: NormFn | None
    ) -> tuple[PyTree, tuple[OptState, ...]]:
        new_states = []
        for tx, s in zip(transforms[:n], states):
            updates, s = update_with_norm(tx, updates, s, params, norm)
            new_states.append(s)
        return updates, tuple(new_states)

    def update(
        updates: PyTree,
        state: tuple[OptState, ...],
        params: PyTree | None = None,
        *,
        norm: NormFn | None = None,
    ) -> tuple[PyTree, tuple[OptState, ...]]:
        check(state)
        return run(len(transforms), state, updates, params, norm)

    last_apply = transforms[-1].apply if transforms else None

    def apply(
        grads: PyTree,
        state: tuple[OptState, ...],
        params: PyTree,
        *,
        norm: NormFn | None = None,
        in_place: bool = False,
    ) -> tuple[PyTree, tuple[OptState, ...]]:
        check(state)
        grads, head = run(len(transforms) - 1, state[:-1], grads, params, norm)
        params, last = last_apply(grads, state[-1], params, norm=norm, in_place=in_place)  # type: ignore[misc]
        return params, (*head, last)

    return GradientTransformation(init, update, apply if last_apply is not None else None)


def takes_norm(tx: GradientTransformation) -> bool:
    """Whether ``tx.update`` accepts ``norm=`` (a :data:`NormFn`).

    Example:
        >>> from functrain import optim
        >>> takes_norm(optim.clip_by_global_norm(1.0)), takes_norm(optim.scale(2.0))
        (True, False)
    """
    try:
        parameters = inspect.signature(tx.update).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return "norm" in parameters


def update_with_norm(
    tx: GradientTransformation, updates: PyTree, state: OptState, params: PyTree | None, norm: NormFn | None
) -> tuple[PyTree, OptState]:
    """``tx.update(updates, state, params)``, with ``norm=norm`` when a norm is given and ``tx`` takes it
    (:func:`takes_norm`): how ``chain`` and the wrappers forward the norm.

    Example:
        >>> from functrain import optim
        >>> tx = optim.scale(2.0)
        >>> update_with_norm(tx, {"w": torch.ones(1)}, tx.init({}), None, None)[0]
        {'w': tensor([2.])}
    """
    if norm is not None and takes_norm(tx):
        return tx.update(updates, state, params, norm=norm)
    return tx.update(updates, state, params)


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
    tx: GradientTransformation,
    grads: PyTree,
    opt_state: OptState,
    params: PyTree,
    *,
    norm: NormFn | None = None,
    in_place: bool = False,
) -> tuple[PyTree, OptState]:
    """One optimizer step: ``(new_params, new_opt_state)``; ``tx.apply`` when it has one, else
    ``tx.update`` followed by :func:`apply_updates`.

    ``norm``: the per-leaf norm function the transformations' norms use (:data:`NormFn`; ``None``: each
    leaf's own). ``in_place``: ``tx.apply`` may write into ``params`` and ``opt_state``'s tensors (a train
    step passes it for a donated state; the results are the same tensors, updated).

    Example:
        >>> from functrain import optim
        >>> tx = optim.sgd(0.5)
        >>> params = {"w": torch.ones(2)}
        >>> optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params), params)[0]
        {'w': tensor([0.5000, 0.5000])}
    """
    if tx.apply is not None:
        return tx.apply(grads, opt_state, params, norm=norm, in_place=in_place)
    updates, opt_state = update_with_norm(tx, grads, opt_state, params, norm)
    return apply_updates(params, updates), opt_state
