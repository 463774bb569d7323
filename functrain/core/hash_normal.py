"""Gaussian draws that are a pure function of a key and a counter, written in tensor ops.

Why not ``torch.randn``: a compiled step cannot seed a generator inside its graph, and the global
generator :func:`functrain.jit` seeds is per rank and unseeded in an eager step. Noise that must be the
same on every rank, in an eager and a compiled step, and again after a resume (DP-SGD's) is drawn here
from ``(key, counter, element index)`` alone: a counter-based generator (as JAX's and Philox are), each
32-bit word a hash of its inputs, two words per draw through Box-Muller.

The hash is Wellons' ``lowbias32`` form with multipliers below 2**31 (hash-prospector's
``0x21f0aaad, 0x735a2d97``), so every product of a 32-bit word fits in int64 without overflow and the
integer part is exact on every backend; two rounds per word, keyed twice, so two streams never share a
shifted copy of each other's sequence.

Example:
    >>> import torch
    >>> words = torch.tensor([1, 2])
    >>> a = normal(words, torch.tensor(0), 4, torch.float64)
    >>> bool((a == normal(words, torch.tensor(0), 4, torch.float64)).all())
    True
"""

from __future__ import annotations

import math

import torch

__all__ = ["MAX_DRAWS", "normal"]

_MASK = 0xFFFFFFFF
MAX_DRAWS = 1 << 32
"""The most draws one call makes (the element index is one 32-bit word)."""


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash of ``x`` (int64 holding values in ``[0, 2**32)``)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK
    return x ^ (x >> 15)


def _seeds(words: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit seeds of each of the two lanes (``(2, 1)`` each), from the key's two words and the
    counter (int64): one lane per uniform of Box-Muller's pair, both hashed at once."""
    counter = counter.to(torch.int64)
    s = _mix(words[0] & _MASK)
    s = _mix(s ^ (words[1] & _MASK))
    s = _mix(s ^ (counter & _MASK))
    s = _mix(s ^ ((counter >> 32) & _MASK))
    a = _mix(s ^ (torch.arange(2, dtype=torch.int64, device=words.device) + 0x9E3779B9))
    return a[:, None], _mix(a ^ 0x85EBCA6B)[:, None]


def normal(words: torch.Tensor, counter: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` standard normal draws (a 1-d tensor of ``dtype`` on ``words``' device), a function of the key's
    two 32-bit ``words`` (an int64 tensor of shape ``(2,)``) and ``counter`` (a 0-d int tensor) only.

    Box-Muller in float64 (float32 on a device without float64), then cast: with 32-bit uniforms the
    largest draw is about 6.8 standard deviations.

    Example:
        >>> x = normal(torch.tensor([7, 9]), torch.tensor(3), 100_000, torch.float64)
        >>> abs(float(x.mean())) < 0.02, abs(float(x.std()) - 1) < 0.02
        (True, True)
    """
    if n > MAX_DRAWS:
        raise ValueError(f"normal: at most {MAX_DRAWS} draws per call, asked for {n}")
    device = words.device
    pairs = (n + 1) // 2  # Box-Muller gives two draws per pair of uniforms: the cosine and the sine
    a, b = _seeds(words, counter)
    bits = _mix(_mix(torch.arange(pairs, dtype=torch.int64, device=device) ^ a) ^ b)  # (2, pairs)
    work = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    u1, u2 = (bits.to(work) + 0.5) * (1.0 / MAX_DRAWS)
    radius, angle = torch.sqrt(-2.0 * torch.log(u1)), (2.0 * math.pi) * u2
    z = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])
    return z[:n].to(dtype)
