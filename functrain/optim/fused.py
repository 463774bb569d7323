"""Adam's update as one opaque call to torch's fused multi-tensor kernel (``torch._fused_adam_``).

Inside functrain's one-graph step inductor fuses an optimizer written with foreach ops into the
backward's kernels: each leaf's update rides in the kernel that produced its gradient, so kernels that
would be identical across a model's repeated blocks all differ, and inductor's per-node work (lowering,
scheduling, re-inplacing) grows with every optimizer op. Registered as a custom op
(:func:`torch.library.custom_op`), the Adam update is a single extern call in the graph that inductor
neither lowers nor fuses; it runs the kernel ``torch.optim.Adam(fused=True)`` runs, on CPU and CUDA.
For a 12-layer tiny GPT step on a 2-core CPU this cut a cold compile by ~20% (55.0 -> 44.7 s in one
run); the step costs 2-5% more (the kernel re-reads the gradients and writes new moments instead of
riding in the backward's kernels; ``adamw(..., fused=False)`` keeps the in-graph update). ``apply(...,
in_place=True)`` writes into the given params and moments (no copies): a donating step
(``jit(..., donate=True)``) without loss scaling passes it, as nothing reads the old values after it.
Numbers: benchmarks/README.md, "Compile time and per-call overhead".

:func:`adam_with_fused_apply` builds ``optim.adam``/``optim.adamw``: the usual ``chain`` (same state,
same ``update``), plus an ``apply`` that :func:`functrain.optim.apply_gradients` (and so every train
step) uses. It falls back to ``update`` + ``apply_updates`` where the kernel does not apply: where
something differentiates through the step (a leaf, the rate or the decay requires a gradient, as under
``torch.func.grad`` of a loss after unrolled steps: the kernel has no backward), or for leaves that are
not dense floating-point tensors on CPU or CUDA, or are tensor subclasses.
Under ``functrain.ensemble``'s vmap the kernel runs once per member.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> tx = optim.adamw(0.1, weight_decay=0.0)
    >>> params = {"w": torch.ones(2)}
    >>> new_params, _ = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params), params)
    >>> new_params["w"]
    tensor([0.9000, 0.9000])
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from functrain import tree
from functrain.core import foreach
from functrain.optim._leaves import flatten_matching
from functrain.optim.base import (
    GradientTransformation,
    NormFn,
    OptState,
    apply_gradients,
    chain,
    update_with_norm,
)
from functrain.optim.masking import MaskedState, bool_labels
from functrain.optim.transforms import ScaleByAdamState, add_decayed_weights, scale_by_adam
from functrain.tree import PyTree

__all__ = ["adam_with_fused_apply"]

_KERNEL_DEVICES = ("cpu", "cuda")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    nu_max: list[Tensor],
    count: Tensor,
    learning_rate: Tensor,
    weight_decay: Tensor,
    decayed: list[bool],
    b1: float,
    b2: float,
    eps: float,
    in_place: bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """One Adam step with torch's fused kernel, per device and dtype. Leaves where ``decayed`` is True
    first shrink by ``1 - learning_rate * weight_decay`` (AdamW, as torch); ``nu_max`` is empty without
    amsgrad. ``in_place`` writes into the given tensors, else into new ones (the inputs stay as they were)."""
    if not in_place:
        mu, nu, nu_max = ([x.clone() for x in xs] for xs in (mu, nu, nu_max))
    new_params = list(params)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), index in groups.items():
        lr = learning_rate.to(device)
        shrink = [i for i in index if decayed[i]] if decayed else []
        if shrink:
            shrunk = [params[i] for i in shrink]
            # In the hyperparameters' dtype (float64 for float64 params: torch's ``1 - lr * wd`` in double).
            factor = 1 - lr * weight_decay.to(device)
            if in_place:
                torch._foreach_mul_(shrunk, factor)
            else:
                for i, x in zip(shrink, torch._foreach_mul(shrunk, factor)):
                    new_params[i] = x
        if not in_place:
            for i in set(index) - set(shrink):
                new_params[i] = params[i].clone()
        step = count.to(device=device, dtype=torch.float32)
        # The CPU kernel reads a tensor lr as a double (a float64 lr is exact); the CUDA kernel reads it
        # through a float pointer, so it gets float32 there.
        kernel_lr = lr if device.type == "cpu" else lr.to(torch.float32)
        torch._fused_adam_(
            *([xs[i] for i in index] for xs in (new_params, grads, mu, nu)),
            [nu_max[i] for i in index] if nu_max else [],
            [step] * len(index),  # read, not advanced: the kernel's bias corrections use it as the count
            lr=kernel_lr,
            beta1=b1,
            beta2=b2,
            weight_decay=0.0,
            eps=eps,
            amsgrad=bool(nu_max),
            maximize=False,
        )
    return new_params, mu, nu, nu_max


def _custom_op(name: str, in_place: bool) -> Any:
    """:func:`_adam_step` as a torch custom op: new tensors, or written into the given params and moments
    (a donated state's). custom_op reads the schema from the signature: ``_adam_step``'s, less
    ``in_place`` (and less the result, in place)."""

    def run(*args: Any) -> Any:
        out = _adam_step(*args, in_place)
        return None if in_place else out

    signature = inspect.signature(_adam_step)
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=list(signature.parameters.values())[:-1],
        return_annotation=None if in_place else signature.return_annotation,
    )
    mutates = ("params", "mu", "nu", "nu_max") if in_place else ()
    return torch.library.custom_op(name, run, mutates_args=mutates)


_fused_adam_op = _custom_op("functrain::fused_adam", in_place=False)
_fused_adam_op_ = _custom_op("functrain::fused_adam_", in_place=True)


def _fused_adam(*args: Any) -> Any:
    """:func:`_adam_step` into new tensors: the custom op where a compile traces it (one opaque call)
    or a transform needs its rules (vmap); eagerly the function itself, as the op's dispatch (its
    autograd wrapper, dynamo's ``disable``) cost a BatchNorm CNN's eager step ~4%
    (benchmarks/eager_step.py). The leaves need no gradient (:func:`_kernel_applies`)."""
    if _dispatched():
        return _fused_adam_op(*args)
    return tuple(_adam_step(*args, False))


def _fused_adam_(*args: Any) -> None:
    """:func:`_adam_step` written into the given params and moments (as :func:`_fused_adam`)."""
    if _dispatched():
        _fused_adam_op_(*args)
    else:
        _adam_step(*args, True)


def _dispatched() -> bool:
    return torch.compiler.is_dynamo_compiling() or torch._C._functorch.peek_interpreter_stack() is not None


@_fused_adam_op.register_fake
def _(params, grads, mu, nu, nu_max, count, learning_rate, weight_decay, decayed, b1, b2, eps):  # type: ignore[no-untyped-def]
    return tuple([torch.empty_like(x) for x in xs] for xs in (params, mu, nu, nu_max))


@_fused_adam_op.register_vmap
def _(info, in_dims, params, grads, mu, nu, nu_max, count, learning_rate, weight_decay, decayed, b1, b2, eps):  # type: ignore[no-untyped-def]
    """Under vmap (``functrain.ensemble``): the kernel once per member, on that member's slices, so a
    member's arithmetic is exactly that of the same model trained alone."""

    def member(x: Tensor, dim: int | None, e: int) -> Tensor:
        return x if dim is None else x.select(dim, e)

    lists = (params, grads, mu, nu, nu_max)
    per_member = [
        _fused_adam(
            *(
                [member(x, d, e) for x, d in zip(xs, dims or [None] * len(xs))]
                for xs, dims in zip(lists, in_dims)
            ),
            *(member(x, d, e) for x, d in zip((count, learning_rate, weight_decay), in_dims[5:8])),
            decayed,
            b1,
            b2,
            eps,
        )
        for e in range(info.batch_size)
    ]
    stacked = tuple([torch.stack(xs) for xs in zip(*(m[k] for m in per_member))] for k in range(4))
    return stacked, tuple([0] * len(xs) for xs in stacked)


def _kernel_applies(
    params: list[Tensor], grads: list[Tensor], moments: list[list[Tensor]], scalars: list[Tensor]
) -> bool:
    """Whether torch's fused kernel takes these leaves: plain (no subclass) dense floating-point tensors
    on CPU or CUDA, and nothing differentiates through the step (the kernel has no backward): no leaf,
    and neither the rate nor the decay (``scalars``), requires a gradient where grad mode is on.

    Eagerly every leaf is checked (microseconds; ``not requires_grad`` among the rest). Inside a
    compiled step the params' and grads' layout and whether they or the scalars are differentiated are,
    each as one set of values over the leaves: dynamo interprets each check, and checking
    the ~600 leaves of a 12-layer GPT's step cost 0.7 s of its 5 s trace (benchmarks/README.md). The
    grads come from the params through ``grad_and_value`` (same type, dtype and device), and the moments
    are made from the params by ``init`` and moved and cast with them (``TrainState.to``), and follow the
    params and grads into being differentiated; a moment of another dtype made by hand reaches torch's
    kernel, which rejects it ("expected scalar type ...").
    """
    if not params:
        return False
    if not torch.compiler.is_dynamo_compiling():
        return not foreach.tracked(scalars) and _plain_leaves(
            [*params, *grads, *(x for xs in moments for x in xs)]
        )
    # Each fact of every leaf at once, with builtins mapped over the list (functrain/tree.py: dynamo runs
    # them in its own code): loops over the leaves cost 2.2k of a 2-layer GPT step's 17.7k instructions.
    if _facts(grads, "layout") != _STRIDED or foreach.tracked(scalars):
        return False
    if torch.is_grad_enabled() and True in _facts(grads, "requires_grad"):
        return False
    devices = _facts(params, "device")
    return (
        frozenset(map(type, params)) <= _PLAIN_TYPES
        and _facts(params, "layout") == _STRIDED
        and True not in _facts(params, "requires_grad")
        and _facts(params, "dtype") <= _KERNEL_DTYPE_SET
        and frozenset(map(getattr, devices, itertools.repeat("type"))) <= _KERNEL_DEVICE_SET
    )


def _facts(leaves: list[Tensor], name: str) -> frozenset[Any]:
    """The values of attribute ``name`` over ``leaves`` (a set)."""
    return frozenset(map(getattr, leaves, itertools.repeat(name)))


_PLAIN_TYPES = frozenset((Tensor, torch.nn.Parameter))
_KERNEL_DTYPE_SET = frozenset(_KERNEL_DTYPES)
_KERNEL_DEVICE_SET = frozenset(_KERNEL_DEVICES)
_STRIDED = frozenset((torch.strided,))


def _plain_leaves(leaves: list[Tensor]) -> bool:
    """Eagerly: whether every leaf is a plain dense floating-point tensor on CPU or CUDA that needs no
    gradient. A loop with C properties (``is_cpu``/``is_cuda``; ``device.type`` builds a device object per
    leaf): 0.16 against 0.56 ms for a tiny BERT's 164 leaves, on each eager step."""
    for x in leaves:
        if not (
            type(x) in _PLAIN_TYPES
            and x.layout is torch.strided
            and not x.requires_grad
            and x.dtype in _KERNEL_DTYPE_SET
            and (x.is_cpu or x.is_cuda)
        ):
            return False
    return True


def _learning_rate(lr_tx: GradientTransformation, state: OptState, like: Tensor) -> tuple[Tensor, OptState]:
    """The rate ``lr_tx`` (a ``scale_by_learning_rate``) applies this step, and its next state: what it
    makes of an update of -1 (constant, scheduled and scaled rates alike): float32, or float64 when the
    rate in its state is (float64 params: the exact rate)."""
    dtype = torch.promote_types(state.learning_rate.dtype, torch.float32)
    minus_one = torch.full((), -1.0, dtype=dtype, device=like.device)
    scaled, state = lr_tx.update({"rate": minus_one}, state)
    return scaled["rate"], state


def _decay(
    decay_states: tuple[OptState, ...], mask_leaves_of: Any, params: PyTree, n: int, lr: Tensor
) -> tuple[list[bool], Tensor]:
    """Which leaves the decoupled decay shrinks, and its rate: from ``add_decayed_weights``' state (masked
    or not), or no leaves (``decay_states`` empty: no decoupled decay; the rate is then unread)."""
    if not decay_states:
        return [], lr
    (decay_state,) = decay_states
    if mask_leaves_of is None:
        return [True] * n, decay_state.weight_decay
    masked: MaskedState = decay_state
    return list(mask_leaves_of(params)), masked.inner_state.weight_decay


def adam_with_fused_apply(
    b1: float,
    b2: float,
    eps: float,
    amsgrad: bool,
    learning_rate: GradientTransformation,
    coupled: Sequence[GradientTransformation] = (),
    weight_decay: float | None = None,
    mask: PyTree | None = None,
    betas_in_state: bool = False,
) -> GradientTransformation:
    """``chain(*coupled, scale_by_adam(b1, b2, eps, amsgrad), add_decayed_weights(weight_decay, mask),
    learning_rate)`` (the decay only when ``weight_decay`` is given) whose ``apply`` runs the step as one
    fused kernel.

    ``coupled`` transforms (L2 decay) run on the gradients before it, as in the chain. The decoupled
    decay (AdamW's) shrinks the params by ``lr * weight_decay`` inside the kernel call, before the Adam
    step, as ``torch.optim.AdamW`` does; the state, hyperparameters and mask are the chain's.
    ``betas_in_state`` (:mod:`functrain.optim.state_betas`): the chain alone, no ``apply`` (the kernel
    takes the betas as floats).

    Example:
        >>> from functrain.optim import scale_by_learning_rate
        >>> tx = adam_with_fused_apply(0.9, 0.999, 1e-8, False, scale_by_learning_rate(0.1))
        >>> params = {"w": torch.zeros(1)}
        >>> tx.apply({"w": torch.ones(1)}, tx.init(params), params)[0]
        {'w': tensor([-0.1000])}
    """
    decoupled = [] if weight_decay is None else [add_decayed_weights(weight_decay, mask)]
    adam = scale_by_adam(b1, b2, eps, amsgrad=amsgrad, betas_in_state=betas_in_state)
    unfused = chain(*coupled, adam, *decoupled, learning_rate)
    if betas_in_state:
        return unfused
    n_coupled = len(coupled)
    # Which leaves decay: resolved on the host at init (a name pattern does not trace), as masked() does.
    mask_leaves_of = None if mask is None else bool_labels("adamw", mask, "mask")

    def init(params: PyTree) -> tuple[OptState, ...]:
        if mask_leaves_of is not None:
            mask_leaves_of(params)
        return unfused.init(params)

    def apply(
        grads: PyTree,
        state: tuple[OptState, ...],
        params: PyTree,
        *,
        norm: NormFn | None = None,
        in_place: bool = False,
    ) -> tuple[PyTree, tuple[OptState, ...]]:
        # the chain's state, by its structure: coupled transforms', Adam's, the decay's (if any), the rate's
        *coupled_states, adam_state, lr_state = state[: n_coupled + 1] + state[-1:]
        decay_states = state[n_coupled + 1 : -1]
        moments = (adam_state.mu, adam_state.nu, *((adam_state.nu_max,) if amsgrad else ()))
        grad_leaves, (param_leaves, *moment_leaves), spec = flatten_matching("adam", grads, params, *moments)
        hyper = tree.leaves((coupled_states, decay_states, lr_state))  # the rates and decays, a few 0-d
        if not _kernel_applies(param_leaves, grad_leaves, moment_leaves, hyper):
            return apply_gradients(unfused, grads, state, params, norm=norm)
        new_coupled = []
        for tx, s in zip(coupled, coupled_states):
            grads, s = update_with_norm(tx, grads, s, params, norm)
            new_coupled.append(s)
        lr, new_lr_state = _learning_rate(learning_rate, lr_state, param_leaves[0])
        decayed, decay = _decay(decay_states, mask_leaves_of, params, len(param_leaves), lr)
        count = adam_state.count + 1
        if coupled:  # the L2 term changed the grads; else their leaves are the ones flattened above
            grad_leaves = tree.leaves(grads)
        mu_leaves, nu_leaves, *rest = moment_leaves
        nu_max_leaves = rest[0] if amsgrad else []
        args = (
            param_leaves, grad_leaves, mu_leaves, nu_leaves, nu_max_leaves, count, lr, decay, decayed, b1, b2, eps,
        )  # fmt: skip
        if in_place and not foreach.batched(param_leaves):  # a donated state: no copies (not under vmap)
            _fused_adam_(*args)
            new_params, mu, nu, nu_max = param_leaves, mu_leaves, nu_leaves, nu_max_leaves
        else:
            new_params, mu, nu, nu_max = _fused_adam(*args)
        new_adam = ScaleByAdamState(
            count=count,
            mu=tree.unflatten(spec, mu),
            nu=tree.unflatten(spec, nu),
            nu_max=tree.unflatten(spec, nu_max) if amsgrad else None,
        )
        return tree.unflatten(spec, new_params), (*new_coupled, new_adam, *decay_states, new_lr_state)

    return GradientTransformation(init, unfused.update, apply)
