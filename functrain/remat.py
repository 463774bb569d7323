"""Activation recompute (rematerialisation) that works inside functrain's steps, eager and compiled.

``remat(block)`` runs ``block`` without keeping its intermediate activations and recomputes them in
the backward pass: a transformer's activation memory drops from every layer's intermediates to each
layer's input. ``torch.utils.checkpoint`` does the same for plain autograd but cannot run under
``torch.func.grad`` (the step's backward): the non-reentrant variant needs saved-tensor hooks, which
``torch.func`` disables, and the reentrant one is an ``autograd.Function`` without ``setup_context``.
``remat`` is an ``autograd.Function`` with ``setup_context`` and a generated vmap rule, whose backward
re-runs the block under ``torch.func.vjp``. Under ``torch.compile`` dynamo turns the block into its
activation-checkpoint operator, whose implementation (run when AOTAutograd traces the step) calls
``torch.utils.checkpoint.checkpoint``, routed back here: the recomputation lands in the one graph.

Inside a functrain step, ``torch.utils.checkpoint.checkpoint`` calls are routed here (see
:func:`routed_checkpoint`), including Hugging Face's ``gradient_checkpointing_enable()``.

Example:
    >>> import torch, functrain as ft
    >>> blocks = torch.nn.Sequential(*(ft.remat(torch.nn.Linear(8, 8)) for _ in range(4)))
    >>> blocks(torch.randn(2, 8)).shape  # each Linear's activations are recomputed in the backward
    torch.Size([2, 8])
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from functrain.core.patch import patched

__all__ = ["Remat", "RematRandomnessError", "checkpoint", "remat", "routed_checkpoint"]

_TORCH_CHECKPOINT = torch_checkpoint.checkpoint
# What torch.func.grad says about torch's checkpoint: non-reentrant, reentrant.
_UNROUTED_CHECKPOINT = ("don't yet support saved tensor hooks", "must override the setup_context")
_ROUTED: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]] = weakref.WeakKeyDictionary()


class RematRandomnessError(RuntimeError):
    """A rematerialised block draws random numbers inside a compiled step (see :func:`remat`)."""


# ------------------------------------------------------------------------------------------ the function


class _Recompute(torch.autograd.Function):
    """``forward(run, rng, *tensors) = run(*tensors)``; the backward re-runs ``run`` under ``vjp``.

    Only the inputs are saved. ``setup_context`` and ``generate_vmap_rule`` make it usable under
    ``torch.func`` transforms (the step's ``grad_and_value``).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(run: Callable[..., tuple[torch.Tensor, ...]], rng: Any, *tensors: torch.Tensor) -> Any:
        return run(*tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        run, rng, *tensors = inputs
        ctx.run = run
        ctx.rng = rng
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        # Detached: torch.func.grad runs the backward with create_graph=True, which would record the
        # recomputation (and keep every block's recomputed activations alive until the step's
        # gradient is complete: no memory saved). functrain takes first-order gradients only.
        tensors = [t.detach() for t in ctx.saved_tensors]
        grads = tuple(g.detach() for g in grads)
        with _restored_rng(ctx.rng), torch.enable_grad():
            _, vjp_fn = torch.func.vjp(ctx.run, *tensors)
            # first order, and each recomputed tensor freed as soon as its backward has run (vjp_fn's
            # defaults keep the recomputed graph, full weights of a ZeRO-3 block included, to the end)
            return (None, None, *vjp_fn(grads, retain_graph=False, create_graph=False))


class _RngState:
    """The generator states at a block's forward. A plain object, not a pytree: ``torch.func`` must
    not wrap the state tensors it holds as inputs of the custom Function."""

    def __init__(self, device: torch.device | None) -> None:
        self.cpu = torch.get_rng_state()
        self.device = None
        if device is not None and device.type not in ("cpu", "meta"):
            backend = getattr(torch, device.type, None)
            if backend is not None and hasattr(backend, "get_rng_state"):
                self.device = (device, backend.get_rng_state(device))


@contextlib.contextmanager
def _restored_rng(state: _RngState | None) -> Iterator[None]:
    if state is None:
        yield
        return
    devices = [state.device[0]] if state.device is not None else []
    with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"):
        torch.set_rng_state(state.cpu)
        if state.device is not None:
            device, device_state = state.device
            getattr(torch, device.type).set_rng_state(device_state, device)
        yield


def _autocast_state(device: torch.device | None) -> list[tuple[str, bool, torch.dtype]]:
    """The autocast settings at a block's forward, for the CPU and the block's device. The backward
    runs outside the step's ``torch.autocast`` block: without them the recomputation would run in
    float32 where the forward ran in bf16, and the gradient would not be the forward's (as
    ``torch.utils.checkpoint`` restores them too)."""
    types = ["cpu"] + ([device.type] if device is not None and device.type not in ("cpu", "meta") else [])
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


@contextlib.contextmanager
def _autocast_as(state: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


class _RandomOps(TorchDispatchMode):
    """Records whether any operator that draws random numbers runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.seen is None and _draws(func, args, kwargs):
            self.seen = str(func)
        return func(*args, **kwargs)


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an operator call draws random numbers: tagged as seeded, and not with a dropout
    probability of 0 (attention kernels such as CPU flash attention carry the tag for their
    ``dropout_p`` even when it is 0)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    schema = func._schema.arguments
    values = {a.name: a.default_value for a in schema if a.has_default_value()}  # dispatch drops defaults
    values |= dict(zip((a.name for a in schema), args)) | kwargs
    for name in ("dropout_p", "p"):
        if name in values and isinstance(values[name], (int, float)):
            return values[name] != 0 and values.get("train", True) is not False
    return True


def _is_traced(tensors: list[torch.Tensor]) -> bool:
    from torch._guards import detect_fake_mode

    return detect_fake_mode(tuple(tensors)) is not None


# ------------------------------------------------------------------------------------------ remat


def _describe(fn: Any) -> str:
    if getattr(fn, "__name__", "") == "run_with_interpreter":  # dynamo's checkpoint operator
        return "a rematerialised block (ft.remat or torch.utils.checkpoint)"
    return f"remat({fn!r})"


def _modules_of(fn: Any, seen: set[int] | None = None) -> list[nn.Module]:
    """The modules whose tensors ``fn`` reads: itself, a bound method's owner, a partial's function and
    arguments, or modules captured in a closure."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    if isinstance(fn, nn.Module):
        return [fn]
    if isinstance(fn, functools.partial):
        found = _modules_of(fn.func, seen)
        for x in itertools.chain(fn.args, fn.keywords.values()):
            if isinstance(x, nn.Module):
                found += _modules_of(x, seen)
        return found
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return _modules_of(owner, seen)
    found = []
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        found += _modules_in(fn, name, value, seen)
    namespace = getattr(fn, "__globals__", {})
    for name in _global_names(code):  # a module-level model or list of layers the function reads
        if name in namespace:
            found += _modules_in(fn, name, namespace[name], seen)
    if code is None and not isinstance(fn, type) and hasattr(fn, "__dict__") and _users(fn):  # an object
        for name, value in vars(fn).items():
            found += _modules_in(fn, name, value, seen)
    return found


def _global_names(code: Any) -> list[str]:
    """The global names ``code`` and the functions defined in it (lambdas, comprehensions) read."""
    if code is None:
        return []
    names = list(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names += _global_names(const)
    return names


def _modules_in(fn: Any, name: str, value: Any, seen: set[int]) -> list[nn.Module]:
    """The modules ``value`` (a closure cell's, a global's or an attribute's value) holds: itself, a
    function's, or those in a list, tuple, dict or set of them. A captured float tensor is refused."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        # functional_call cannot swap a captured tensor for the state's, and torch.func would give
        # it a zero gradient without a word.
        raise TypeError(
            f"remat({fn!r}): the function's closure holds the tensor {name!r}; a rematerialised "
            "function must receive its tensors as arguments or read them from modules. Pass it as "
            "an argument (remat(fn)(x, w)) or keep it in a module."
        )
    if isinstance(value, list | tuple | set | frozenset | dict):
        if id(value) in seen:
            return []
        seen.add(id(value))
        items = value.values() if isinstance(value, dict) else value
        return [m for item in items for m in _modules_in(fn, name, item, seen)]
    if isinstance(value, nn.Module) or (callable(value) and not isinstance(value, type) and _users(value)):
        return _modules_of(value, seen)
    if hasattr(value, "__dict__") and not isinstance(value, type) and _users(value) and id(value) not in seen:
        seen.add(id(value))  # an object of the user's holding layers as attributes
        return [m for attr, item in vars(value).items() for m in _modules_in(fn, attr, item, seen)]
    return []


def _users(fn: Any) -> bool:
    """Whether ``fn`` is the user's code (not torch's, functrain's or the standard library's), whose
    closure, globals or attributes may hold modules."""
    module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "")
    return not str(module).startswith(("torch", "functrain", "builtins", "functools", "math", "operator"))


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` without repeats and without those inside another one. A tensor reachable by two
    paths would be swapped twice by one ``functional_call`` (``tie_weights`` follows both), and the
    second swap's restore would leave the first swap's tensor in the module: after the step the model
    would hold a state's tensor instead of its own parameter."""
    unique = list({id(m): m for m in modules}.values())
    inner = {id(sub) for m in unique for sub in m.modules() if sub is not m}
    return [m for m in unique if id(m) not in inner]


class _Holder(nn.Module):
    """Holds the modules a function reads, so ``functional_call`` can swap all their tensors at once."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.held = nn.ModuleList(_outermost(modules))

    def forward(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)


class Remat:
    """A function (or module) whose activations are recomputed in the backward pass; see :func:`remat`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        preserve_rng_state: bool = True,
        modules: Iterable[nn.Module] = (),
    ) -> None:
        if not callable(fn):
            raise TypeError(f"remat needs a module or a function, got {type(fn).__name__}")
        modules = list(modules)
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(
                    f"remat({fn!r}, modules=...): modules[{i}] is a {type(m).__name__}, not an nn.Module; "
                    "pass the modules whose parameters and buffers the function reads"
                )
        self.fn = fn
        self.preserve_rng_state = preserve_rng_state
        # A partial's bound arguments become inputs (Hugging Face binds a layer's keyword arguments,
        # tensors among them, in one): tensors closed over would get no gradient.
        self._call, self._args, self._kwargs = fn, (), {}
        while isinstance(self._call, functools.partial):
            p = self._call
            self._call, self._args, self._kwargs = (
                p.func,
                (*p.args, *self._args),
                {**p.keywords, **self._kwargs},
            )
        self._holder = _Holder([*modules, *_modules_of(fn)])
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            # Dynamo turns this call into its activation-checkpoint operator, whose implementation
            # calls torch.utils.checkpoint.checkpoint when AOTAutograd traces it: inside functrain's
            # steps that is routed back here (routed_checkpoint), outside it is torch's checkpoint.
            return torch_checkpoint.checkpoint(
                self.fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **kwargs
            )
        return self.recompute(*args, **kwargs)

    def recompute(self, *args: Any, **kwargs: Any) -> Any:
        """Run the block through the recomputing Function (what ``__call__`` does outside dynamo)."""
        names, tensors = [], []
        for name, t in itertools.chain(
            self._holder.named_parameters(remove_duplicate=True),
            self._holder.named_buffers(remove_duplicate=True),
        ):
            names.append(name)
            tensors.append(t)
        return _apply(self, tuple(names), tuple(tensors), (*self._args, *args), {**self._kwargs, **kwargs})

    def __repr__(self) -> str:
        return f"remat({self.fn!r})"


def _apply(
    block: Remat, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], args: Any, kwargs: Any
) -> Any:
    # Under torch.compile this runs while AOTAutograd traces the step (see Remat.__call__), with traced
    # tensors: the custom Function's backward (the recomputation) lands in the step's graph like the
    # rest of the gradient computation.
    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    inputs = [*tensors, *leaves]
    # Differentiated inputs: floating-point tensors. The rest (token ids, masks, Python values) is
    # closed over.
    diff = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    n_held = len(tensors)
    out_spec: list[Any] = []

    def run(*diff_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(inputs)
        for i, t in zip(diff, diff_tensors):
            values[i] = t
        a, kw = torch_pytree.tree_unflatten(values[n_held:], spec)
        state = dict(zip(names, values[:n_held]))
        with _autocast_as(autocast):  # the backward's recomputation in the forward's precision
            out = torch.func.functional_call(
                block._holder, state, (block._call, a, kw), tie_weights=True, strict=False
            )
        out_leaves, o_spec = torch_pytree.tree_flatten(out)
        if not out_spec:
            out_spec.append(o_spec)
        for x in out_leaves:
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"{_describe(block.fn)}: the block must return tensors (or tuples/lists/dicts of "
                    f"tensors), got a {type(x).__name__} among its outputs"
                )
        return tuple(out_leaves)

    diff_tensors = [inputs[i] for i in diff]
    traced = _is_traced(diff_tensors)
    device = next((t.device for t in diff_tensors), None)
    rng = _RngState(device) if block.preserve_rng_state and not traced else None
    autocast = _autocast_state(device)
    if traced:
        # Under compile the recomputation is traced once and the generator state restored at trace
        # time would not reach the graph: a dropout mask redrawn in the backward would differ from the
        # forward's, and the gradient would be silently wrong. Refuse instead.
        detector = _RandomOps()
        with detector:
            out = _Recompute.apply(run, rng, *diff_tensors)
        if detector.seen is not None:
            raise RematRandomnessError(
                f"{_describe(block.fn)} draws random numbers ({detector.seen}, e.g. dropout in training "
                "mode) inside a compiled step, where its recomputation cannot replay the same draws. "
                "Move the dropout outside the rematerialised block, set its probability to 0, or run "
                "the step eagerly (ft.jit(step, compile=False)), where remat replays the generator state."
            )
    else:
        out = _Recompute.apply(run, rng, *diff_tensors)
    out = out if isinstance(out, tuple) else (out,)
    return torch_pytree.tree_unflatten(list(out), out_spec[0])


def remat(fn: Any, *, preserve_rng_state: bool = True, modules: Iterable[nn.Module] = ()) -> Any:
    """Recompute a module's (or function's) activations in the backward pass instead of keeping them.

    Only the block's inputs are kept for the backward pass, which runs the block again: less memory
    for one more forward of the block. Gradients are exactly those without remat (first order only:
    the recomputation is not differentiated again, so ``torch.func.hessian`` through a block is not
    supported).

    - A **module** is changed in place and returned: its ``forward`` becomes rematerialised, while its
      parameters, names, ``state_dict`` and hooks stay as they were, so
      ``nn.ModuleList(remat(Block()) for _ in range(12))`` just works.
    - A **function** (a bound method or ``functools.partial`` of a module's, or a function whose
      closure holds the modules it uses) is wrapped: ``remat(fn)(*args)``.

    Inside a step (``torch.func.functional_call``) those modules' tensors are the state's. The block's
    outputs must be tensors (or tuples/lists/dicts of them).

    Which tensors the block is differentiated with respect to: its tensor arguments and the parameters
    and buffers of the modules it reads. Those are found from ``fn``: the module itself, a bound
    method's owner, a partial's function and arguments, and what its closure cells and the globals its
    code names hold (modules, functions of yours, lists, tuples, dicts and sets of them, attributes of
    your own objects), followed through the functions found. A module reached another way (through a
    library's object) is not found, and its tensors would get no gradient: name it in ``modules``,
    which adds to the ones found.

    Randomness: eagerly, the generator state is saved and replayed (``preserve_rng_state``), so dropout
    draws the same masks in the recomputation. Under ``torch.compile`` that replay cannot reach the
    graph, so a block that draws random numbers in a compiled step raises :class:`RematRandomnessError`
    (keep dropout outside the block, or use it eagerly). Blocks that update buffers in training
    (BatchNorm) would update them twice: do not rematerialise them.

    Example:
        >>> blocks = torch.nn.ModuleList(remat(torch.nn.Linear(8, 8)) for _ in range(4))
        >>> blocks[0](torch.randn(2, 8)).shape
        torch.Size([2, 8])
        >>> layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]  # a list: not searched
        >>> stack = remat(lambda x: layers[1](layers[0](x).tanh()), modules=layers)
        >>> stack(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """
    if isinstance(fn, nn.Module):
        if not isinstance(fn.__dict__.get("forward"), Remat):
            fn.forward = Remat(fn.forward, preserve_rng_state=preserve_rng_state, modules=modules)
        return fn
    return Remat(fn, preserve_rng_state=preserve_rng_state, modules=modules)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Any = None,
    determinism_check: Any = None,
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """A drop-in for ``torch.utils.checkpoint.checkpoint`` that works inside functrain's steps.

    Both variants (``use_reentrant`` true or false) recompute the whole block (``remat(function)``);
    ``context_fn`` (selective checkpointing policies), ``determinism_check``, ``debug`` and
    ``early_stop`` are accepted and ignored.

    Example:
        >>> layer = torch.nn.Linear(4, 4)
        >>> checkpoint(layer, torch.randn(2, 4), use_reentrant=False).shape
        torch.Size([2, 4])
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    # The recomputing Function itself: under torch.compile this runs while AOTAutograd traces dynamo's
    # checkpoint operator, after dynamo's own trace.
    return Remat(function, preserve_rng_state=preserve).recompute(*args, **kwargs)


def _torch_checkpoint_kwargs(fn: Any) -> dict[str, Any] | None:
    """The keyword arguments of ``fn`` if it is torch's checkpoint or a ``partial`` of it, else None."""
    if fn is _TORCH_CHECKPOINT:
        return {}
    if isinstance(fn, functools.partial) and fn.func is _TORCH_CHECKPOINT and not fn.args:
        return dict(fn.keywords)
    return None


_LAYERS: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()


def _checkpointing_layers(model: nn.Module) -> list[nn.Module]:
    """The submodules that can switch gradient checkpointing on (transformers' layers have a
    ``gradient_checkpointing`` flag); found once per model: this runs before every step call."""
    if model not in _LAYERS:
        _LAYERS[model] = [
            m
            for m in model.modules()
            if hasattr(m, "gradient_checkpointing") or "_gradient_checkpointing_func" in m.__dict__
        ]
    return _LAYERS[model]


@contextlib.contextmanager
def routed_checkpoint(model: Any = None) -> Iterator[None]:
    """Route ``torch.utils.checkpoint.checkpoint`` to :func:`checkpoint` while the block runs.

    Two places are patched, and restored on exit: the module attribute
    ``torch.utils.checkpoint.checkpoint`` (code that calls it by that name, and the implementation
    ``torch.compile`` runs for it), and Hugging Face's per-layer ``_gradient_checkpointing_func``
    (set by ``model.gradient_checkpointing_enable()``) on ``model``'s submodules. A reference to torch's
    function taken earlier (``from torch.utils.checkpoint import checkpoint`` at import time) is not
    reached: call it through the module, or use :func:`remat`.

    Example:
        >>> with routed_checkpoint(torch.nn.Linear(4, 4)):
        ...     torch.utils.checkpoint.checkpoint is checkpoint
        True
        >>> torch.utils.checkpoint.checkpoint is checkpoint  # restored on exit
        False
    """
    if torch_checkpoint.checkpoint is not _TORCH_CHECKPOINT:  # already routed (nested steps)
        yield
        return
    changes: list[tuple[Any, str, Any]] = [(torch_checkpoint, "checkpoint", checkpoint)]
    if isinstance(model, nn.Module):
        for module in _checkpointing_layers(model):
            original = module.__dict__.get("_gradient_checkpointing_func")
            bound = _torch_checkpoint_kwargs(original)
            if bound is not None:
                # The same object every call: dynamo guards on its identity (a new one would recompile).
                cached = _ROUTED.get(module)
                if cached is None or cached[0] is not original:
                    cached = _ROUTED[module] = (original, functools.partial(checkpoint, **bound))
                changes.append((module, "_gradient_checkpointing_func", cached[1]))
    with patched(changes):
        try:
            yield
        except RuntimeError as e:
            if not any(sign in str(e) for sign in _UNROUTED_CHECKPOINT):
                raise
            function = _function_without_setup_context(e)
            if function is not None and function is not torch_checkpoint.CheckpointFunction:
                raise RuntimeError(_without_setup_context(function)) from e
            raise RuntimeError(
                "the model calls torch.utils.checkpoint through a reference functrain cannot route (e.g. "
                "`from torch.utils.checkpoint import checkpoint` at import time), and torch's checkpoint "
                f"cannot run under torch.func.grad ({str(e).splitlines()[0]}). Wrap the block with "
                "ft.remat(block) instead, or call it as torch.utils.checkpoint.checkpoint(...)."
            ) from e


def _function_without_setup_context(error: BaseException) -> type | None:
    """The ``torch.autograd.Function`` whose ``apply`` raised torch.func's "must override the setup_context"
    (torch's message does not name it: its ``apply`` frame holds it as ``cls``), or ``None``."""
    frame = error.__traceback__
    found = None
    while frame is not None:
        cls = frame.tb_frame.f_locals.get("cls") if frame.tb_frame.f_code.co_name == "apply" else None
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            found = cls
        frame = frame.tb_next
    return found


def _without_setup_context(function: type) -> str:
    """What to say about a model's autograd.Function that torch.func cannot differentiate."""
    name = f"{function.__module__}.{function.__qualname__}"
    fix = (
        "give it a `setup_context(ctx, inputs, output)` staticmethod, with `forward` taking no ctx "
        "(https://pytorch.org/docs/main/notes/extending.func.html), or run the step compiled "
        "(ft.jit(step)), where dynamo traces the Function's forward and backward into the step's graph"
    )
    if function.__module__.startswith("torch.distributed"):  # DTensor's from_local/to_local in TP hooks
        fix = (
            "torch's tensor-parallel hooks (parallelize_module) use it: place the weights with "
            "torch.distributed.tensor.distribute_tensor instead of hooks"
        )
    return (
        f"the model calls {name}, a torch.autograd.Function without setup_context (an old-style "
        "`forward(ctx, ...)`): an eager functrain step differentiates with torch.func, which needs one. "
        f"Fix: {fix}"
    )
