"""A loss's value and its gradient w.r.t. the params: ``torch.func.grad_and_value``, or, where nothing
needs a transform, the same gradient by plain autograd.

``torch.func.grad_and_value`` is what the compiled step traces (one graph: forward, backward and update)
and what composes with the other transforms (``vmap`` over an ensemble, ``grad`` through training).
Run eagerly it costs more than ``loss.backward()``: it wraps every input tensor at a new transform level
and unwraps every output, and its backward always records a graph of itself (``create_graph=True``, for
the gradients' own gradients), which keeps every activation and intermediate gradient alive until it
returns. On the cheap tier, with no transform active, no trace under way and no param that autograd
already follows, :func:`loss_and_grad` takes ``torch.autograd.grad`` on detached copies of the params
instead: the gradient of the same forward, by the same backward kernels, at plain PyTorch's cost
(benchmarks/eager_step.py) and memory; a tensor-parallel state's DTensor params too (the step's peak per
rank 0.5-0.8x the transform's: benchmarks/README.md, "Activations per rank"). The first call also runs
the function's forward once under the transform (``torch.func.vjp``, its cotangent never asked for), as
a check whose result and random draws are dropped: the eager step refuses what the compiled step and the
transforms refuse (``torch.utils.checkpoint``'s saved-tensor hooks, an autograd Function without
``setup_context``: :mod:`functrain.remat`; both refused in the forward), not a model that fails once
compiled. Only the forward: the transform's backward imports ``torch._dynamo`` (~2 s of CPU), which a
run on the eager tier never needs otherwise. Every step's result is the plain path's, whichever call
of the process it is, so a resumed run's first step is the uninterrupted run's; both paths are bitwise
the same but for a forward whose random draws depend on a kernel choice that the transform changes
(``nn.MultiheadAttention``'s dropout), where the draws are the eager PyTorch loop's
(tests/test_step_grad.py).

While dynamo traces (a compiled step), :func:`_traced_grad_and_value` is ``grad_and_value``'s own
implementation with the params walked in plain loops: the same functorch calls in the same order, so the
same graph, without torch's Python pytree flattening, rebuilding and mapping the params dict five times,
which dynamo interprets node by node (~230 bytecode instructions per param: 7.5k of a 2-layer GPT step's
24k; benchmarks/README.md, warm start).

Example:
    >>> import torch
    >>> fn = loss_and_grad(lambda p, x: ((p["w"] * x).sum(), {}))
    >>> grads, (value, aux) = fn({"w": torch.ones(2)}, torch.tensor([1.0, 2.0]))
    >>> grads["w"], value
    (tensor([1., 2.]), tensor(3.))
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._functorch import eager_transforms as functorch_impl
from torch.func import grad_and_value, vjp

from functrain import tree

__all__ = ["loss_and_grad", "plain_autograd_applies"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# What torch.func.grad_and_value's implementation calls (torch._functorch.eager_transforms); a torch
# without one of them traces the transform itself.
_FUNCTORCH_PIECES = (
    "grad_increment_nesting",
    "enable_inplace_requires_grad",
    "_wrap_for_grad",
    "_set_tensor_requires_grad",
    "_wrap_all_tensors",
    "_autograd_grad",
    "_unwrap_for_grad",
    "_undo_create_differentiable",
)
_TRACED_IMPL = all(hasattr(functorch_impl, name) for name in _FUNCTORCH_PIECES)


def plain_autograd_applies(params: Mapping[str, Any]) -> bool:
    """Whether plain autograd gives ``torch.func.grad_and_value``'s gradient of a function of
    ``params`` here: eagerly (no dynamo trace), outside every ``torch.func`` transform, every param a
    plain tensor or a DTensor of one (:func:`_plain_leaf`) that autograd does not follow already (none
    requires grad: an outer ``backward`` through the step needs ``grad_and_value``'s differentiable
    gradients)."""
    if torch.compiler.is_dynamo_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(_plain_leaf(p) and not p.requires_grad for p in params.values())


def _plain_leaf(p: Any) -> bool:
    """A plain tensor, or a DTensor (tensor parallelism's params) whose local part is one.

    A DTensor runs its ops below autograd (``__torch_dispatch__``; its ``__torch_function__`` is
    disabled): autograd records the same aten ops on the same DTensors whether ``grad_and_value``'s
    wrappers sit above them or not, and the backward dispatches the same derivative formulas to the same
    sharding rules and collectives, so both paths compute the same gradients, bitwise
    (tests/test_tensor_parallel_plain.py, every layout of :mod:`functrain.distributed.tensor_parallel`).
    Every other subclass keeps the transform: its own Python may see the transform's wrappers or the grad
    mode of the recorded backward (``create_graph=True``) and compute something else without them, and
    nothing here shows that it does not. DTensor is looked up, not imported (2 s of imports): a process
    holding one has imported it."""
    if type(p) in _PLAIN:
        return True
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and type(p) is dtensor and type(p._local_tensor) in _PLAIN


def loss_and_grad(fn: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., Any]:
    """``grad_fn(params, *args) -> (grads, (value, aux))`` of ``fn(params, *args) -> (value, aux)``, as
    ``torch.func.grad_and_value(fn, argnums=0, has_aux=True)``: ``params`` a flat dict of tensors,
    ``value`` a 0-d tensor; a param ``value`` does not depend on gets a zero gradient.

    Eagerly, where :func:`plain_autograd_applies` (plain tensors, or DTensors of them), by
    ``torch.autograd.grad`` (the first call runs the forward under the transform once more, for its
    refusals, with the generators' states restored after it); the value and every tensor of ``aux`` come
    back detached, as from the transform.

    Example:
        >>> grads, (value, _) = loss_and_grad(lambda p: ((p["w"] ** 2).sum(), ()))({"w": torch.ones(2)})
        >>> grads["w"]
        tensor([2., 2.])
    """
    transformed = grad_and_value(fn, argnums=0, has_aux=True)
    checked = False  # the transform took the function once: what it refuses was refused

    def grad_fn(params: dict[str, torch.Tensor], *args: Any) -> Any:
        nonlocal checked
        if torch.compiler.is_dynamo_compiling():  # first: a trace never reads (nor guards on) `checked`
            return _traced_grad_and_value(fn, params, args)
        if not plain_autograd_applies(params):
            return transformed(params, *args)
        if not checked:
            with torch.random.fork_rng(devices=_devices(params)):  # a check: it draws nothing of the run's
                vjp(lambda p: fn(p, *args), params, has_aux=True)  # the forward under the transform
            checked = True
        return _plain_grad_and_value(fn, params, args)

    return grad_fn


def _devices(params: Mapping[str, torch.Tensor]) -> list[torch.device]:
    """The accelerators ``params`` live on, whose generators :func:`torch.random.fork_rng` restores."""
    return list({p.device for p in params.values() if p.device.type != "cpu"})


def _plain_grad_and_value(fn: Callable[..., Any], params: dict[str, torch.Tensor], args: tuple) -> Any:
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    with torch.enable_grad():
        value, aux = fn(leaves, *args)
    inputs = list(leaves.values())
    if value.requires_grad:
        grads = torch.autograd.grad(value, inputs, allow_unused=True)
    else:  # nothing to differentiate (as the transform: zeros)
        grads = (None,) * len(inputs)
    out = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(leaves.items(), grads)}
    return out, (value.detach(), tree.map(_detached, aux))


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


# grad_and_value's refusal of saved-tensor hooks (torch.utils.checkpoint's), in its words.
_NO_SAVED_TENSOR_HOOKS = (
    "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. "
    "Please open an issue with your use case."
)


def _traced_grad_and_value(fn: Callable[..., Any], params: dict[str, torch.Tensor], args: tuple) -> Any:
    """``grad_and_value(fn, argnums=0, has_aux=True)(params, *args)`` for dynamo to trace: torch's
    ``grad_and_value_impl`` step by step (the same functorch calls, so the same graph and the same
    values), with the params dict walked in plain loops instead of torch's Python pytree. The other
    arguments and ``aux`` (a few leaves) go through functorch's own pytree helpers."""
    f = functorch_impl
    with (
        torch.autograd.graph.disable_saved_tensors_hooks(_NO_SAVED_TENSOR_HOOKS),
        f.grad_increment_nesting() as level,
        torch.enable_grad(),  # grad_and_value's "NOTE [grad and vjp interaction with no_grad]"
    ):
        wrapped = {}
        for name, p in params.items():
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"loss_and_grad: params[{name!r}] is a {type(p).__name__}, not a tensor")
            wrapped[name] = f._wrap_for_grad(p, level)
        args = f._wrap_all_tensors(args, level)
        with f.enable_inplace_requires_grad(True):
            for p in wrapped.values():
                f._set_tensor_requires_grad(p)
        value, aux = fn(wrapped, *args)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise RuntimeError("loss_and_grad: the function must return (a 0-d tensor, aux)")
        grads = f._autograd_grad((value,), tuple(wrapped.values()), create_graph=True)
        out = {name: f._unwrap_for_grad(g, level) for name, g in zip(wrapped, grads)}
        value = f._unwrap_for_grad(value, level)
        aux = f._undo_create_differentiable(aux, level)
    return out, (value, aux)
