"""``torch._foreach_*`` ops that can run one tensor at a time, for ``torch.func.vmap``.

functrain's optimizers update all leaves with one ``torch._foreach_*`` kernel; vmap has no batching rule
for those ops ("Batching rule not implemented for aten::_foreach_lerp.Scalar"), and neither eager vmap nor
dynamo's tracing of vmap honours a torch function mode that could rewrite them. So the optimizers call
the ops through this module: outside :func:`per_tensor` each is the foreach kernel itself; inside, the
same op applied leaf by leaf, which vmap batches (``functrain.ensemble`` enters it around its vmapped
step). Under ``torch.compile`` inductor fuses the per-leaf ops again, so the compiled ensemble step pays
nothing for it.

Example:
    >>> import torch
    >>> from functrain import _foreach as foreach
    >>> with foreach.per_tensor():
    ...     foreach.mul([torch.ones(2), torch.ones(3)], 2.0)
    [tensor([2., 2.]), tensor([2., 2., 2.])]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class _Flags:
    """How the running step's optimizer may work; set by the step's wrappers while it is traced or run
    (dynamo guards on them like on any global)."""

    def __init__(self) -> None:
        # Instance attributes from the start: dynamo guards on the instance's __dict__, and a first
        # assignment that shadowed a class attribute would change it (one recompile).
        self.per_tensor = False  # the ops below run per tensor (inside functrain.ensemble's vmap)
        self.in_place = False  # the optimizer may write new params and moments into the old tensors
        # A sharded step's norms: each leaf holds only this rank's rows, so ``norm`` hands its per-leaf
        # local norms to this function, which returns the global ones (functrain.distributed.sharding).
        self.norm_reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None


FLAGS = _Flags()


@contextlib.contextmanager
def flag(name: str, value: bool) -> Iterator[None]:
    """``FLAGS.<name> = value`` within this block."""
    before = getattr(FLAGS, name)
    setattr(FLAGS, name, value)
    try:
        yield
    finally:
        setattr(FLAGS, name, before)


def per_tensor() -> contextlib.AbstractContextManager[None]:
    """Within this block the ops of this module run per tensor (vmap-able) instead of as foreach kernels."""
    return flag("per_tensor", True)


def _norm(x: torch.Tensor, ord: float = 2, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.linalg.vector_norm(x, ord, dtype=dtype)


def _pick(arg: Any, i: int) -> Any:
    return arg[i] if isinstance(arg, list | tuple) else arg


def _op(name: str, per_leaf: Callable[..., torch.Tensor], inplace: bool = False) -> Callable[..., Any]:
    kernel = getattr(torch, f"_foreach_{name}{'_' if inplace else ''}")

    def run(*args: Any, **kwargs: Any) -> Any:
        if not FLAGS.per_tensor:
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
_local_norm = _op("norm", _norm)


def norm(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """Each tensor's norm; inside a sharded step (``FLAGS.norm_reduce``) the norm of the whole leaf, all
    ranks' rows together. Every norm functrain's optimizers and ``tree.global_norm`` take goes through
    here, so one hook makes clipping, ``grad_norm`` and LAMB's trust ratio global."""
    out = _local_norm(tensors, *args, **kwargs)
    return out if FLAGS.norm_reduce is None else FLAGS.norm_reduce(list(out))


sign = _op("sign", torch.sign)
sqrt = _op("sqrt", torch.sqrt)
sqrt_ = _op("sqrt", torch.sqrt, inplace=True)
