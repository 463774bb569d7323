"""A digest of a batch's contents: the data loader's replay check and tensor parallelism's same-batch check
compare batches by it.

Example:
    >>> fingerprint({"x": torch.ones(2)}) == fingerprint({"x": torch.ones(2)})
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["fingerprint"]


def fingerprint(batch: Any) -> str:
    """A digest of a batch's contents (tensor bytes, dtypes and shapes; other leaves by ``repr``): two
    batches with the same fingerprint hold the same data. Reads device tensors back to the host."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, batch)
    return digest.hexdigest()


def _feed(digest: Any, node: Any) -> None:
    if isinstance(node, torch.Tensor):
        t = node.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(node, Mapping):
        for k in node:
            digest.update(repr(k).encode())
            _feed(digest, node[k])
    elif isinstance(node, list | tuple):
        digest.update(f"{type(node).__name__}{len(node)}".encode())
        for item in node:
            _feed(digest, item)
    elif hasattr(node, "__dataclass_fields__"):  # MaskedBatch and other structs
        for name in node.__dataclass_fields__:
            _feed(digest, getattr(node, name))
    else:
        digest.update(repr(node).encode())
