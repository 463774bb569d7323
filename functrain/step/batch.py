"""Batches and losses: a supervised batch's inputs and target, the loss function's output, micro-batches,
and a padded batch's real rows (:class:`~functrain.data.MaskedBatch`).

Example:
    >>> import torch
    >>> [len(b[0]) for b in split_batch((torch.zeros(5, 2), torch.zeros(5)), 2)]
    [3, 2]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from functrain import tree
from functrain.core.masked_batch import masked_loss, trim

__all__ = [
    "INPUT_KEYS",
    "TARGET_KEYS",
    "Batch",
    "LossFn",
    "inputs_and_target",
    "is_short",
    "loss_over_real_rows",
    "mask_parts",
    "metric_inputs",
    "num_examples",
    "real_examples",
    "split_batch",
    "supervised_loss",
]

Batch = Any
LossFn = Callable[[Callable[..., Any], Batch], Any]

INPUT_KEYS = ("input", "inputs", "x", "image", "images", "pixel_values", "features")
TARGET_KEYS = ("target", "targets", "label", "labels", "y", "mask", "masks")


# ------------------------------------------------------------------------------------------ batches


def inputs_and_target(batch: Batch) -> tuple[Any, Any]:
    if isinstance(batch, Mapping):
        x = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        y = next((batch[k] for k in TARGET_KEYS if k in batch), None)
        if x is None or y is None:
            raise KeyError(
                f"supervised batch dict needs an input key (one of {INPUT_KEYS}) and a target key (one of "
                f"{TARGET_KEYS}); got keys {sorted(batch)}. Pass your own loss_fn(model, batch) otherwise."
            )
        return x, y
    if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"supervised batch must be (inputs, target) or a dict with input/target keys, got "
        f"{type(batch).__name__}; write a loss_fn(model, batch) for other layouts"
    )


def supervised_loss(criterion: Callable[[Any, Any], torch.Tensor]) -> LossFn:
    """A loss function for ``(inputs, target)`` batches (or dicts with ``input``/``target`` keys).

    Example:
        >>> loss_fn = supervised_loss(torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    """

    def loss_fn(model: Callable[..., Any], batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = inputs_and_target(batch)
        preds = model(x)
        return criterion(preds, y), {"preds": preds, "target": y}

    def per_example(model: Callable[..., Any], batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
        # One loss per example (the criterion on each row as a batch of one), so that a padded batch's
        # masked rows weigh exactly zero, dropout and all (functrain.core.masked_batch.masked_loss).
        x, y = inputs_and_target(batch)
        preds = model(x)
        losses = torch.vmap(lambda p, t: criterion(p.unsqueeze(0), t.unsqueeze(0)))(preds, y)
        return losses, {"preds": preds, "target": y}

    loss_fn.criterion = criterion  # type: ignore[attr-defined]
    loss_fn.per_example = per_example  # type: ignore[attr-defined]
    return loss_fn


def num_examples(batch: Batch) -> int:
    """The batch's leading dimension (read from shapes: static under ``torch.compile``)."""
    for x in tree.leaves(batch):
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            return int(x.shape[0])
    raise ValueError("cannot count the examples of a batch without any tensor of rank >= 1")


def is_short(batch: Batch, rows: int | None) -> bool:
    """Whether ``batch`` has fewer than ``rows`` examples (a set's short last batch; ``rows=None``, or a
    batch without a tensor of rank >= 1: no). Read from shapes, so a resume decides alike.

    Example:
        >>> is_short((torch.zeros(3, 2),), 4), is_short((torch.zeros(4, 2),), 4)
        (True, False)
    """
    if rows is None:
        return False
    try:
        return num_examples(batch) < rows
    except ValueError:
        return False


def split_batch(batch: Batch, k: int) -> list[Batch]:
    """Split every tensor of ``batch`` into ``k`` micro-batches along dim 0 (sizes may differ by one)."""
    n = num_examples(batch)
    if k > n:
        raise ValueError(f"cannot accumulate over {k} micro-batches: the batch has only {n} examples")

    def chunk(i: int) -> Batch:
        return tree.map(
            lambda x: x.tensor_split(k)[i] if isinstance(x, torch.Tensor) and x.ndim > 0 else x, batch
        )

    return [chunk(i) for i in range(k)]


def _split_loss_output(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, aux = out
    elif isinstance(out, torch.Tensor):
        loss, aux = out, {}
    else:
        raise TypeError(
            f"the loss function must return a 0-d tensor or (loss, aux_dict); got {type(out).__name__}"
        )
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"the loss must be a 0-d tensor (the mean over the batch), got shape {shape}; reduce it with "
            ".mean() (or reduction='mean' in a torch.nn loss)"
        )
    if not loss.is_floating_point():
        raise TypeError(f"the loss must be a floating-point tensor, got {loss.dtype}")
    return loss, dict(aux)


def loss_over_real_rows(
    loss_fn: LossFn,
    call: Callable[..., Any],
    batch: Batch,
    mask: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    first: Batch = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``loss_fn``'s ``(loss, aux)``; given a ``mask`` (``mask, count, first``: :func:`mask_parts`), over
    the real rows of a padded batch only (:func:`functrain.core.masked_batch.masked_loss`)."""
    per_example = getattr(loss_fn, "per_example", None)
    return masked_loss(
        lambda b: _split_loss_output(loss_fn(call, b)),
        batch,
        mask,
        per_example=None if per_example is None else lambda b: per_example(call, b),
        count=count,
        first=first,
    )


def mask_parts(batch: Batch, mask: torch.Tensor | None, parts: int) -> list[tuple[Any, ...]]:
    """Per micro-batch ``(mask, count, first)`` of a padded batch (its mask's slice, the whole batch's
    real examples, its row 0), or ``()`` each for a batch without a mask."""
    if mask is None:
        return [()] * parts
    count, first = mask.sum().clamp(min=1).float(), trim(batch, 1, int(mask.shape[0]))
    masks = mask.tensor_split(parts) if parts > 1 else (mask,)
    return [(m, count, first) for m in masks]


def real_examples(batch: Batch, mask: torch.Tensor | None) -> Any:
    """The examples of a batch: its leading size (an int), or the true rows of a padded batch's mask."""
    return num_examples(batch) if mask is None else mask.sum()


def metric_inputs(
    preds: list, targets: list, loss: torch.Tensor, batch: Batch, mask: torch.Tensor | None = None
) -> dict[str, Any]:
    inputs: dict[str, Any] = {"loss": loss, "num_examples": real_examples(batch, mask), "mask": mask}
    if preds:
        inputs["preds"] = preds[0] if len(preds) == 1 else torch.cat(preds)
    if targets:
        inputs["target"] = targets[0] if len(targets) == 1 else torch.cat(targets)
    return inputs
