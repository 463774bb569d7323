"""Per-group optimizers and freezing: :func:`multi_transform`, :func:`masked`, :func:`freeze`.

All three split the parameters into groups by a pytree of labels or bools shaped like the params (or a
function ``params -> labels``), and run each inner transformation on its group only: the inner
transformation sees the params tree with the other leaves replaced by ``None`` (an empty subtree), so it
keeps no state for them. What happens to the leaves *outside* the group is the difference, spelled out:

============================  =====================================================================
``multi_transform(txs, lbl)``  every leaf belongs to exactly one labelled group; each group has a tx
``masked(inner, mask)``        ``inner`` on leaves where mask is True; **other leaves pass through
                               unchanged** (their update is the incoming gradient, not zero)
``freeze(inner, frozen)``      ``inner`` on leaves where frozen is False; **frozen leaves get zero
                               updates** and no optimizer state
============================  =====================================================================

Labels and masks are read once per call on the host (they are configuration, not tensors); build them
with :func:`functrain.optim.labels_by_name` / :func:`functrain.optim.mask_by_name`.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> params = {"backbone.w": torch.ones(1), "head.w": torch.ones(1)}
    >>> tx = optim.freeze(optim.sgd(0.5), optim.mask_by_name(params, "backbone.*"))
    >>> updates, _ = tx.update({"backbone.w": torch.ones(1), "head.w": torch.ones(1)}, tx.init(params), params)
    >>> updates
    {'backbone.w': tensor([0.]), 'head.w': tensor([-0.5000])}
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import optree
import torch

from functrain import tree
from functrain.optim._leaves import describe_mismatch
from functrain.optim.base import GradientTransformation, NormFn, OptState, update_with_norm
from functrain.optim.selection import param_names
from functrain.tree import PyTree

__all__ = ["FreezeState", "MaskedState", "MultiTransformState", "freeze", "masked", "multi_transform"]

LabelTree = PyTree | Callable[[PyTree], PyTree]


@tree.struct
class MultiTransformState:
    """State of :func:`multi_transform`: each group's inner state, by label."""

    inner_states: dict[Any, OptState]


@tree.struct
class MaskedState:
    """State of :func:`masked`: the inner state (for the masked leaves only)."""

    inner_state: OptState


@tree.struct
class FreezeState:
    """State of :func:`freeze`: the inner state (for the trainable leaves only)."""

    inner_state: OptState


class _Labels:
    """Resolves a label tree (or a function ``params -> labels``) to one label per leaf, once per params layout.

    Labels are configuration: they are computed on the host at ``init`` and remembered by the tuple of
    leaf names, so ``update`` inside a compiled step looks them up instead of tracing the label function
    (pattern matching does not trace).
    """

    def __init__(self, who: str, labels: LabelTree, kind: str, check: Callable[[list[str], list[Any]], None]):
        self.who, self.labels, self.kind, self.check = who, labels, kind, check
        self.resolved: dict[tuple[str, ...], list[Any]] = {}

    def __call__(self, reference: PyTree) -> list[Any]:
        key = tuple(param_names(reference))
        found = self.resolved.get(key)
        if found is None:
            found = self._resolve(reference)
            self.check(list(key), found)
            self.resolved[key] = found
        return found

    def _resolve(self, reference: PyTree) -> list[Any]:
        labels = self.labels(reference) if callable(self.labels) else self.labels
        # None leaves of the reference are leaves outside an enclosing group (see _group): whatever the
        # labels hold there is skipped, so a full-size mask also works inside freeze/multi_transform.
        ref_leaves, ref_spec = optree.tree_flatten(reference, none_is_leaf=True, namespace=tree.NAMESPACE)
        try:
            label_leaves = ref_spec.flatten_up_to(labels)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"{self.who}: the {self.kind} tree does not match the params: "
                f"{describe_mismatch(labels, reference, self.kind, 'params')}. "
                "Build it from the same params (e.g. with optim.labels_by_name / optim.mask_by_name)."
            ) from err
        return [label for label, leaf in zip(label_leaves, ref_leaves) if leaf is not None]


