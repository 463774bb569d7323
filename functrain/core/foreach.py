"""``torch._foreach_*`` ops that run one tensor at a time under ``torch.func.vmap``.

functrain's optimizers update all leaves with one ``torch._foreach_*`` kernel; vmap has no batching rule
for those ops ("Batching rule not implemented for aten::_foreach_lerp.Scalar"), and neither eager vmap nor
dynamo's tracing of vmap honours a torch function mode that could rewrite them. So the optimizers call
the ops through this module: each is the foreach kernel itself, or, where its arguments are vmap's
batched tensors (``functrain.ensemble``'s vmapped step), the same op applied leaf by leaf, which vmap
batches. The choice depends on the arguments only (no flag set up the stack); under ``torch.compile``
inductor fuses the per-leaf ops again, so the compiled ensemble step pays nothing for it.

Differentiating through an update (``torch.func.grad`` of a loss after unrolled train steps, or plain
autograd through params that require gradients) needs the per-leaf ops too: ``torch._foreach_mul(list,
0-d tensor)`` has no working backward (pytorch issue 144580), and an in-place op on a tensor that autograd
saved (Adam's ``sqrt_`` of its denominator) gives wrong gradients. Where grad mode is on and any argument
requires a gradient (:func:`tracked`), each op runs leaf by leaf out of place, and the in-place ones put
their results into the list they were given (``xs[i] = new``) instead of writing into its tensors: callers
read the result through that list. Nothing differentiated: the foreach kernel, as before.

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


def _tracked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether grad mode is on and any argument (a tensor, or any tensor of a list) requires a gradient."""
    if not torch.is_grad_enabled():
        return False
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, list | tuple):
            if arg and isinstance(arg[0], torch.Tensor):  # a tensor list (else numbers, one per leaf)
                for x in arg:
                    if x.requires_grad:
                        return True
        elif isinstance(arg, torch.Tensor) and arg.requires_grad:
            return True
    return False


def tracked(*tensors: torch.Tensor | list[torch.Tensor]) -> bool:
    """Whether something differentiates through these tensors (or lists of them): grad mode is on and one
    requires a gradient, as inside ``torch.func.grad`` for whatever depends on its inputs.

    Example:
        >>> tracked([torch.ones(1)]), tracked([torch.ones(1, requires_grad=True)])
        (False, True)
    """
    return _tracked(tensors, {})


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
        differentiated = _tracked(args, kwargs)
        if not differentiated and not _batched(args, kwargs):
            result = kernel(*args, **kwargs)
            return result if inplace else list(result)  # a list, whose items an in-place op may replace
        out = [
            per_leaf(*(_pick(a, i) for a in args), **{k: _pick(v, i) for k, v in kwargs.items()})
            for i in range(len(args[0]))
        ]
        if not inplace:
            return out
        if differentiated:  # autograd may have saved these tensors: new ones go into the caller's list
            _rebind(name, args[0], out)
            return None
        for target, value in zip(args[0], out):
            target.copy_(value)
        return None

    run.__name__ = f"{name}{'_' if inplace else ''}"
    return run


def _rebind(name: str, targets: Any, values: list[torch.Tensor]) -> None:
    if not isinstance(targets, list):
        raise TypeError(
            f"functrain.core.foreach.{name}_: differentiating through an in-place op needs its first argument "
            f"to be a list (its items are replaced by the results), got a {type(targets).__name__}"
        )
    targets[:] = values


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
