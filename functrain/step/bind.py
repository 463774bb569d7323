"""Running the model on a state's tensors: ``bind(params, buffers)`` gives ``call(*inputs)``; the model's
train/eval mode, autocast, and the routing of ``torch.utils.checkpoint`` to :func:`functrain.remat`.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> call = model_call(model)({"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, {})
    >>> call(torch.ones(1, 2))
    tensor([[2.]])
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from functrain.core.variables import model_variables
from functrain.remat import routed_checkpoint

__all__ = [
    "ApplyFn",
    "autocast",
    "checkpoint_routing",
    "device_of",
    "forward_params",
    "mode_setter",
    "model_call",
]

ApplyFn = Callable[..., Any]  # apply(params, buffers, *inputs) -> outputs


def _tied_aliases(model: nn.Module | ApplyFn) -> dict[str, str]:
    """``{alias: name}`` of the model's tied weights (:func:`functrain.core.variables.model_variables`' ``tied``):
    found once when a step is built, so that ``functional_call`` runs with ``tie_weights=False`` and does
    not look for them in every trace (~0.4 s of the 8.5 s dynamo trace of a 12-layer GPT's step,
    benchmarks/README.md)."""
    return dict(model_variables(model, copy=False)[2]) if isinstance(model, nn.Module) else {}


# Where each tensor of a model lives, by name: its module, the module's dict that holds it
# (``"_parameters"`` or ``"_buffers"``), and its name there.
Slots = dict[str, tuple[nn.Module, str, str]]


def _slots(model: nn.Module | ApplyFn) -> Slots | None:
    """Each parameter's and buffer's slot (every name, tied ones included), found once when a step is
    built; None for models that :func:`model_call` leaves to ``torch.func.functional_call`` (a function,
    or a module with parametrizations or with its tensors in something else than a ``dict``, whose
    names are not plain slots)."""
    if not isinstance(model, nn.Module):
        return None
    from torch.nn.utils import parametrize

    slots: Slots = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if parametrize.is_parametrized(module):
            return None
        for kind in ("_parameters", "_buffers"):
            if type(getattr(module, kind)) is not dict:  # the call writes with dict.__setitem__
                return None
            for attr in getattr(module, kind):
                slots[f"{prefix}.{attr}" if prefix else attr] = (module, kind, attr)
    return slots


def model_call(model: nn.Module | ApplyFn) -> Callable[[dict, dict], Callable[..., Any]]:
    """``bind(params, buffers)``: ``call(*inputs)``, the model run on those tensors. What that needs of
    the model (tied names, :func:`_tied_aliases`; tensor slots, :func:`_slots`) is found here, once
    when a step is built.

    With slots the tensors are put into the modules' ``_parameters``/``_buffers`` and taken out again,
    as ``torch.func.functional_call`` does, without its per-name module lookups and checks: a third of
    dynamo's trace time of the reparametrization (benchmarks/README.md). Without slots, or for a name
    that has none, ``functional_call`` does it.
    """
    if not isinstance(model, nn.Module):

        def bind_apply_fn(params: dict, buffers: dict) -> Callable[..., Any]:
            def call_apply_fn(*args: Any, **kwargs: Any) -> Any:
                return model(params, buffers, *args, **kwargs)

            return call_apply_fn

        return bind_apply_fn
    aliases, slots = _tied_aliases(model), _slots(model)
    modules, kinds, attrs_of = ({n: slot[i] for n, slot in (slots or {}).items()} for i in range(3))

    def bind(params: dict, buffers: dict) -> Callable[..., Any]:
        tensors = {**params, **buffers}
        tensors.update({alias: tensors[name] for alias, name in aliases.items() if name in tensors})

        def call_functional(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, tensors, args, kwargs, tie_weights=False, strict=False)

        if slots is None:
            return call_functional

        def call(*args: Any, **kwargs: Any) -> Any:
            if False in frozenset(map(slots.__contains__, tensors)):  # not all plain slots
                return call_functional(*args, **kwargs)
            # Builtins mapped over the names, not a loop: dynamo runs them in its own code (a loop cost it
            # ~35 instructions a tensor to trace; functrain/tree.py). Every original is read before any
            # is replaced, so a module reached by two names (shared) gets its own tensor back.
            members = list(map(getattr, map(modules.__getitem__, tensors), map(kinds.__getitem__, tensors)))
            attrs = list(map(attrs_of.__getitem__, tensors))
            originals = list(map(operator.getitem, members, attrs))
            try:
                list(map(dict.__setitem__, members, attrs, tensors.values()))
                return model(*args, **kwargs)
            finally:
                list(map(dict.__setitem__, members, attrs, originals))

        return call

    return bind


def mode_setter(model: nn.Module | ApplyFn) -> Callable[[bool, bool], None]:
    """``set_mode(training, freeze_batchnorm=False)`` for the model, built once with the step.

    ``model.train(mode)`` walks the module tree through ``children()`` and ``nn.Module.__setattr__``,
    which dynamo traces module by module (~0.5 s of a 12-layer GPT step's trace). Where no module
    overrides ``train`` or ``__setattr__``, the setter writes each module's ``training`` flag from a list
    made here; otherwise it calls ``model.train(mode)`` as before.
    """
    if not isinstance(model, nn.Module):
        return lambda training, freeze_batchnorm=False: None
    modules = tuple(model.modules())
    batchnorms = tuple(m for m in modules if isinstance(m, nn.modules.batchnorm._BatchNorm))
    # Modules with their own ``train`` or ``__setattr__`` (a scripted module keeps its flag in C++) get
    # ``model.train(mode)``.
    own_train = any(not _plain_train(m) or type(m).__setattr__ is not nn.Module.__setattr__ for m in modules)

    def set_mode(training: bool, freeze_batchnorm: bool = False) -> None:
        if own_train:
            model.train(training)
        else:
            for m in modules:
                object.__setattr__(m, "training", training)
        if training and freeze_batchnorm:
            for m in batchnorms:
                m.eval()

    return set_mode


def _plain_train(module: nn.Module) -> bool:
    """Whether ``module.train(mode)`` only sets the ``training`` flags: ``nn.Module.train``, or Hugging
    Face's ``PreTrainedModel.train`` (transformers 5.x) on a model without hub kernels (``use_kernels``).

    transformers 5.x's override reads ``self.training != mode`` first; called inside the compiled step,
    dynamo guards the flag the step found, which the other step (train after eval) left the other way:
    one recompile of each step per train/eval switch. Writing the flags instead reads none of them.
    """
    train = type(module).train
    if train is nn.Module.train:
        return True
    return (
        train.__qualname__ == "PreTrainedModel.train"
        and train.__module__.startswith("transformers.")
        and not getattr(module, "use_kernels", False)
    )


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def device_of(params: Mapping[str, torch.Tensor]) -> torch.device:
    for x in params.values():
        return x.device
    return torch.device("cpu")


def checkpoint_routing(model: nn.Module | ApplyFn) -> contextlib.AbstractContextManager[Any]:
    # torch.utils.checkpoint cannot run under torch.func.grad; route it to functrain.remat. Under
    # torch.compile the routing is done outside the traced code, by jit (dynamo must see it at trace time).
    if torch.compiler.is_dynamo_compiling():
        return contextlib.nullcontext()
    return routed_checkpoint(model)


def forward_params(state: Any) -> Any:
    """The params a forward runs on: a ZeRO-3 state's shards all-gathered (one traced collective per
    dtype; the layout is a static field of the state, its ``forward_params``), anything else as it is."""
    layout = getattr(state, "layout", None)
    return state.params if layout is None else layout.forward_params(state.params)