def bool_labels(who: str, mask: LabelTree, kind: str) -> _Labels:
    def check(names: list[str], values: list[Any]) -> None:
        for name, value in zip(names, values):
            if not isinstance(value, bool):
                raise TypeError(
                    f"{who}: the {kind} must hold Python bools, but leaf {name!r} is {type(value).__name__} {value!r}"
                )

    return _Labels(who, mask, kind, check)


def _group(spec: Any, leaves: list[Any], indices: list[int]) -> PyTree:
    """The tree with only the leaves at ``indices``; the others become ``None`` (empty subtrees)."""
    keep = set(indices)
    return tree.unflatten(spec, [x if i in keep else None for i, x in enumerate(leaves)])


def _run_groups(
    who: str,
    transforms: Mapping[Hashable, GradientTransformation],
    label_leaves: list[Any],
    updates: PyTree,
    states: Mapping[Hashable, OptState],
    params: PyTree | None,
    norm: NormFn | None = None,
) -> tuple[list[Any], dict[Hashable, OptState], Any, list[bool]]:
    """Run each group's transform; returns the output leaves, new states, treespec, and which leaves were handled."""
    update_leaves, spec = tree.flatten(updates)
    param_leaves = None
    if params is not None:
        param_leaves, param_spec = tree.flatten(params)
        if not tree.same_structure(param_spec, spec):
            raise ValueError(
                f"{who}: updates and params differ: {describe_mismatch(updates, params, 'updates', 'params')}"
            )
    out = list(update_leaves)
    handled = [False] * len(out)
    new_states = {}
    for label, tx in transforms.items():
        indices = [i for i, lab in enumerate(label_leaves) if lab == label]
        group_updates = _group(spec, update_leaves, indices)
        group_params = None if param_leaves is None else _group(spec, param_leaves, indices)
        new_group, new_states[label] = update_with_norm(tx, group_updates, states[label], group_params, norm)
        new_leaves = tree.leaves(new_group)
        if len(new_leaves) != len(indices):
            raise ValueError(f"{who}: the transform for {label!r} changed the number of leaves")
        for i, x in zip(indices, new_leaves):
            out[i] = x
            handled[i] = True
    return out, new_states, spec, handled


def _init_groups(
    transforms: Mapping[Hashable, GradientTransformation], label_leaves: list[Any], params: PyTree
) -> dict[Hashable, OptState]:
    leaves, spec = tree.flatten(params)
    return {
        label: tx.init(_group(spec, leaves, [i for i, lab in enumerate(label_leaves) if lab == label]))
        for label, tx in transforms.items()
    }


def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation], labels: LabelTree
) -> GradientTransformation:
    """A different transformation per group of parameters, chosen by ``labels``.

    ``labels`` is a pytree like the params whose leaves are labels (keys of ``transforms``), or a function
    ``params -> labels``. Every label used must have a transformation; a group with a label's
    hyperparameters is reported by :func:`functrain.optim.hyperparams` as ``"label/learning_rate"`` when
    the bare name would repeat. Use :func:`functrain.optim.set_to_zero` for a frozen group.

    Example:
        >>> from functrain import optim
        >>> params = {"body.w": torch.ones(1), "head.w": torch.ones(1)}
        >>> labels = optim.labels_by_name(params, {"head.*": "head"}, default="body")
        >>> tx = optim.multi_transform({"body": optim.sgd(0.01), "head": optim.sgd(0.1)}, labels)
        >>> sorted(optim.hyperparams(tx.init(params)))
        ['body/learning_rate', 'head/learning_rate']
    """
    who = "multi_transform"
    transforms = dict(transforms)
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"{who}: the transform for label {label!r} is a {type(tx).__name__}, not a GradientTransformation"
            )

    def check(names: list[str], label_leaves: list[Any]) -> None:
        for name, label in zip(names, label_leaves):
            if label not in transforms:
                raise ValueError(
                    f"{who}: leaf {name!r} has label {label!r}, which has no transform; "
                    f"transforms are given for {list(transforms)}"
                )

    checked_labels = _Labels(who, labels, "labels", check)

    def init(params: PyTree) -> MultiTransformState:
        return MultiTransformState(inner_states=_init_groups(transforms, checked_labels(params), params))

    def update(
        updates: PyTree,
        state: MultiTransformState,
        params: PyTree | None = None,
        *,
        norm: NormFn | None = None,
    ) -> tuple[PyTree, MultiTransformState]:
        label_leaves = checked_labels(params if params is not None else updates)
        out, new_states, spec, _ = _run_groups(
            who, transforms, label_leaves, updates, state.inner_states, params, norm
        )
        return tree.unflatten(spec, out), MultiTransformState(inner_states=new_states)

    return GradientTransformation(init, update)


