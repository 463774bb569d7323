"""Pure step functions: ``train_step(state, batch) -> (state, metrics)`` and ``eval_step(state, batch)``.

A step is built from a model (or an apply function) and a *loss function* that receives a callable
running the model with the state's weights, and the batch — the same shape as Hugging Face's and Towhee's
``compute_loss(model, inputs)``::

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y), {"preds": logits, "target": y}

A loss function returns the loss (a 0-d tensor, the *mean* over the batch's examples) or ``(loss, aux)``
with ``aux`` a dict. Recognised ``aux`` entries: ``"preds"`` and ``"target"`` (fed to metrics; ``"preds"``
is what ``predict`` returns), ``"metrics"`` (a dict of extra 0-d tensors reported with the loss). The
step never syncs the host: every metric leaves it as a tensor.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 3)
    >>> tx = ft.optim.sgd(0.1)
    >>> state = ft.TrainState.create(model, tx)
    >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.CrossEntropyLoss()))
    >>> state, metrics = step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    >>> sorted(metrics)
    ['grad_norm', 'loss']
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.func import functional_call, grad_and_value

from functrain import distributed, tree
from functrain.distributed.sharded_step import ShardedStep
from functrain.distributed.strategy import DataParallel, Replicated
from functrain.masked_batch import masked_loss, trim, unmask
from functrain.member_axis import is_ensemble, metric_naming, size
from functrain.optim import all_finite, apply_gradients
from functrain.precision import autocast_dtype
from functrain.remat import routed_checkpoint
from functrain.variables import model_variables

__all__ = [
    "LossFn",
    "Step",
    "as_step",
    "make_eval_step",
    "make_predict_step",
    "make_train_step",
    "num_examples",
    "refuse_plain_state",
    "split_batch",
    "supervised_loss",
]

Batch = Any
LossFn = Callable[[Callable[..., Any], Batch], Any]
ApplyFn = Callable[..., Any]  # apply(params, buffers, *inputs) -> outputs


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """A pure step as a value: the function ``fn(state, batch)`` and what it is, said once as frozen fields.

    ``make_*_step`` and ``functrain.ensemble`` return steps; calling one runs ``fn``. :func:`functrain.jit`
    reads the fields when it runs the step (the model for its RNN rewrite, checkpoint routing and attention
    patch; ``settle`` before the first trace), and ``fit``, ``evaluate`` and ``predict`` ask them instead of
    probing the function. A changed step is a new value: ``step.replace(masked_batches=False)``.

    Attributes:
        fn: the pure function, ``fn(state, batch) -> ...``.
        kind: ``"train"``, ``"eval"``, ``"predict"``, or ``"custom"`` (a function of the user's own).
        model: the module (or apply function) the step runs.
        metrics: the metric collection whose state the step updates (``state.metrics`` for a train step).
        gradient_reducer: data parallelism's all-reduce of the gradients (``None``: one process).
        settle: what ``jit`` runs eagerly once before the first trace (a train step's forward).
        members: the step runs every member of an ensemble state at once (``functrain.ensemble``).
        sharding: how the step's state is laid out over the devices (``None``: replicated).
        masked_batches: the step takes :class:`functrain.data.MaskedBatch` inputs, so ``fit``,
            ``evaluate`` and ``predict`` pad a short last batch to the compiled batch size.

    Example:
        >>> step = ft.make_train_step(torch.nn.Linear(4, 3), ft.supervised_loss(F.cross_entropy))
        >>> step.kind, step.members
        ('train', False)
        >>> Step(lambda state, batch: (state, {})).kind
        'custom'
    """

    fn: Callable[..., Any]
    kind: Literal["train", "eval", "predict", "custom"] = "custom"
    model: Any = None
    metrics: Any = None
    gradient_reducer: Any = None
    settle: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    members: bool = False
    sharding: Any = None
    masked_batches: bool = False

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        return self.fn(state, *args, **kwargs)

    @property
    def __name__(self) -> str:  # what logs and errors call the step (its function's name)
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def replace(self, **fields: Any) -> Step:
        """This step with ``fields`` changed (a new value; this one is frozen)."""
        return dataclasses.replace(self, **fields)

    def check(self, state: Any, who: str = "fit") -> None:
        """Refuse a train step that cannot train ``state`` here: processes that would drift apart (no
        gradient all-reduce over them), or an ensemble state given a step for one model."""
        if self.kind != "train":
            return
        if distributed.is_distributed():
            reducer = self.gradient_reducer
            if reducer is None or getattr(reducer, "world_size", 0) != distributed.world_size():
                raise ValueError(
                    f"{who}: {distributed.world_size()} processes train, but the train step does not "
                    "all-reduce its gradients over them, so the ranks would drift apart; build it with "
                    "make_train_step(..., gradient_reducer=functrain.distributed.gradient_reducer(model=model)), "
                    "created after functrain.distributed.initialize()"
                )
        if is_ensemble(state) and not self.members:
            raise ValueError(
                f"{who}: the state is an ensemble of {size(state)} members, but the train step runs one "
                "model; wrap it: ft.jit(ft.ensemble.step(train_step)) (and ft.ensemble.eval_step for "
                "evaluation)"
            )

    def naming(self, state: Any) -> Any:
        """How this step's metrics on ``state`` are named in the logs
        (:class:`functrain.logging.members.MetricNaming`): the ensemble supplies its per-member naming."""
        return metric_naming(state)


def as_step(fn: Callable[..., Any]) -> Step:
    """``fn`` as a :class:`Step`: a step itself, the step a :func:`functrain.jit`-compiled step runs (its
    ``step``), or a ``"custom"`` step around a plain function.

    Example:
        >>> as_step(lambda state, batch: (state, {})).kind
        'custom'
    """
    if isinstance(fn, Step):
        return fn
    compiled = getattr(fn, "step", None)  # functrain.jit's CompiledStep (jit imports this module)
    return compiled if isinstance(compiled, Step) else Step(fn)


_INPUT_KEYS = ("input", "inputs", "x", "image", "images", "pixel_values", "features")
_TARGET_KEYS = ("target", "targets", "label", "labels", "y", "mask", "masks")


# ------------------------------------------------------------------------------------------ batches


def _inputs_and_target(batch: Batch) -> tuple[Any, Any]:
    if isinstance(batch, Mapping):
        x = next((batch[k] for k in _INPUT_KEYS if k in batch), None)
        y = next((batch[k] for k in _TARGET_KEYS if k in batch), None)
        if x is None or y is None:
            raise KeyError(
                f"supervised batch dict needs an input key (one of {_INPUT_KEYS}) and a target key (one of "
                f"{_TARGET_KEYS}); got keys {sorted(batch)}. Pass your own loss_fn(model, batch) otherwise."
            )
        return x, y
    if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"supervised batch must be (inputs, target) or a dict with input/target keys, got "
        f"{type(batch).__name__}; write a loss_fn(model, batch) for other layouts"
    )


def supervised_loss(criterion: Callable[[Any, Any], torch.Tensor]) -> LossFn:
    """A loss function for ``(inputs, target)`` batches (or dicts with ``input``/``target`` keys).

    Example:
        >>> loss_fn = supervised_loss(torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    """

    def loss_fn(model: Callable[..., Any], batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = _inputs_and_target(batch)
        preds = model(x)
        return criterion(preds, y), {"preds": preds, "target": y}

    def per_example(model: Callable[..., Any], batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
        # One loss per example (the criterion on each row as a batch of one), so that a padded batch's
        # masked rows weigh exactly zero, dropout and all (functrain.masked_batch.masked_loss).
        x, y = _inputs_and_target(batch)
        preds = model(x)
        losses = torch.vmap(lambda p, t: criterion(p.unsqueeze(0), t.unsqueeze(0)))(preds, y)
        return losses, {"preds": preds, "target": y}

    loss_fn.criterion = criterion  # type: ignore[attr-defined]
    loss_fn.per_example = per_example  # type: ignore[attr-defined]
    return loss_fn


def num_examples(batch: Batch) -> int:
    """The batch's leading dimension (read from shapes: static under ``torch.compile``)."""
    for x in tree.leaves(batch):
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            return int(x.shape[0])
    raise ValueError("cannot count the examples of a batch without any tensor of rank >= 1")


def split_batch(batch: Batch, k: int) -> list[Batch]:
    """Split every tensor of ``batch`` into ``k`` micro-batches along dim 0 (sizes may differ by one)."""
    n = num_examples(batch)
    if k > n:
        raise ValueError(f"cannot accumulate over {k} micro-batches: the batch has only {n} examples")

    def chunk(i: int) -> Batch:
        return tree.map(
            lambda x: x.tensor_split(k)[i] if isinstance(x, torch.Tensor) and x.ndim > 0 else x, batch
        )

    return [chunk(i) for i in range(k)]


def _split_loss_output(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, aux = out
    elif isinstance(out, torch.Tensor):
        loss, aux = out, {}
    else:
        raise TypeError(
            f"the loss function must return a 0-d tensor or (loss, aux_dict); got {type(out).__name__}"
        )
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"the loss must be a 0-d tensor (the mean over the batch), got shape {shape}; reduce it with "
            ".mean() (or reduction='mean' in a torch.nn loss)"
        )
    if not loss.is_floating_point():
        raise TypeError(f"the loss must be a floating-point tensor, got {loss.dtype}")
    return loss, dict(aux)


# ------------------------------------------------------------------------------------------ models


def _expected_names(model: nn.Module | None) -> frozenset[str] | None:
    if model is None:
        return None
    names = {n for n, _ in model.named_parameters()} | {n for n, b in model.named_buffers() if b is not None}
    return frozenset(names)


def refuse_plain_state(state: Any, who: str = "the step") -> None:
    """Refuse a plain dict given as the state (what ``checkpoint.restore(path)`` gives without a target),
    in one line that says how to get a state back, before anything traces it.

    Example:
        >>> try:
        ...     refuse_plain_state({"params": {}}, "train_step")
        ... except TypeError as error:
        ...     print(str(error)[:42])
        train_step: the state is a plain dict (key
    """
    if type(state) is not dict:
        return
    if {"state", "loop"} <= set(state):
        how = "ft.checkpoint.restore_onto(state, ft.checkpoint.restore(path)['state'])"
        holds = "a fit checkpoint's {'state', 'loop'}"
    else:
        how = "ft.checkpoint.restore(path, target=state)"
        holds = f"keys {sorted(map(str, state))[:8]}"
    raise TypeError(
        f"{who}: the state is a plain dict ({holds}), which is what ft.checkpoint.restore(path) gives "
        f"without a target; restore onto a state built as before saving: state = {how}, with "
        "state = ft.TrainState.create(model, tx)"
    )


def _check_state_matches(state: Any, expected: frozenset[str] | None) -> None:
    refuse_plain_state(state)
    if expected is None:
        return
    have = set(state.params) | set(state.buffers)
    if have != expected:
        missing = sorted(expected - have)[:8]
        unexpected = sorted(have - expected)[:8]
        raise ValueError(
            "the state does not belong to this model: "
            f"missing {missing}, unexpected {unexpected}. Create the state with "
            "TrainState.create(model, tx) from the same model the step was built with."
        )


def _tied_aliases(model: nn.Module | ApplyFn) -> dict[str, str]:
    """``{alias: name}`` of the model's tied weights (:func:`functrain.variables.model_variables`' ``tied``):
    found once when a step is built, so that ``functional_call`` runs with ``tie_weights=False`` and does
    not look for them in every trace (~0.4 s of the 8.5 s dynamo trace of a 12-layer GPT's step,
    benchmarks/README.md)."""
    return dict(model_variables(model, copy=False)[2]) if isinstance(model, nn.Module) else {}


# Where each tensor of a model lives: its module, its name there, and whether it is a parameter.
Slots = dict[str, tuple[nn.Module, str, bool]]


def _slots(model: nn.Module | ApplyFn) -> Slots | None:
    """Each parameter's and buffer's slot (every name, tied ones included), found once when a step is
    built; None for models that :func:`_model_call` leaves to ``torch.func.functional_call`` (a function,
    or a module with parametrizations, whose names are not plain slots)."""
    if not isinstance(model, nn.Module):
        return None
    from torch.nn.utils import parametrize

    slots: Slots = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if parametrize.is_parametrized(module):
            return None
        for kind, members in ((True, module._parameters), (False, module._buffers)):
            for attr in members:
                slots[f"{prefix}.{attr}" if prefix else attr] = (module, attr, kind)
    return slots


def _model_call(model: nn.Module | ApplyFn) -> Callable[[dict, dict], Callable[..., Any]]:
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

    def bind(params: dict, buffers: dict) -> Callable[..., Any]:
        tensors = {**params, **buffers}
        tensors.update({alias: tensors[name] for alias, name in aliases.items() if name in tensors})

        def call_functional(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, tensors, args, kwargs, tie_weights=False, strict=False)

        if slots is None:
            return call_functional

        def call(*args: Any, **kwargs: Any) -> Any:
            swapped = []
            try:
                for name, tensor in tensors.items():
                    slot = slots.get(name)
                    if slot is None:  # not a plain slot: functional_call below
                        break
                    module, attr, is_param = slot
                    members = module._parameters if is_param else module._buffers
                    swapped.append((members, attr, members[attr]))
                    members[attr] = tensor
                else:
                    return model(*args, **kwargs)
            finally:
                for members, attr, original in reversed(swapped):
                    members[attr] = original
            return call_functional(*args, **kwargs)

        return call

    return bind


def _mode_setter(model: nn.Module | ApplyFn) -> Callable[[bool, bool], None]:
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
    own_train = any(
        type(m).train is not nn.Module.train or type(m).__setattr__ is not nn.Module.__setattr__
        for m in modules
    )

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


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _device_of(params: Mapping[str, torch.Tensor]) -> torch.device:
    for x in params.values():
        return x.device
    return torch.device("cpu")


def _checkpoint_routing(model: nn.Module | ApplyFn) -> contextlib.AbstractContextManager[Any]:
    # torch.utils.checkpoint cannot run under torch.func.grad; route it to functrain.remat. Under
    # torch.compile the routing is done outside the traced code, by jit (dynamo must see it at trace time).
    if torch.compiler.is_dynamo_compiling():
        return contextlib.nullcontext()
    return routed_checkpoint(model)


# ------------------------------------------------------------------------------------------ train


def make_train_step(
    model: nn.Module | ApplyFn,
    loss_fn: LossFn,
    *,
    accumulate: int = 1,
    precision: str | None = None,
    metrics: Any = None,
    freeze_batchnorm: bool = False,
    gradient_reducer: Callable[..., Any] | None = None,
    sharding: Any = None,
    strategy: Replicated | None = None,
) -> Step:
    """Build a pure ``train_step(state, batch) -> (new_state, metrics)`` (a :class:`Step`).

    One call runs forward, backward and the optimizer update (``state.tx``); compiled with
    :func:`functrain.jit` it is a single graph.

    Args:
        model: an ``nn.Module`` (run with ``torch.func.functional_call`` on the state's params and
            buffers) or an apply function ``apply(params, buffers, *inputs) -> outputs``.
        loss_fn: ``loss_fn(model_call, batch) -> loss | (loss, aux)`` (see the module docstring).
        accumulate: split each batch into this many micro-batches along dim 0 and sum their gradients,
            each weighted by its share of the examples, before one optimizer update: the gradient equals
            the whole batch's, with the activation memory of one micro-batch at a time.
        precision: ``None``/``"no"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast and dynamic loss
            scaling; the state needs ``loss_scale=LossScale.create()``).
        metrics: a metric collection (``functrain.metrics``); its state lives in ``state.metrics`` and is
            updated inside the step from the loss function's ``preds``/``target``.
        freeze_batchnorm: keep BatchNorm layers in eval mode while training (statistics frozen).
        gradient_reducer: data parallelism (``functrain.distributed.gradient_reducer()``): called as
            ``reducer(state, grads, loss, metrics, buffers, num_examples)`` after the backward (the
            reduction protocol of every parallel strategy, :mod:`functrain.distributed.strategy`) and
            returns them combined over all ranks (example-weighted), inside the same compiled graph.
        sharding: ``functrain.distributed.fully_shard(...)`` (ZeRO-1/2/3), the same request the state
            was created with: gradients are reduce-scattered, the optimizer updates this rank's rows,
            all norms are global (``functrain.distributed.sharded_step``). Replaces ``gradient_reducer``.
        strategy: a parallel strategy of one's own (:mod:`functrain.distributed.strategy`), instead of
            the one ``gradient_reducer`` / ``sharding`` make.

    A padded batch (a :class:`~functrain.data.MaskedBatch`, ``Loader(..., pad_last=True)``) keeps the
    compiled shape for a short last batch: its masked rows weigh zero in the loss, the gradient, the
    metrics and the data-parallel example weighting (:func:`functrain.masked_batch.masked_loss` says
    when that is exact: per-example losses always; other losses without dropout or BatchNorm).

    Returns:
        ``train_step``; ``metrics`` holds ``loss`` (example-weighted over micro-batches),
        ``grad_norm`` (before clipping), the loss function's extra metrics and, with fp16,
        ``loss_scale``.
        ``train_step(state, batch, *, donated=False)``: ``donated=True`` (what ``jit(..., donate=True)``
        passes) lets the optimizer write into the incoming state's tensors.

    Example:
        >>> step = make_train_step(model, supervised_loss(torch.nn.functional.cross_entropy), accumulate=2)
    """
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
    if strategy is not None and (sharding is not None or gradient_reducer is not None):
        raise ValueError("make_train_step: pass strategy=, or sharding= / gradient_reducer=, not both")
    cast = autocast_dtype(precision)
    bind = _model_call(model)
    parts = _TrainParts(
        loss_fn=loss_fn,
        accumulate=accumulate,
        cast=cast,
        metrics=metrics,
        freeze_batchnorm=freeze_batchnorm,
        strategy=strategy or _strategy(model, sharding, gradient_reducer, cast),
        expected=_expected_names(model if isinstance(model, nn.Module) else None),
        batch_statistics=not freeze_batchnorm and _has_batchnorm(model),
        routing=model,
        bind=bind,
        set_mode=_mode_setter(model),
        grad_fn=_loss_and_grad(loss_fn, bind, cast),
    )
    strategy = parts.strategy

    def settle(state: Any, batch: Batch) -> None:
        _settle(parts, state, batch)

    def train_step(state: Any, batch: Batch, *, donated: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
        return _train_step(parts, state, batch, donated)

    return Step(
        train_step,
        kind="train",
        model=model,
        metrics=metrics,
        # a sharded step reduces over its ranks too (what fit checks before it trains on several processes)
        gradient_reducer=strategy.reducer,
        settle=settle if isinstance(model, nn.Module) else None,
        sharding=sharding,
        masked_batches=True,
    )


def _loss_over_real_rows(
    loss_fn: LossFn,
    call: Callable[..., Any],
    batch: Batch,
    mask: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    first: Batch = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``loss_fn``'s ``(loss, aux)``; given a ``mask`` (``mask, count, first``: :func:`_masking`), over
    the real rows of a padded batch only (:func:`functrain.masked_batch.masked_loss`)."""
    per_example = getattr(loss_fn, "per_example", None)
    return masked_loss(
        lambda b: _split_loss_output(loss_fn(call, b)),
        batch,
        mask,
        per_example=None if per_example is None else lambda b: per_example(call, b),
        count=count,
        first=first,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _TrainParts:
    """What a train step is built from, fixed when it is made (:func:`make_train_step`'s arguments,
    resolved): the stages below read it."""

    loss_fn: LossFn
    accumulate: int
    cast: torch.dtype | None
    metrics: Any
    freeze_batchnorm: bool
    strategy: Replicated
    expected: frozenset[str] | None
    batch_statistics: bool  # the model has BatchNorm layers in training mode
    routing: Any  # the model whose torch.utils.checkpoint calls are routed to functrain.remat
    bind: Callable[[dict, dict], Callable[..., Any]]
    set_mode: Callable[[bool, bool], None]
    grad_fn: Callable[..., Any]


def _has_batchnorm(model: nn.Module | ApplyFn) -> bool:
    modules = model.modules() if isinstance(model, nn.Module) else ()
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)


def _loss_and_grad(loss_fn: LossFn, bind: Callable[..., Any], cast: torch.dtype | None) -> Callable[..., Any]:
    """``grad_fn(params, buffers, batch, factor, *masking) -> (grads, (loss * factor, (loss, aux,
    buffers)))``: the micro-batch's loss and its gradient w.r.t. ``params``."""

    def loss_of(params: dict, buffers: dict, batch: Batch, factor: Any, *masking: Any) -> Any:
        # Buffers are inputs of the differentiated function and cloned, so modules that update them in
        # place (BatchNorm) write into the clones, which leave as auxiliary output.
        buffers = {k: v.clone() for k, v in buffers.items()}
        with _autocast(_device_of(params), cast):
            loss, aux = _loss_over_real_rows(loss_fn, bind(params, buffers), batch, *masking)
        loss = loss.float()
        return loss * factor if factor is not None else loss, (loss.detach(), aux, buffers)

    return grad_and_value(loss_of, argnums=0, has_aux=True)


def _settle(parts: _TrainParts, state: Any, batch: Batch) -> None:
    """The loss function's forward, once, eagerly and without gradients: a model that settles its own
    Python attributes in its first forward (Hugging Face's ``config.problem_type``) does it here,
    before the first trace, so the compiled step guards the settled value (:func:`functrain.jit`)."""
    parts.set_mode(True, parts.freeze_batchnorm)
    batch, _ = unmask(batch)
    first = split_batch(batch, parts.accumulate)[0] if parts.accumulate > 1 else batch
    buffers = {k: v.clone() for k, v in state.buffers.items()}  # BatchNorm writes into the clones
    params = parts.strategy.params_whole(state)  # ZeRO-3: gathered
    with torch.no_grad(), _autocast(_device_of(params), parts.cast), _checkpoint_routing(parts.routing):
        parts.loss_fn(parts.bind(params, buffers), first)


def _train_step(
    parts: _TrainParts, state: Any, batch: Batch, donated: bool
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The train step: micro-batches' losses and gradients, their reduction over the processes, the
    update, the non-finite guard, the metrics."""
    _check_train_state(state, parts.expected, parts.cast)
    parts.set_mode(True, parts.freeze_batchnorm)
    batch, mask = unmask(batch)  # a padded batch (functrain.data.padding): its real rows count
    _refuse_padded_batch_statistics(mask, parts.batch_statistics)
    strategy = parts.strategy
    # each rank's gradient is weighted by its examples (an op on a padded batch's mask: only if read)
    examples = _real_examples(batch, mask) if strategy.counts_examples else None
    acc = _Accumulated(strategy.params_for_grad(state), state.buffers, _device_of(state.params))
    with _checkpoint_routing(parts.routing), strategy.gathering():  # ZeRO-3 blocks gather inside
        for mb, share, masking in _micro_batches(batch, mask, parts.accumulate):
            _micro_step(parts, state, acc, mb, share, examples, masking)
    grads, loss, extra, buffers = strategy.reduce(
        state, acc.grads, acc.loss, acc.extra, acc.buffers, examples
    )
    grads, loss_scale, finite = _unscale(grads, state.loss_scale)
    # A donated state (jit(..., donate=True)) is overwritten anyway: unless an overflow may need the
    # old values, the optimizer may write into its tensors (Adam's fused kernel does).
    params, opt_state, grad_norm = _update(state, grads, strategy, in_place=donated and finite is None)
    if finite is not None:  # an overflow skips the whole update
        params, opt_state = tree.keep_where(finite, (params, opt_state), (state.params, state.opt_state))
    metric_state = state.metrics
    if parts.metrics is not None and metric_state is not None:
        inputs = _metric_inputs(acc.preds, acc.targets, loss, batch, mask)
        metric_state = parts.metrics.update(metric_state, **inputs)
    out = {"loss": loss, "grad_norm": grad_norm, **extra}
    if loss_scale is not None:
        out["loss_scale"] = loss_scale.scale
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        loss_scale=loss_scale,
        metrics=metric_state,
    )
    return new_state, out


def _micro_step(
    parts: _TrainParts, state: Any, acc: _Accumulated, mb: Batch, share: float, examples: Any, masking: tuple
) -> None:
    """One micro-batch's loss and gradient, weighted by its ``share`` of the step, added to ``acc``."""
    factor = parts.strategy.loss_factor(share, examples)  # ZeRO-3 blocks: weighted before the backward
    loss_scale = state.loss_scale.scale if state.loss_scale is not None else None
    g, (_, (loss, aux, acc.buffers)) = parts.grad_fn(
        acc.params, acc.buffers, mb, loss_scale if factor is None else factor, *masking
    )
    if share != 1.0 and factor is None:
        g = tree.map(lambda x: x * share, g)
    acc.add(parts.strategy.micro_grads(state, g, examples), loss, aux, share)


def _strategy(model: nn.Module | ApplyFn, sharding: Any, gradient_reducer: Any, cast: Any) -> Replicated:
    """The parallel strategy the step runs on: ZeRO (``sharding``), data parallelism
    (``gradient_reducer``) or one process."""
    if sharding is not None:
        module = model if isinstance(model, nn.Module) else None
        return ShardedStep(sharding, model=module, gradient_reducer=gradient_reducer, precision_dtype=cast)
    return Replicated() if gradient_reducer is None else DataParallel(gradient_reducer)


def _check_train_state(state: Any, expected: frozenset[str] | None, cast: torch.dtype | None) -> None:
    _check_state_matches(state, expected)
    if cast == torch.float16 and state.loss_scale is None:
        raise ValueError(
            "precision='fp16' needs a loss scale in the state: "
            "TrainState.create(model, tx, loss_scale=functrain.precision.LossScale.create())"
        )


def _refuse_padded_batch_statistics(mask: torch.Tensor | None, batch_statistics: bool) -> None:
    if mask is not None and batch_statistics:
        raise ValueError(
            "a padded training batch (Loader(pad_last=True) / pad_train_batches) and a model with "
            "BatchNorm in training mode: the padded rows would enter the batch statistics. Use "
            "drop_last=True, or freeze_batchnorm=True"
        )


def _micro_batches(batch: Batch, mask: torch.Tensor | None, parts: int) -> list[tuple[Batch, float, tuple]]:
    """``(micro_batch, share, masking)`` for each of ``parts`` micro-batches: ``share`` is how much it
    counts in the step (its fraction of the examples; 1.0 for a whole batch, or for a padded one, whose
    masked loss is already over the whole batch's real examples), ``masking`` its :func:`_masking`."""
    if parts == 1:
        return [(batch, 1.0, _masking(batch, mask, 1)[0])]
    micro = split_batch(batch, parts)
    total = sum(num_examples(b) for b in micro)
    shares = [1.0 if mask is not None else num_examples(b) / total for b in micro]
    return list(zip(micro, shares, _masking(batch, mask, parts)))


class _Accumulated:
    """The sums over a step's micro-batches, each weighted by its share: gradients, loss and extra
    metrics; the buffers as the last micro-batch left them; the loss function's preds and targets."""

    def __init__(self, params: Any, buffers: dict, device: torch.device) -> None:
        self.params, self.buffers = params, buffers
        self.grads: Any = None
        self.loss = torch.zeros((), device=device)
        self.extra: dict[str, torch.Tensor] = {}
        self.preds: list[Any] = []
        self.targets: list[Any] = []

    def add(self, grads: Any, loss: torch.Tensor, aux: dict[str, Any], share: float) -> None:
        self.grads = grads if self.grads is None else tree.map(torch.add, self.grads, grads)
        self.loss = self.loss + loss * share
        for name, value in dict(aux.get("metrics", {})).items():
            self.extra[name] = self.extra.get(name, 0) + value.detach().float() * share
        if "preds" in aux:
            self.preds.append(aux["preds"])
        if "target" in aux:
            self.targets.append(aux["target"])


def _unscale(grads: Any, loss_scale: Any) -> tuple[Any, Any, torch.Tensor | None]:
    """fp16's loss scaling undone: the true gradients, the next loss scale, and whether the gradients are
    finite (``None`` without loss scaling)."""
    if loss_scale is None:
        return grads, None, None
    scale = loss_scale.scale
    grads = tree.map(lambda x: x / scale, grads)
    finite = all_finite(grads)
    return grads, loss_scale.adjust(finite), finite


def _update(state: Any, grads: Any, strategy: Replicated, *, in_place: bool) -> tuple[Any, Any, torch.Tensor]:
    """The optimizer step on this process's rows, with the strategy's norms: new params (as the state
    keeps them), new optimizer state, and the gradients' global norm before clipping."""
    params, opt_state = apply_gradients(
        state.tx, grads, state.opt_state, strategy.opt_params(state), norm=strategy.norm, in_place=in_place
    )
    grad_norm = tree.global_norm(grads, strategy.norm)
    return strategy.params_at_rest(state, params), opt_state, grad_norm


def _masking(batch: Batch, mask: torch.Tensor | None, parts: int) -> list[tuple[Any, ...]]:
    """Per micro-batch ``(mask, count, first)`` of a padded batch (its mask's slice, the whole batch's
    real examples, its row 0), or ``()`` each for a batch without a mask."""
    if mask is None:
        return [()] * parts
    count, first = mask.sum().clamp(min=1).float(), trim(batch, 1, int(mask.shape[0]))
    masks = mask.tensor_split(parts) if parts > 1 else (mask,)
    return [(m, count, first) for m in masks]


def _real_examples(batch: Batch, mask: torch.Tensor | None) -> Any:
    """The examples of a batch: its leading size (an int), or the true rows of a padded batch's mask."""
    return num_examples(batch) if mask is None else mask.sum()


def _metric_inputs(
    preds: list, targets: list, loss: torch.Tensor, batch: Batch, mask: torch.Tensor | None = None
) -> dict[str, Any]:
    inputs: dict[str, Any] = {"loss": loss, "num_examples": _real_examples(batch, mask), "mask": mask}
    if preds:
        inputs["preds"] = preds[0] if len(preds) == 1 else torch.cat(preds)
    if targets:
        inputs["target"] = targets[0] if len(targets) == 1 else torch.cat(targets)
    return inputs


# ------------------------------------------------------------------------------------------ eval


def _forward_params(state: Any) -> Any:
    """The params a forward runs on: a ZeRO-3 state's shards all-gathered (one traced collective per
    dtype; the layout is a static field of the state), anything else as it is."""
    layout = getattr(state, "layout", None)
    if layout is not None and layout.request.shards_params:
        return layout.gather(state.params, layout.request.param_dtype)
    return state.params


def make_eval_step(
    model: nn.Module | ApplyFn,
    loss_fn: LossFn,
    *,
    metrics: Any = None,
    precision: str | None = None,
    return_preds: bool = False,
) -> Step:
    """Build a pure ``eval_step(state, batch) -> dict`` (a :class:`Step`) with eval-mode semantics (no dropout, BatchNorm
    uses its running statistics and does not update them, no gradients).

    The result holds ``loss`` (0-d), ``num_examples`` (int), ``metrics`` (the collection's state for this
    batch, to be merged across batches; ``None`` without a collection) and, with ``return_preds``,
    ``preds``. For a padded batch (:class:`~functrain.data.MaskedBatch`, which :func:`functrain.evaluate`
    makes of a short last batch so that the step compiles once) they are the real rows': the loss is
    their mean, ``num_examples`` their count (a 0-d tensor) and the metrics get the ``mask``.

    Example:
        >>> eval_step = make_eval_step(model, supervised_loss(torch.nn.functional.cross_entropy))
        >>> out = eval_step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
        >>> out["loss"].shape
        torch.Size([])
    """
    cast = autocast_dtype(precision)
    expected = _expected_names(model if isinstance(model, nn.Module) else None)
    bind, set_mode = _model_call(model), _mode_setter(model)

    def eval_step(state: Any, batch: Batch) -> dict[str, Any]:
        _check_state_matches(state, expected)
        set_mode(False)
        batch, mask = unmask(batch)  # a padded batch (functrain.data.padding): its real rows count
        params = _forward_params(state)
        with torch.no_grad(), _autocast(_device_of(params), cast):
            call = bind(params, state.buffers)
            loss, aux = _loss_over_real_rows(loss_fn, call, batch, *_masking(batch, mask, 1)[0])
        loss = loss.float()
        preds = [aux["preds"]] if "preds" in aux else []
        targets = [aux["target"]] if "target" in aux else []
        out: dict[str, Any] = {"loss": loss, "num_examples": _real_examples(batch, mask), "metrics": None}
        out.update({k: v.float() for k, v in dict(aux.get("metrics", {})).items()})
        if metrics is not None:
            empty = metrics.empty(_device_of(state.params))
            out["metrics"] = metrics.update(empty, **_metric_inputs(preds, targets, loss, batch, mask))
        if return_preds:
            out["preds"] = aux.get("preds")
        return out

    return Step(eval_step, kind="eval", model=model, metrics=metrics, masked_batches=True)


def make_predict_step(
    model: nn.Module | ApplyFn,
    forward: Callable[[Callable[..., Any], Batch], Any] | None = None,
    *,
    precision: str | None = None,
) -> Step:
    """Build ``predict_step(state, batch) -> outputs`` (a :class:`Step`) in eval mode.

    ``forward(model_call, batch)`` defaults to calling the model on the batch's inputs (the first element
    of a tuple, the ``input`` entry of a dict, or the batch itself). A padded batch
    (:class:`~functrain.data.MaskedBatch`) runs whole; :func:`functrain.predict` cuts the padded rows off.

    Example:
        >>> predict_step = make_predict_step(model)
        >>> predict_step(state, torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """
    cast = autocast_dtype(precision)

    def default_forward(call: Callable[..., Any], batch: Batch) -> Any:
        if isinstance(batch, torch.Tensor):
            return call(batch)
        if isinstance(batch, Mapping):
            for k in _INPUT_KEYS:
                if k in batch:
                    return call(batch[k])
            return call(**batch)
        if isinstance(batch, Sequence):
            return call(batch[0])
        raise TypeError(f"predict: cannot find the inputs in a {type(batch).__name__}; pass forward=...")

    fwd = forward or default_forward
    bind, set_mode = _model_call(model), _mode_setter(model)

    def predict_step(state: Any, batch: Batch) -> Any:
        set_mode(False)
        batch, _ = unmask(batch)  # a padded batch: the loop cuts the padded rows off the outputs
        params = _forward_params(state)
        with torch.no_grad(), _autocast(_device_of(params), cast):
            return fwd(bind(params, state.buffers), batch)

    return Step(predict_step, kind="predict", model=model, masked_batches=True)
