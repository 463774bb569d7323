"""Dropout masks on the CPU as float32 ``rand < p``: the decompositions :mod:`functrain.compile.backend`
hands to inductor when a graph draws dropout or Bernoulli masks.

Example:
    >>> table = cpu_dropout_decompositions()
    >>> torch.ops.aten.native_dropout.default in table
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DROPOUT_CACHE_SALT", "cpu_dropout_decompositions", "draws_dropout_masks"]


def _uniform_below(x: torch.Tensor, p: Any) -> torch.Tensor:
    """An ``x``-shaped boolean mask, true with probability ``p``: float32 uniforms (exact p for bf16/fp16)."""
    return torch.rand(x.shape, dtype=torch.float32, device=x.device) < p


def _bernoulli(x: torch.Tensor, p: float = 0.5, generator: Any = None) -> Any:
    if generator is not None:
        return NotImplemented
    return _uniform_below(x, p).to(x.dtype)


def _bernoulli_inplace(x: torch.Tensor, p: float = 0.5, generator: Any = None) -> Any:
    draws = _bernoulli(x, p, generator)
    return draws if draws is NotImplemented else x.copy_(draws)


# AOTAutograd's and inductor's cache keys ignore custom decompositions, so without a mark a graph
# compiled with the dropout decompositions would be served to a compile of the same graph with
# ``fallback_random=True`` (eager's masks), or the reverse (seen here: an AOTAutograd cache hit across
# the two). ``unsafe_marked_cacheable_functions`` is hashed into both keys; this entry names no real
# function, so it marks nothing cacheable and only salts the key. Bump its version when the
# decompositions change.
DROPOUT_CACHE_SALT = {"functrain.jit:cpu-dropout-masks": "float32 rand < p, v2"}


_RANDOM_MASK_OPS = ("dropout", "bernoulli")


def draws_dropout_masks(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo's graph calls dropout or bernoulli, directly or inside attention (``dropout_p``)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = getattr(node.target, "__name__", str(node.target)).lower()
        if any(op in name for op in _RANDOM_MASK_OPS):
            return True
        if "scaled_dot_product_attention" in name:
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if not (isinstance(p, (int, float)) and p == 0):
                return True
    return False


class _DecompositionTable(dict):  # type: ignore[type-arg]
    """A decomposition table that pickles as a call of the function building it.

    Inductor pickles a custom table into its FX graph cache key; ATen's table holds pybind11 functions
    that cannot be pickled, which made inductor bypass its cache (warm compiles as slow as cold ones).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (cpu_dropout_decompositions, ())


def cpu_dropout_decompositions() -> dict[Any, Callable[..., Any]]:
    """Inductor's decompositions, with Bernoulli draws (dropout masks) as ``rand < p``.

    On CPU inductor keeps ``bernoulli_`` as a call to ATen's kernel, ~10 ns per element here; ATen's
    ``rand`` draws from the same generator in ~5 ns, and the compare and scale fuse into inductor's
    kernels. Dropout took 17% of the benchmark transformer's step. Used with ``fallback_random=True``,
    so ``rand`` stays ATen's (inductor's own CPU RNG was slower still, ~15 ns per element). The masks
    follow the same distribution as eager's but are different draws; pass
    ``options={"fallback_random": True}`` to draw exactly eager's masks instead.
    """
    # Inductor's table under fallback_random=True (what these graphs compile with), whatever the
    # config is when this runs: the cache calls this function again when it loads a graph.
    from torch._decomp.decompositions import native_dropout as default_dropout
    from torch._inductor.decomposition import decompositions as inductor_table

    aten = torch.ops.aten
    table = dict(inductor_table)

    def native_dropout(x: torch.Tensor, p: float, train: bool | None) -> Any:
        if not train or p in (0, 1) or not x.is_floating_point():
            return default_dropout(x, p, train)
        keep = _uniform_below(x, 1.0 - p)
        return keep * x * float(1.0 / (1.0 - p)), keep

    table[aten.bernoulli_.float] = _bernoulli_inplace
    table[aten.bernoulli.p] = _bernoulli
    table[aten.native_dropout.default] = native_dropout
    return _DecompositionTable(table)
