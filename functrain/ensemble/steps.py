"""One step for all members: a pure step vmapped over the member axis of a stacked state.

``step(train_step)`` runs ``train_step`` for every member of a stacked state
(:func:`functrain.ensemble.create`) with ``torch.func.vmap``: one call, one graph under
:func:`functrain.jit`. What each member computes is what ``train_step`` computes for that member alone
(its own params, BatchNorm buffers, optimizer state and hyperparameters, metric states); the batch is
shared by default.

Randomness: ``vmap(..., randomness="different")`` gives each member its own dropout masks. ``jit`` seeds
the draw from every member's ``(rng, step)`` (``functrain.random.step_seed`` of stacked keys), so the same
ensemble state and batch give the same masks, run after run and after a resume. A member's masks are not
the ones it would draw trained alone (one batched draw, not n separate ones).

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 3)
    >>> state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=4)
    >>> loss = ft.supervised_loss(torch.nn.functional.cross_entropy)
    >>> step = ft.jit(ft.ensemble.step(ft.make_train_step(model, loss)), compile=False)
    >>> state, metrics = step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    >>> metrics["loss"].shape
    torch.Size([4])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch.func import vmap

from functrain import tree
from functrain.core.member_axis import size
from functrain.step import Step, as_step

__all__ = ["MemberMetrics", "eval_step", "predict_step", "step", "vmap_members"]


def _dims(x: Any, axis: int | None) -> Any:
    """vmap ``in_dims`` for a pytree: ``axis`` for tensors, ``None`` for everything else (``None`` leaves,
    ints, strings), which vmap refuses to map over."""
    return torch_pytree.tree_map(lambda leaf: axis if isinstance(leaf, torch.Tensor) else None, x)


def vmap_members(fn: Callable[..., Any], *, batch_axis: int | None = None) -> Callable[..., Any]:
    """``fn(state, batch)`` vmapped over the stacked state's member axis (dim 0 of every leaf).

    ``batch_axis=None`` shares the batch between members; an int maps the batch's tensors along that
    axis (one batch per member). Outputs keep their non-tensor leaves (``None``, ints) as ``fn`` returned
    them and stack the tensors along dim 0. The optimizers' foreach kernels run per tensor inside
    (``functrain.core.foreach`` sees vmap's batched tensors): vmap cannot batch foreach ops.

    Example:
        >>> per_member = vmap_members(lambda state, batch: state.params["bias"].sum() + batch.sum())
    """

    @functools.wraps(fn)
    def mapped(state: Any, batch: Any, *args: Any) -> Any:
        # vmap's outputs must all be tensors: return the tensor leaves and put the rest back outside.
        layout: dict[str, Any] = {}

        def tensors_only(state: Any, batch: Any, *args: Any) -> tuple[torch.Tensor, ...]:
            leaves, spec = torch_pytree.tree_flatten(fn(state, batch, *args))
            layout["spec"] = spec
            layout["leaves"] = [(isinstance(x, torch.Tensor), x) for x in leaves]
            return tuple(x for x in leaves if isinstance(x, torch.Tensor))

        in_dims = (_dims(state, 0), _dims(batch, batch_axis), *(None for _ in args))
        flat = vmap(tensors_only, in_dims=in_dims, randomness="different")(state, batch, *args)
        it = iter(flat)
        leaves = [next(it) if is_tensor else x for is_tensor, x in layout["leaves"]]
        return torch_pytree.tree_unflatten(leaves, layout["spec"])

    return mapped


class MemberMetrics:
    """A metric collection over stacked metric states (one per member): ``empty`` stacks ``n`` empty
    states, ``merge`` and ``compute`` run member by member (host code, not the hot path) and stack.

    ``n`` is given, or learned from the first stacked state ``merge``/``compute`` see (``fit`` computes
    the training metrics before it resets them with ``empty``). Not learned inside the step: a compiled
    step would guard on the attribute and compile again once it changed.
    """

    def __init__(self, inner: Any, n: int | None = None) -> None:
        self.inner = inner
        self.n = n

    def _require_n(self) -> int:
        if self.n is None:
            raise ValueError(
                "ensemble metrics: the member count is not known yet; compute or merge a stacked metric "
                "state first, or set .n"
            )
        return self.n

    def empty(self, device: Any = None) -> Any:
        one = self.inner.empty(device)
        return tree.map(lambda x: torch.stack([x] * self._require_n()), one)

    def _per_member(self, fn: Callable[..., Any], *states: Any) -> Any:
        n = int(tree.leaves(states[0])[0].shape[0])
        self.n = n
        outs = [fn(*(tree.map(lambda x, i=i: x[i], s) for s in states)) for i in range(n)]
        return tree.map(lambda *xs: torch.stack([torch.as_tensor(x) for x in xs]), *outs)

    def merge(self, a: Any, b: Any) -> Any:
        return self._per_member(self.inner.merge, a, b)

    def compute(self, state: Any) -> Any:
        return self._per_member(self.inner.compute, state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _carry(target: Callable[..., Any], source: Step, kind: str) -> Step:
    """``target`` as the ensemble form of ``source``: its model, per-member metrics, no gradient reducer."""
    metrics = MemberMetrics(source.metrics) if source.metrics is not None else None
    return Step(target, kind=kind, model=source.model, metrics=metrics, members=True)  # type: ignore[arg-type]


def step(train_step: Callable[[Any, Any], Any], *, batch_axis: int | None = None) -> Step:
    """The ensemble form of a train step: ``(stacked_state, batch) -> (stacked_state, metrics)``, every
    metric with a leading member axis (``metrics["loss"]`` is ``[n]``).

    Compile it with ``functrain.jit`` as any step (one graph for all members; ``donate=True`` works).
    Accumulation, precision, BatchNorm buffers and metric states work per member, as built into
    ``train_step``.

    Args:
        train_step: a step from :func:`functrain.make_train_step` (or any pure ``(state, batch)`` step).
        batch_axis: ``None`` (default): every member sees the same batch; an int: the batch's tensors
            carry a member axis there (one batch per member).

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> loss = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> ens_step = ft.jit(step(ft.make_train_step(model, loss)), compile=False)
        >>> state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=2)
        >>> state, metrics = ens_step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
        >>> state.step.tolist(), metrics["loss"].shape  # each member took a step on the same batch
        ([1, 1], torch.Size([2]))
    """
    inner = as_step(train_step)
    if inner.gradient_reducer is not None:
        raise ValueError(
            "ensemble.step: the train step all-reduces gradients (data parallelism), which an ensemble "
            "step does not support; build it without gradient_reducer"
        )
    if hasattr(train_step, "_compiled"):
        raise TypeError(
            "ensemble.step: pass the pure step, and jit the ensemble step: jit(ensemble.step(step))"
        )
    mapped = vmap_members(inner.fn, batch_axis=batch_axis)

    def ensemble_train_step(state: Any, batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        size(state)  # a clear error for a single model's state
        return mapped(state, batch)

    return _carry(ensemble_train_step, inner, "train")


def eval_step(eval_fn: Callable[[Any, Any], Any], *, batch_axis: int | None = None) -> Step:
    """The ensemble form of an eval step: ``loss`` and each extra metric ``[n]``, ``metrics`` the stacked
    metric states, ``num_examples`` an int as before; :func:`functrain.evaluate` reports each member.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> loss = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> ens_eval = ft.jit(eval_step(ft.make_eval_step(model, loss)), compile=False)
        >>> state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=2)
        >>> ens_eval(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))["loss"].shape
        torch.Size([2])
    """
    inner = as_step(eval_fn)
    mapped = vmap_members(inner.fn, batch_axis=batch_axis)

    def ensemble_eval_step(state: Any, batch: Any) -> dict[str, Any]:
        size(state)
        return mapped(state, batch)

    return _carry(ensemble_eval_step, inner, "eval")


def predict_step(predict_fn: Callable[[Any, Any], Any], *, batch_axis: int | None = None) -> Step:
    """The ensemble form of a predict step: ``{"members": ..., "mean": ...}``, each member's outputs with
    the member axis after the batch axis (``[batch, n, ...]``, so :func:`functrain.predict` concatenates
    batches) and their mean over members (``[batch, ...]``, the ensemble's prediction).

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=4)
        >>> ens_predict = predict_step(ft.make_predict_step(model))
        >>> out = ens_predict(state, torch.randn(5, 4))
        >>> out["members"].shape, out["mean"].shape
        (torch.Size([5, 4, 3]), torch.Size([5, 3]))
    """
    inner = as_step(predict_fn)
    mapped = vmap_members(inner.fn, batch_axis=batch_axis)

    def ensemble_predict_step(state: Any, batch: Any) -> dict[str, Any]:
        size(state)
        out = mapped(state, batch)
        return {
            "members": torch_pytree.tree_map(lambda x: x.movedim(0, 1) if x.ndim > 1 else x, out),
            "mean": torch_pytree.tree_map(lambda x: x.float().mean(0).to(x.dtype), out),
        }

    return _carry(ensemble_predict_step, inner, "predict")
