"""Variable-length sequences at a few compiled shapes: pad a batch's sequence axis up to a bucket length.

A collate that pads to the longest sequence of each batch (Hugging Face's ``DataCollatorWithPadding``,
most hand-written ones) gives the step a new shape for almost every batch, and a step compiled at fixed
shapes compiles once per length, until ``max_compiles`` stops the run. :func:`pad_sequences` pads the
sequence axis further, to :func:`bucket_length`: a multiple of ``multiple`` that is a power of two
times it (16, 32, 64, 128, ... for 16), so a run compiles once per bucket it meets, at most
``log2(longest / multiple) + 1`` times (6 up to 512 tokens), and never pads a batch to more than twice
its longest sequence (``benchmarks/sequences.py`` measures the choices: padding to the longest, to
multiples of 8 or 64, to buckets, to a maximum length, dynamic shapes).

Only batches that carry their own padding mask are padded: a dict batch with an ``attention_mask`` of
shape ``[batch, length]`` (the layout of Hugging Face's tokenizers). The added positions are masked out
(``attention_mask`` 0) and their labels ignored (``labels`` -100), so the model's outputs at the real
positions, its loss and its gradient are the unpadded batch's, up to float rounding. Every tensor whose
first two sizes are ``[batch, length]`` is padded along its second axis, with :data:`PAD_VALUES` by key
(``input_ids``: ``pad_token_id``) and 0 for other keys. Other batches pass through unchanged.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 0]]),
    ...          "labels": torch.tensor([1])}
    >>> out = pad_sequences(batch, multiple=4)
    >>> out["input_ids"].tolist(), out["attention_mask"].tolist(), out["labels"].tolist()
    ([[5, 6, 7, 0]], [[1, 1, 0, 0]], [1])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from functrain.core.masked_batch import IGNORE_INDEX

__all__ = ["PAD_VALUES", "SequencePadding", "bucket_length", "pad_sequences", "pad_to_longest"]

#: What a padded position of each Hugging Face batch key holds (``input_ids``: the ``pad_token_id``
#: given to :func:`pad_sequences`; any other key: 0).
PAD_VALUES: dict[str, int] = {
    "attention_mask": 0,
    "token_type_ids": 0,
    "labels": IGNORE_INDEX,
    "special_tokens_mask": 1,
}


def bucket_length(length: int, multiple: int) -> int:
    """The padded length of a batch whose longest sequence is ``length``: the smallest ``multiple * 2**k``
    that holds it.

    Example:
        >>> [bucket_length(n, 16) for n in (1, 16, 17, 33, 100)]
        [16, 16, 32, 64, 128]
    """
    if multiple < 1:
        raise ValueError(f"bucket_length: multiple must be a positive int, got {multiple!r}")
    bucket = multiple
    while bucket < length:
        bucket *= 2
    return bucket


def pad_sequences(
    batch: Any, multiple: int | None = None, *, length: int | None = None, pad_token_id: int = 0
) -> Any:
    """``batch`` with its sequence axis padded to :func:`bucket_length` of ``multiple`` (or to ``length``,
    at least the batch's own), when it is a dict with an ``attention_mask`` of shape ``[batch, length]``;
    any other batch as it is (see the module docstring).

    Example:
        >>> import torch
        >>> b = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)}
        >>> pad_sequences(b, 8)["input_ids"].shape
        torch.Size([2, 8])
    """
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return batch
    if (multiple is None) == (length is None):
        raise ValueError("pad_sequences: give multiple= (bucketed lengths) or length= (one length)")
    rows, longest = (int(n) for n in mask.shape)
    target = bucket_length(longest, multiple) if multiple is not None else max(length, longest)  # type: ignore[arg-type]
    if target == longest:
        return batch
    values = {**PAD_VALUES, "input_ids": pad_token_id}

    def pad(key: str, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.ndim < 2 or leaf.shape[:2] != (rows, longest):
            return leaf
        widths = [0, 0] * (leaf.ndim - 2) + [0, target - longest]  # F.pad: the last axis first
        return F.pad(leaf, widths, value=values.get(key, 0))

    return {key: pad(key, leaf) for key, leaf in batch.items()}  # a plain dict (also for a BatchEncoding)


def pad_to_longest(samples: list[Mapping[str, Any]], *, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Collate dict samples of token sequences of different lengths (``input_ids``, a 1-d tensor or list
    each) into one batch padded to its longest sequence, with an ``attention_mask`` where the samples
    have none (what Hugging Face's ``DataCollatorWithPadding`` does). A value as long as its sample's
    ``input_ids`` is a sequence, padded with :data:`PAD_VALUES`; the others are stacked.

    Example:
        >>> batch = pad_to_longest([{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [8], "labels": 0}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]], [1, 0])
    """
    rows = [{k: torch.as_tensor(v) for k, v in s.items()} for s in samples]
    for row in rows:
        row.setdefault("attention_mask", torch.ones_like(row["input_ids"]))
    longest = max(len(row["input_ids"]) for row in rows)
    values = {**PAD_VALUES, "input_ids": pad_token_id}

    def column(key: str) -> torch.Tensor:
        def padded(row: dict[str, torch.Tensor]) -> torch.Tensor:
            x, n = row[key], len(row["input_ids"])
            if x.ndim == 0 or len(x) != n or n == longest:
                return x
            return F.pad(x, [0, 0] * (x.ndim - 1) + [0, longest - n], value=values.get(key, 0))

        return torch.stack([padded(row) for row in rows])

    return {key: column(key) for key in rows[0]}


@dataclasses.dataclass(frozen=True)
class SequencePadding:
    """A collate function: ``collate_fn``'s batch with :func:`pad_sequences` to ``multiple``'s buckets
    (what ``Loader(collate_fn=...)`` takes; picklable for worker processes).

    Example:
        >>> from functrain.data import collate
        >>> loader_collate = SequencePadding(collate, 16)
    """

    collate_fn: Callable[[list[Any]], Any]
    multiple: int
    pad_token_id: int = 0

    def __call__(self, samples: list[Any]) -> Any:
        return pad_sequences(self.collate_fn(samples), self.multiple, pad_token_id=self.pad_token_id)
