"""Deterministic, resumable batching: per-epoch permutations from a key, ``(epoch, index)`` positions.

Example:
    >>> import torch
    >>> from functrain import random
    >>> from functrain.data import DataPosition, Loader
    >>> loader = Loader(torch.arange(10).float(), batch_size=4, key=random.key(0), prefetch=0)
    >>> for position, batch in loader.iterate(DataPosition(epoch=2, index=1), num_epochs=3):
    ...     pass
    >>> position.as_tuple()
    (2, 3)
"""

from functrain.core.masked_batch import MaskedBatch, trim, unmask
from functrain.data.build import as_loader
from functrain.data.collate import CollateError, collate, empty_batch, num_examples
from functrain.data.loader import Loader
from functrain.data.order import epoch_order, shard_batches
from functrain.data.padding import pad_batch
from functrain.data.position import DataPosition, num_batches, num_steps
from functrain.data.prefetch import Prefetcher, prefetch_to_device
from functrain.data.sequences import SequencePadding, bucket_length, pad_sequences, pad_to_longest
from functrain.data.shuffle_buffer import ShuffleBuffer
from functrain.data.sources import ResumeWarning, is_stream
from functrain.data.transfer import pin_memory, to_device

__all__ = [
    "CollateError",
    "DataPosition",
    "Loader",
    "MaskedBatch",
    "Prefetcher",
    "ResumeWarning",
    "SequencePadding",
    "ShuffleBuffer",
    "as_loader",
    "bucket_length",
    "collate",
    "empty_batch",
    "epoch_order",
    "is_stream",
    "num_batches",
    "num_examples",
    "num_steps",
    "pad_batch",
    "pad_sequences",
    "pad_to_longest",
    "pin_memory",
    "prefetch_to_device",
    "shard_batches",
    "to_device",
    "trim",
    "unmask",
]
