"""What :func:`functrain.jit` wraps a step in before ``torch.compile`` sees it, and the eager forward it
runs before the first trace. Dynamo starts tracing in this module: its globals are library globals to
:mod:`functrain.compile.guards`.

Example:
    >>> target = with_own_code(donating(train_step))  # doctest: +SKIP
    >>> new_state, metrics = target(state, batch)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from functrain import tree
from functrain.compile.cache_hits import with_code

__all__ = [
    "device_of",
    "donating",
    "has_permuted_layout",
    "keeping_layouts",
    "passing_through",
    "restore_layouts",
    "settle_eagerly",
    "takes_donated",
    "with_own_code",
]

log = logging.getLogger("functrain.jit")  # the logger jit's users configure


def device_of(state: Any) -> torch.device | None:
    params = getattr(state, "params", None)
    if isinstance(params, dict):
        for x in params.values():
            if isinstance(x, torch.Tensor):
                return x.device
    return None


def takes_donated(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` itself (not what it wraps) declares a keyword-only ``donated`` parameter."""
    try:
        parameter = inspect.signature(fn, follow_wrapped=False).parameters.get("donated")
    except (TypeError, ValueError):  # a callable without a signature
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def settle_eagerly(forward: Callable[..., Any], name: str, state: Any, args: tuple, kwargs: dict) -> None:
    """Run ``forward(state, *args)`` (a step's settling forward) eagerly, leaving the random generators as they were.

    Models settle Python attributes in their first forward: Hugging Face's classification heads (BERT,
    ViT, ...) set ``config.problem_type`` from the labels. Traced first, the step guards the unsettled
    value (``config.problem_type is None``) and recompiles on its second call, as any ``torch.compile``
    of such a model does. One eager forward first costs far less than a compile (benchmarks/README.md).

    A forward that fails here raises its own exception, unchanged: the step's forward is the user's
    code, and its error is eager's, a traceback ending at the user's line, before dynamo traces
    anything (traced, the same mistake surfaces as dynamo's exception, its message grown by the traced
    stack).
    """
    device = device_of(state)
    devices = [device.index or 0] if device is not None and device.type not in ("cpu", "meta") else []
    started = time.perf_counter()
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        forward(state, *args, **kwargs)
    log.debug("%s: eager forward before the first compile: %.3f s", name, time.perf_counter() - started)


def with_own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own.

    Dynamo keeps compiled graphs, recompile counts and guard failures per code object. The wrappers
    made by :func:`donating` and :func:`keeping_layouts` (and steps made by one factory) share theirs, so
    without a copy every CompiledStep in a process would share one cache: each call would first check
    the other steps' guards, their compiles would count toward dynamo's recompile limit, and a
    recompile would be explained by another step's guard failure.
    """
    return functools.update_wrapper(with_code(fn, fn.__code__.replace()), fn)


def donating(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a step so it writes the new state into the incoming state's tensors (JAX's donation).

    A step that declares a keyword-only ``donated`` parameter (:func:`functrain.make_train_step`'s) is
    told so (``donated=True``), as an argument: its optimizer may then update in place.
    """

    told = takes_donated(fn)

    @functools.wraps(fn)
    def donating_step(state: Any, *args: Any, **kwargs: Any) -> Any:
        if told:  # make_train_step's optimizer may then update in place
            new_state, *rest = fn(state, *args, donated=True, **kwargs)
        else:
            new_state, *rest = fn(state, *args, **kwargs)
        # torch's pytree, not optree: dynamo cannot trace optree flattening an empty dict (a model
        # without buffers) inside the graph ("SourcelessBuilder ... DictMetaData", torch 2.11-2.13 with
        # optree 0.20).
        old_leaves, spec = torch_pytree.tree_flatten(state)
        new_leaves, new_spec = torch_pytree.tree_flatten(new_state)
        if not tree.same_structure(spec, new_spec):
            return (new_state, *rest)
        merged = [old.copy_(new) if _replaces(new, old) else new for old, new in zip(old_leaves, new_leaves)]
        return (torch_pytree.tree_unflatten(merged, spec), *rest)

    return donating_step