def masked(inner: GradientTransformation, mask: LabelTree) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; **the other leaves pass through unchanged**.

    "Unchanged" means the update that comes in goes out as it is (optax's ``masked`` semantics): inside a
    chain, a leaf outside the mask still gets the other transformations' updates. To stop leaves from
    moving, use :func:`freeze`. ``inner`` keeps state for the masked leaves only.

    Example:
        >>> from functrain import optim
        >>> tx = masked(optim.scale(10.0), {"a": True, "b": False})
        >>> tx.update({"a": torch.ones(1), "b": torch.ones(1)}, tx.init({"a": torch.ones(1), "b": torch.ones(1)}))[0]
        {'a': tensor([10.]), 'b': tensor([1.])}
    """
    who = "masked"
    mask_leaves_of = bool_labels(who, mask, "mask")

    def init(params: PyTree) -> MaskedState:
        states = _init_groups({True: inner}, mask_leaves_of(params), params)
        return MaskedState(inner_state=states[True])

    def update(
        updates: PyTree, state: MaskedState, params: PyTree | None = None, *, norm: NormFn | None = None
    ) -> tuple[PyTree, MaskedState]:
        mask_leaves = mask_leaves_of(params if params is not None else updates)
        out, new_states, spec, _ = _run_groups(
            who, {True: inner}, mask_leaves, updates, {True: state.inner_state}, params, norm
        )
        return tree.unflatten(spec, out), MaskedState(inner_state=new_states[True])

    return GradientTransformation(init, update)


def freeze(inner: GradientTransformation, frozen: LabelTree) -> GradientTransformation:
    """Train with ``inner`` except where ``frozen`` is True: **frozen leaves get zero updates** and no state.

    ``frozen`` is a pytree of bools like the params or a function ``params -> bools``; build it with
    :func:`functrain.optim.mask_by_name` (names, globs), from :func:`functrain.optim.names_by_module_index`
    or :func:`functrain.optim.batchnorm_param_names`. Weight decay inside ``inner`` does not touch frozen
    leaves either.

    Example:
        >>> from functrain import optim
        >>> params = {"a": torch.ones(1), "b": torch.ones(1)}
        >>> tx = freeze(optim.adam(0.1), {"a": True, "b": False})
        >>> tx.init(params).inner_state[0].mu
        {'a': None, 'b': tensor([0.])}
    """
    who = "freeze"
    frozen_leaves_of = bool_labels(who, frozen, "frozen mask")

    def init(params: PyTree) -> FreezeState:
        frozen_leaves = frozen_leaves_of(params)
        states = _init_groups({False: inner}, frozen_leaves, params)
        return FreezeState(inner_state=states[False])

    def update(
        updates: PyTree, state: FreezeState, params: PyTree | None = None, *, norm: NormFn | None = None
    ) -> tuple[PyTree, FreezeState]:
        frozen_leaves = frozen_leaves_of(params if params is not None else updates)
        out, new_states, spec, handled = _run_groups(
            who, {False: inner}, frozen_leaves, updates, {False: state.inner_state}, params, norm
        )
        out = [x if done else torch.zeros_like(x) for x, done in zip(out, handled)]
        return tree.unflatten(spec, out), FreezeState(inner_state=new_states[False])

    return GradientTransformation(init, update)
