"""JAX-style random keys: pure, splittable, deterministic.

A key is a CPU ``int64`` tensor of shape ``(2,)`` holding two 32-bit words. Keys are *values*: nothing
here touches a global generator, and the same key always gives the same result. They live on the CPU on
purpose — the host derives seeds from them before each compiled step, and reading a CPU tensor never
waits for an accelerator.

How a step gets its randomness: PyTorch cannot seed a generator inside a ``fullgraph`` compiled function,
so :func:`functrain.jit` calls ``torch.manual_seed(step_seed(state.rng, state.step, rank))`` right before
each call. The same state gives the same dropout masks, run after run; a resumed run continues the same
sequence. Compiled and eager steps draw different masks from the same seed (inductor has its own
random kernels): each is reproducible, they do not agree with each other.

Example:
    >>> from functrain import random
    >>> k = random.key(0)
    >>> a, b = random.split(k)
    >>> bool((random.fold_in(k, 3) == random.fold_in(k, 3)).all())
    True
"""

from __future__ import annotations

import hashlib
import struct as _struct

import torch

__all__ = ["fold_in", "generator", "is_key", "key", "seed_of", "split", "step_seed"]

_MASK32 = 0xFFFFFFFF


def _digest(*words: int) -> bytes:
    packed = _struct.pack(f"<{len(words)}Q", *(w & 0xFFFFFFFFFFFFFFFF for w in words))
    return hashlib.blake2b(packed, digest_size=16).digest()


def _words(key_: torch.Tensor) -> tuple[int, int]:
    if not is_key(key_):
        raise TypeError(
            f"expected a functrain random key (CPU int64 tensor of shape (2,)), got "
            f"{type(key_).__name__} {getattr(key_, 'shape', '')} {getattr(key_, 'dtype', '')} "
            f"{getattr(key_, 'device', '')}; make one with functrain.random.key(seed)"
        )
    hi, lo = key_.tolist()
    return int(hi), int(lo)


def _from_words(hi: int, lo: int) -> torch.Tensor:
    return torch.tensor([hi & _MASK32, lo & _MASK32], dtype=torch.int64)


def is_key(obj: object) -> bool:
    """True for a CPU int64 tensor of shape ``(2,)``."""
    return (
        isinstance(obj, torch.Tensor)
        and obj.dtype == torch.int64
        and tuple(obj.shape) == (2,)
        and obj.device.type == "cpu"
    )


def key(seed: int) -> torch.Tensor:
    """A key from an integer seed.

    Example:
        >>> key(42).shape
        torch.Size([2])
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    d = _digest(0x5EED, seed)
    return _from_words(int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little"))


def fold_in(key_: torch.Tensor, data: int) -> torch.Tensor:
    """A new key that depends on ``key_`` and the integer ``data`` (a step, an epoch, a rank).

    Example:
        >>> bool((fold_in(key(0), 1) != fold_in(key(0), 2)).any())
        True
    """
    hi, lo = _words(key_)
    d = _digest(hi, lo, 0xF01D, int(data))
    return _from_words(int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little"))


def split(key_: torch.Tensor, num: int = 2) -> torch.Tensor:
    """``num`` independent keys, stacked in a ``(num, 2)`` tensor; unpack with ``a, b = split(k)``.

    Example:
        >>> split(key(0), 3).shape
        torch.Size([3, 2])
    """
    if num < 1:
        raise ValueError(f"split: num must be >= 1, got {num}")
    hi, lo = _words(key_)
    out = []
    for i in range(num):
        d = _digest(hi, lo, 0x5B11, i)
        out.append([int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little")])
    return torch.tensor(out, dtype=torch.int64)


def seed_of(key_: torch.Tensor) -> int:
    """A non-negative 63-bit integer seed for ``torch.manual_seed`` or a ``torch.Generator``."""
    hi, lo = _words(key_)
    return int.from_bytes(_digest(hi, lo, 0x5EED)[:8], "little") >> 1


def step_seed(key_: torch.Tensor, step: int | torch.Tensor, rank: int = 0) -> int:
    """The seed of one training step: a function of the state's key, its step and the process rank.

    Ranks get different seeds (different dropout masks); the same ``(key, step, rank)`` always gives
    the same seed. An ensemble's stacked keys (``[n, 2]``, steps ``[n]``) give one seed from every
    member's: the vmapped step draws all members' masks from it (``functrain.ensemble``).
    """
    if isinstance(key_, torch.Tensor) and key_.ndim == 2:
        steps = step.reshape(-1).tolist() if isinstance(step, torch.Tensor) else [step] * len(key_)
        seeds = [step_seed(k, s, rank) for k, s in zip(key_, steps)]
        return int.from_bytes(_digest(0xE45E, *seeds)[:8], "little") >> 1
    hi, lo = _words(key_)
    step_i = int(step)  # state.step is a CPU tensor: reading it never waits for a device
    return int.from_bytes(_digest(hi, lo, 0x57E9, step_i, int(rank))[:8], "little") >> 1


def generator(key_: torch.Tensor, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from ``key_`` (for permutations, initialisers, ...).

    Example:
        >>> torch.randperm(5, generator=generator(key(0))).tolist() == torch.randperm(
        ...     5, generator=generator(key(0))).tolist()
        True
    """
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(key_))
    return g
