"""``torch._foreach_*`` ops that run one tensor at a time under ``torch.func.vmap``.

functrain's optimizers update all leaves with one ``torch._foreach_*`` kernel; vmap has no batching rule
for those ops ("Batching rule not implemented for aten::_foreach_lerp.Scalar"), and neither eager vmap nor
dynamo's tracing of vmap honours a torch function mode that could rewrite them. So the optimizers call
the ops through this module: each is the foreach kernel itself, or, where its arguments are vmap's
batched tensors (``functrain.ensemble``'s vmapped step), the same op applied leaf by leaf, which vmap
batches. The choice depends on the arguments only (no flag set up the stack); under ``torch.compile``
inductor fuses the per-leaf ops again, so the compiled ensemble step pays nothing for it.

:func:`norm` is each leaf's own norm: a sharded step passes its optimizer a norm function that makes
them global (``functrain.optim.NormFn``).

Example:
    >>> import torch
    >>> from functrain.core import foreach
    >>> torch.func.vmap(lambda x: torch.stack(foreach.mul([x, x], 2.0)))(torch.ones(2, 3)).shape
    torch.Size([2, 2, 3])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import is_batchedtensor


def _batched(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether any argument (a tensor, or a list's first tensor) is a vmap-batched tensor."""
    for arg in (*args, *kwargs.values()):
        first = arg[0] if isinstance(arg, list | tuple) and arg else arg
        if isinstance(first, torch.Tensor) and is_batchedtensor(first):
            return True
    return False


def batched(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are vmap's batched tensors (inside ``functrain.ensemble``'s vmapped step)."""
    return _batched((tensors,), {})


def _norm(x: torch.Tensor, ord: float = 2, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.linalg.vector_norm(x, ord, dtype=dtype)


def _pick(arg: Any, i: int) -> Any:
    return arg[i] if isinstance(arg, list | tuple) else arg


def _op(name: str, per_leaf: Callable[..., torch.Tensor], inplace: bool = False) -> Callable[..., Any]:
    kernel = getattr(torch, f"_foreach_{name}{'_' if inplace else ''}")

    def run(*args: Any, **kwargs: Any) -> Any:
        if not _batched(args, kwargs):
            return kernel(*args, **kwargs)
        out = [
            per_leaf(*(_pick(a, i) for a in args), **{k: _pick(v, i) for k, v in kwargs.items()})
            for i in range(len(args[0]))
        ]
        if not inplace:
            return out
        for target, value in zip(args[0], out):
            target.copy_(value)
        return None

    run.__name__ = f"{name}{'_' if inplace else ''}"
    return run


def _addcmul(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: Any = 1) -> torch.Tensor:
    return torch.addcmul(x, a, b, value=value)


add = _op("add", torch.add)
add_ = _op("add", torch.add, inplace=True)
addcmul = _op("addcmul", _addcmul)
addcmul_ = _op("addcmul", _addcmul, inplace=True)
clamp_max_ = _op("clamp_max", torch.clamp_max, inplace=True)
clamp_min = _op("clamp_min", torch.clamp_min)
div = _op("div", torch.div)
div_ = _op("div", torch.div, inplace=True)
lerp = _op("lerp", torch.lerp)
maximum = _op("maximum", torch.maximum)
mul = _op("mul", torch.mul)
norm = _op("norm", _norm)
sign = _op("sign", torch.sign)
sqrt = _op("sqrt", torch.sqrt)
sqrt_ = _op("sqrt", torch.sqrt, inplace=True)
