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

from collections.abc import Iterable, Iterator
from typing import Any

import optree
import torch

from functrain import tree
from functrain.core.masked_batch import MaskedBatch, is_string_column, trim
from functrain.data.collate import num_examples

__all__ = ["pad_batch", "padded", "unpad"]


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
        if is_string_column(leaf) and len(leaf) == n:
            return list(leaf) + [leaf[0]] * (size - n)
        return leaf

    padded = optree.tree_map(pad, batch, namespace=tree.NAMESPACE, is_leaf=is_string_column)
    mask = torch.arange(size, device=device) < n
    return MaskedBatch(batch=padded, mask=mask)


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
