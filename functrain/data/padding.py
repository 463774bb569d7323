"""Ragged batches at the compiled shape: pad a short batch to the full batch size, with a validity mask.

A compiled step is specialised on its input shapes, so the short last batch of a set that is not a
multiple of the batch size compiles a second graph. JAX users pad that batch and mask it; so does
functrain: :func:`pad_batch` fills the batch up to ``size`` rows (copies of its first row, so every
padded row is valid input for the model: no zero-length attention masks, no out-of-vocabulary ids) and
returns a :class:`MaskedBatch` whose ``mask`` (bool, shape ``[size]``) marks the real rows. Steps made
by :func:`functrain.make_eval_step` and :func:`functrain.make_train_step` accept a ``MaskedBatch``
and weigh the padded rows zero in the loss, the gradient and every metric; :func:`trim` cuts the rows
back off predictions on the host, where the number of real rows is known without a device sync.

Every batch of a padded stream is a ``MaskedBatch`` (full ones with an all-true mask), so the step sees
one input structure and one shape: one compile. Tensors of rank >= 1 whose leading size is the batch's
example count are padded; other leaves (0-d tensors, numbers, per-batch constants of another length)
pass through unchanged. A batch with zero examples (a rank's empty share of a distributed last batch)
has no row to copy: it is padded with zeros, and its mask is all false.

Why padding and not ``torch._dynamo.mark_dynamic`` on the batch dimension (``benchmarks/ragged.py``,
CPU, ``benchmarks/results/ragged.md``): both compile once for a remainder of 5 in about the same time
and run a full batch in the same ms, but a symbolic batch size still recompiles for a last batch of one
example (torch specialises sizes 0 and 1, as for an empty distributed shard), the benchmark
transformer's train step does not compile with it (its dropout under ``torch.func.grad``: ``Cannot call
numel() on tensor with symbolic sizes``), and a dynamic graph gives up the static shapes that CUDA graphs and autotuned
kernels are built for. Padding compiles one graph at the shape the user chose, for every remainder; the
price is the short batch computed at full size (a pass ~1.1x longer with 8 full batches).

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.tensor([[5, 6], [7, 8]]), "labels": torch.tensor([1, 0])}
    >>> padded = pad_batch(batch, 4)
    >>> padded.batch["input_ids"].tolist(), padded.mask.tolist()
    ([[5, 6], [7, 8], [5, 6], [5, 6]], [True, True, False, False])
    >>> trim(torch.arange(4), 2).tolist()
    [0, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import optree
import torch

from functrain import tree
from functrain.data.collate import num_examples

#: The label Hugging Face's losses (and torch's ``cross_entropy``) ignore: the padded rows' labels.
IGNORE_INDEX = -100

__all__ = [
    "MaskedBatch",
    "masked_loss",
    "pad_batch",
    "padded",
    "trim",
    "unmask",
    "unpad",
]


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


def _is_string_column(node: Any) -> bool:
    return isinstance(node, list) and bool(node) and all(isinstance(s, (str, bytes)) for s in node)


def pad_batch(batch: Any, size: int) -> MaskedBatch:
    """``batch`` filled up to ``size`` rows (copies of row 0; zeros for an empty batch) and its mask.

    Raises ``ValueError`` when the batch already has more than ``size`` rows.

    Example:
        >>> import torch
        >>> pad_batch((torch.tensor([[1.0], [2.0]]), torch.tensor([0, 1])), 3).batch[0].tolist()
        [[1.0], [2.0], [1.0]]
    """
    if isinstance(batch, MaskedBatch):
        return batch
    n = num_examples(batch)
    if n > size:
        raise ValueError(
            f"pad_batch: the batch has {n} examples, more than the padded size {size}; pad to the loader's "
            "batch size (or the largest batch) instead"
        )
    device = None

    def pad(leaf: Any) -> Any:
        nonlocal device
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == n:
            device = device or leaf.device
            if n == size:
                return leaf
            if n == 0:
                return leaf.new_zeros((size, *leaf.shape[1:]))
            return torch.cat([leaf, leaf[:1].expand(size - n, *leaf.shape[1:])])
        if _is_string_column(leaf) and len(leaf) == n:
            return list(leaf) + [leaf[0]] * (size - n)
        return leaf

    padded = optree.tree_map(pad, batch, namespace=tree.NAMESPACE, is_leaf=_is_string_column)
    mask = torch.arange(size, device=device) < n
    return MaskedBatch(batch=padded, mask=mask)


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
        if _is_string_column(leaf) and len(leaf) == size:
            return leaf[:n]
        return leaf

    return optree.tree_map(cut, outputs, namespace=tree.NAMESPACE, is_leaf=_is_string_column)


# ------------------------------------------------------------------------------------------ the loop's side


def padded(batches: Iterable[Any], masked: bool, size: int | None) -> Iterator[tuple[Any, int | None]]:
    """``(batch, real_examples)`` for each batch: padded to ``size`` rows (``None``: the first batch's
    count) when the step takes masked batches (``masked``: its ``Step.masked_batches``, as the steps of
    :func:`functrain.make_eval_step` and :func:`functrain.make_predict_step` do), so evaluation and
    prediction compile one shape; otherwise ``(batch, None)``: a step of your own gets its batches as they
    are. The count is read from shapes on the host (no device sync).

    Every batch of the stream is a :class:`MaskedBatch` (full ones with an all-true mask): one input
    structure. A batch larger than ``size`` keeps its own size (and compiles its own graph).

    Example:
        >>> import torch
        >>> [(b.mask.tolist(), n) for b, n in padded([torch.zeros(2), torch.zeros(1)], True, None)]
        [([True, True], 2), ([True, False], 1)]
    """
    if not masked:
        for batch in batches:
            yield batch, None
        return
    for batch in batches:
        if isinstance(batch, MaskedBatch):  # padded already (a Loader with pad_last): count its mask
            yield batch, int(batch.mask.sum())
            continue
        n = num_examples(batch)
        size = n if size is None else size
        yield pad_batch(batch, max(size, n)), n


def unpad(outputs: Any, batch: Any, real: int | None) -> Any:
    """A predict step's ``outputs`` for the ``real`` rows of ``batch`` (a :class:`MaskedBatch` from
    :func:`padded`); ``outputs`` unchanged when ``real`` is ``None``.

    Example:
        >>> import torch
        >>> unpad(torch.arange(4), pad_batch(torch.zeros(3), 4), 3).tolist()
        [0, 1, 2]
    """
    if real is None or not isinstance(batch, MaskedBatch):
        return outputs
    return trim(outputs, real, int(batch.mask.shape[0]))


# ------------------------------------------------------------------------------------------ the step's side


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
