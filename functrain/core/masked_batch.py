"""A batch padded to a fixed shape, as the step reads it: :class:`MaskedBatch`, :func:`unmask`, :func:`trim`
and the loss over its real rows (:func:`masked_loss`).

Why batches are padded, and how the loop pads them, is :mod:`functrain.data.padding`; this module is what
both the step and the data side need, below both (the public names are ``ft.data.MaskedBatch``,
``ft.data.trim`` and ``ft.data.unmask``).

Example:
    >>> import torch
    >>> batch = MaskedBatch(batch=torch.tensor([1, 3, 1, 1]), mask=torch.tensor([True, True, False, False]))
    >>> float(masked_loss(lambda b: (b.float().mean(), {}), *unmask(batch))[0])
    2.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from functrain import tree

__all__ = ["IGNORE_INDEX", "MaskedBatch", "is_string_column", "masked_loss", "trim", "unmask"]

#: The label Hugging Face's losses (and torch's ``cross_entropy``) ignore: the padded rows' labels.
IGNORE_INDEX = -100


@tree.struct
class MaskedBatch:
    """A batch padded to a fixed number of rows and the mask of its real rows (``[rows]``, bool).

    A pytree (both registries): ``jit`` sees the batch's tensors and the mask as inputs, so the mask's
    values change from batch to batch without a recompile.

    Example:
        >>> import torch
        >>> MaskedBatch(batch=torch.zeros(3, 2), mask=torch.tensor([True, True, False])).mask.sum()
        tensor(2)
    """

    batch: Any
    mask: torch.Tensor


def is_string_column(node: Any) -> bool:
    """True for a list of strings (a text column of a batch): padded and trimmed like a tensor's rows."""
    return isinstance(node, list) and bool(node) and all(isinstance(s, (str, bytes)) for s in node)


def unmask(batch: Any) -> tuple[Any, torch.Tensor | None]:
    """``(batch, mask)`` of a :class:`MaskedBatch`, ``(batch, None)`` of any other batch.

    Example:
        >>> import torch
        >>> unmask(torch.zeros(2))[1] is None
        True
    """
    if isinstance(batch, MaskedBatch):
        return batch.batch, batch.mask
    return batch, None


def trim(outputs: Any, n: int, size: int | None = None) -> Any:
    """``outputs`` with only the first ``n`` rows of every tensor whose leading size is ``size``
    (default: the leading size of the first tensor of rank >= 1): the padding cut off predictions.

    Example:
        >>> import torch
        >>> trim({"logits": torch.zeros(4, 3), "scale": torch.tensor(2.0)}, 3)["logits"].shape
        torch.Size([3, 3])
    """
    if size is None:
        size = next(
            (int(x.shape[0]) for x in tree.leaves(outputs) if isinstance(x, torch.Tensor) and x.ndim > 0),
            n,
        )
    if n == size:
        return outputs

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == size:
            return leaf[:n]
        if is_string_column(leaf) and len(leaf) == size:
            return leaf[:n]
        return leaf

    return optree.tree_map(cut, outputs, namespace=tree.NAMESPACE, is_leaf=is_string_column)


def masked_loss(
    run: Callable[[Any], tuple[torch.Tensor, dict[str, Any]]],
    batch: Any,
    mask: torch.Tensor | None,
    *,
    per_example: Callable[[Any], tuple[torch.Tensor, dict[str, Any]]] | None = None,
    count: torch.Tensor | None = None,
    first: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(loss, aux)`` of ``batch`` over its real rows only: ``run(batch)`` when ``mask`` is ``None``.

    The loss is the real rows' per-example losses summed and divided by ``count`` (default: the real
    rows of ``mask``; a micro-batch of an accumulated step passes the whole batch's count, so that the
    micro-batches' losses and gradients add up to the batch's mean). As for ``accumulate``, a loss is
    taken to be the mean of its examples' losses. Three cases, first match wins:

    - ``per_example(batch) -> (losses [rows], aux)`` given (the loss functions of
      :func:`functrain.supervised_loss` have one): the padded rows weigh exactly zero, dropout and all;
    - a dict batch with integer ``labels`` (Hugging Face's layout): the padded rows get label ``-100``,
      which HF's losses and torch's ``cross_entropy`` ignore, so a per-token mean is exact too;
    - any other loss function (a mean over the batch's examples, the step's contract): the padded rows,
      copies of row 0 (:func:`pad_batch`), are taken back out, ``(rows * loss(batch) - padded *
      loss(row 0)) / count``, with row 0 (``first``, default: cut from ``batch``) run once more. Exact up
      to float rounding when an example's loss depends on its own row only: evaluation, or training
      without dropout or BatchNorm batch statistics. The extra ``metrics`` are taken out the same way.

    Example:
        >>> import torch
        >>> run = lambda b: (b.float().mean(), {})
        >>> float(masked_loss(run, torch.tensor([1, 3, 1, 1]), torch.tensor([True, True, False, False]))[0])
        2.0
    """
    if mask is None:
        return run(batch)
    rows = int(mask.shape[0])
    real = mask.sum().to(torch.float32)
    count = real.clamp(min=1) if count is None else count
    if per_example is not None:
        losses, aux = per_example(batch)
        weight = mask.to(losses.dtype)
        return (losses * weight).sum() / count, aux
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.shape[:1] == (rows,):
        # Hugging Face's convention: label -100 is ignored by the loss (every HF head, torch's
        # cross_entropy): the loss is then exactly the real rows' own, a per-token mean included.
        ignored = torch.where(mask.reshape((rows,) + (1,) * (labels.ndim - 1)), labels, IGNORE_INDEX)
        loss, aux = run({**batch, "labels": ignored})
        zero = torch.zeros_like(loss)
        return torch.where(real > 0, loss * real / count, zero), aux
    loss, aux = run(batch)
    one, one_aux = run(trim(batch, 1, rows) if first is None else first)
    padding = rows - real
    loss = torch.where(real > 0, (loss * rows - one.float() * padding) / count, torch.zeros_like(loss))
    if "metrics" in aux:
        own, theirs = dict(aux["metrics"]), dict(one_aux.get("metrics", {}))
        aux = {**aux, "metrics": {k: (v * rows - theirs[k] * padding) / count for k, v in own.items()}}
    return loss, aux