def _replaces(new: Any, old: Any) -> bool:
    """Whether ``new`` is another tensor of ``old``'s shape, dtype and device: one a step can write
    into ``old`` (donation) or into ``old``'s layout (:func:`keeping_layouts`)."""
    return (
        isinstance(old, torch.Tensor)
        and isinstance(new, torch.Tensor)
        and old is not new
        and old.shape == new.shape
        and old.dtype == new.dtype
        and old.device == new.device
    )


def passing_through(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind a ``(state, *args, **kwargs)`` frame: the frames whose compiled graphs
    :class:`functrain.compile.cache_hits.CacheHits` calls directly (as :func:`keeping_layouts`'s)."""

    @functools.wraps(fn)
    def step(state: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(state, *args, **kwargs)

    return step


def keeping_layouts(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a pure step so each tensor of the new state has the strides of the one it replaces.

    A compiled graph's outputs get the strides its fake-tensor trace predicted, which need not be the
    inputs' nor eager's: before pytorch/pytorch#171622 the convolution backward's meta kernel predicted
    contiguous weight gradients where CUDA returns channels_last ones, and what is computed from the
    gradients (the optimizer's moments, through decomposed pointwise ops) can follow that layout. A state
    whose layout changes after a step recompiles the step and feeds its convolutions converted copies;
    issue 10 measured the pure ResNet-50 step at twice the donating one's time on an H100. The donating
    step cannot drift: it copies into the input's tensors. Here the same copy goes into a fresh tensor of
    the input's layout, only where the strides differ (decided while tracing: nothing is added where they
    match); inductor fuses it into the kernel that computes the value.

    :func:`functrain.jit` traces this wrapper only for a state with a permuted layout: the per-leaf check
    costs dynamo about 40% of a step's trace. Other states compile the bare step, whose first result per
    graph is checked eagerly (:func:`restore_layouts`); a drift switches to this wrapper (one compile).
    """

    @functools.wraps(fn)
    def layout_keeping_step(state: Any, *args: Any, **kwargs: Any) -> Any:
        return restore_layouts(state, fn(state, *args, **kwargs))

    return layout_keeping_step


def has_permuted_layout(state: Any) -> bool:
    """Whether a tensor of ``state`` is not contiguous (channels_last weights, a transposed buffer): the
    states whose layout a compiled step must keep inside its graph (:func:`keeping_layouts`)."""
    return any(isinstance(x, torch.Tensor) and not x.is_contiguous() for x in tree.leaves(state))


def restore_layouts(state: Any, out: Any) -> Any:
    """``out`` (a step's result) with each new state tensor in the strides of the one it replaces; ``out``
    itself where every stride matches or ``out`` holds no new state (an eval or predict step's results).

    Eagerly the leaves come from optree (C++; torch's pytree walks in Python: ~10% of a small CNN's eager
    step); traced, from torch's pytree: dynamo cannot trace optree flattening an empty dict (a model
    without buffers) inside the graph ("SourcelessBuilder ... DictMetaData", torch 2.11-2.13, optree 0.20).
    """
    if not (isinstance(out, tuple) and out and type(out[0]) is type(state)):
        return out
    traced = torch.compiler.is_dynamo_compiling()
    old_leaves = torch_pytree.tree_leaves(state) if traced else tree.leaves(state)
    new_leaves, spec = torch_pytree.tree_flatten(out[0]) if traced else tree.flatten(out[0])
    if len(old_leaves) != len(new_leaves):
        return out
    kept = [_like_layout(new, old) for old, new in zip(old_leaves, new_leaves)]
    if all(k is n for k, n in zip(kept, new_leaves)):
        return out
    rebuilt = torch_pytree.tree_unflatten(kept, spec) if traced else tree.unflatten(spec, kept)
    return (rebuilt, *out[1:])


def _like_layout(new: Any, old: Any) -> Any:
    """``new``, copied into ``old``'s strides when they differ (dense layouts only)."""
    if not _replaces(new, old) or new.stride() == old.stride():
        return new
    out = torch.empty_like(old)  # preserve_format: old's exact strides when old is dense
    return out.copy_(new) if out.stride() == old.stride() else new
