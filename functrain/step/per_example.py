"""The per-example gradient stage of the train step: ``vmap(grad)`` over the batch's examples.

``make_train_step(..., per_example=True)`` runs the loss on each example as a batch of one, under
``torch.func.vmap`` over the leading axis, and hands the optimizer every example's gradient (each leaf
``(B, *param.shape)``): what a transformation that aggregates them takes
(:func:`functrain.optim.differentially_private_aggregate`, :func:`functrain.optim.dpsgd`).
``per_example=N`` computes ``N`` examples at a time (vmap's ``chunk_size``), which bounds the memory of
the backward's intermediates; the per-example gradients themselves are ``B`` times the params.

It is an option of :func:`functrain.make_train_step` rather than a builder of its own because everything
else in the step (the model call, autocast, the metrics, the update, jit's spec) is the same: only the
gradient stage changes. What cannot be right with it is refused when the step is built:

- BatchNorm in training mode (its batch statistics mix the examples), naming the module;
- ``accumulate > 1`` (``per_example=N`` already computes ``N`` examples at a time);
- data parallelism and ZeRO (per-example gradients are not reduced over processes; the aggregate would
  need the global batch), and a padded batch (its padded rows would count in the batch size).

An ensemble (``ft.ensemble.step``) composes with it: vmap over the members of vmap over the examples.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(3, 2)
    >>> state = ft.TrainState.create(model, ft.optim.dpsgd(0.1, 1.0, 0.5, seed=0))
    >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy),
    ...                           per_example=4)
    >>> state, metrics = step(state, (torch.randn(8, 3), torch.randint(0, 2, (8,))))
    >>> sorted(metrics)
    ['grad_norm', 'loss']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import grad_and_value, vmap

from functrain import tree
from functrain.step.batch import Batch, LossFn, loss_over_real_rows
from functrain.step.bind import autocast, device_of

__all__ = ["check_per_example", "per_example_chunk", "per_example_loss_and_grad"]


def per_example_chunk(per_example: bool | int) -> int | None:
    """``per_example``'s chunk size (``None``: all examples at once), checked; ``0``/``False``: off."""
    if isinstance(per_example, bool):
        return None
    if not isinstance(per_example, int) or per_example < 1:
        raise ValueError(
            f"per_example must be True/False or a positive int (examples computed at a time), got {per_example!r}"
        )
    return per_example


def check_per_example(model: Any, *, accumulate: int, freeze_batchnorm: bool, parallel: str | None) -> None:
    """Refuse, when the step is built, what a per-example gradient stage cannot do right."""
    if accumulate > 1:
        raise ValueError(
            "make_train_step: per_example and accumulate > 1: per_example=N already computes N examples "
            "at a time (vmap's chunk_size); pass per_example=N instead of accumulate"
        )
    if parallel is not None:
        raise ValueError(
            f"make_train_step: per_example with {parallel}: per-example gradients are not reduced over "
            "processes (the DP aggregate needs the global batch's). Train per_example on one process"
        )
    if isinstance(model, nn.Module) and not freeze_batchnorm:
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                raise ValueError(
                    f"make_train_step: per_example and the model's {type(module).__name__} {name!r}: its "
                    "batch statistics mix the examples, so no gradient is one example's. Replace it with "
                    "GroupNorm or LayerNorm, or pass freeze_batchnorm=True (running statistics, eval mode)"
                )


def per_example_loss_and_grad(
    loss_fn: LossFn, bind: Callable[..., Any], cast: torch.dtype | None, chunk: int | None
) -> Callable[..., Any]:
    """``grad_fn(params, buffers, batch, factor) -> (grads, (mean loss, (mean loss, aux, buffers)))``, as
    the step's whole-batch gradient function returns, but each leaf of ``grads`` is ``(B, *param.shape)``:
    every example's gradient of its own loss (the loss function on a batch of one)."""

    def loss_of_one(params: dict, buffers: dict, example: Batch, factor: Any) -> Any:
        batch = tree.map(lambda x: x.unsqueeze(0), example)
        buffers = {k: v.clone() for k, v in buffers.items()}
        with autocast(device_of(params), cast):
            loss, aux = loss_over_real_rows(loss_fn, bind(params, buffers), batch)
        loss = loss.float()
        return loss * factor if factor is not None else loss, (loss.detach(), aux)

    # randomness="different": dropout draws each example's mask, as it would in the batch
    each = vmap(
        grad_and_value(loss_of_one, argnums=0, has_aux=True),
        in_dims=(None, None, 0, None),
        chunk_size=chunk,
        randomness="different",
    )

    def grad_fn(params: dict, buffers: dict, batch: Batch, factor: Any, *masking: Any) -> Any:
        if masking:
            raise ValueError(
                "make_train_step: per_example and a padded batch (Loader(pad_last=True) / "
                "pad_train_batches): its padded rows would count in the batch size. Use drop_last=True"
            )
        grads, (_, (losses, aux)) = each(params, buffers, batch, factor)
        loss = losses.mean()
        return grads, (loss, (loss, _merge_examples(aux), buffers))

    return grad_fn


def _merge_examples(aux: dict[str, Any]) -> dict[str, Any]:
    """The loss function's aux over the examples, as one batch's: preds and targets ``(B, 1, ...)`` back to
    ``(B, ...)``, extra metrics averaged."""
    out = dict(aux)
    for name in ("preds", "target"):
        if name in out:
            out[name] = tree.map(lambda x: x.flatten(0, 1) if x.ndim > 1 else x, out[name])
    if "metrics" in out:
        out["metrics"] = {k: v.float().mean() for k, v in dict(out["metrics"]).items()}
    return out
