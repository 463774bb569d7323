"""The train step, as short stages: parameters for the step, the loss and gradient over micro-batches,
the gradient reduction (the parallel strategy, :mod:`functrain.distributed.strategy`), the update, the
non-finite guard, the metrics.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 3)
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> step = make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
    >>> state, metrics = step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    >>> sorted(metrics)
    ['grad_norm', 'loss']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from functrain import tree
from functrain.core.masked_batch import unmask
from functrain.distributed.data_ranks import whole_tensors
from functrain.distributed.sharded_step import ShardedStep
from functrain.distributed.strategy import DataParallel, Replicated
from functrain.optim import all_finite, apply_gradients
from functrain.precision import autocast_dtype
from functrain.step.base import Step, check_state_matches, expected_names
from functrain.step.batch import (
    Batch,
    LossFn,
    loss_over_real_rows,
    mask_parts,
    metric_inputs,
    num_examples,
    real_examples,
    split_batch,
)
from functrain.step.bind import ApplyFn, autocast, checkpoint_routing, device_of, mode_setter, model_call
from functrain.step.grad import loss_and_grad
from functrain.step.per_example import check_per_example, per_example_chunk, per_example_loss_and_grad
from functrain.step.sam import check_sam_rho, sam_loss_and_grad

__all__ = ["make_train_step"]


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
    per_example: bool | int = False,
    sam_rho: float | None = None,
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
        per_example: the gradient stage gives the optimizer every example's gradient (each leaf
            ``(B, *param.shape)``), for a transformation that aggregates them (``ft.optim.dpsgd``);
            ``per_example=N`` computes ``N`` examples at a time (:mod:`functrain.step.per_example`).
        sam_rho: sharpness-aware minimization: the optimizer applies the gradient taken at
            ``params + sam_rho * g / ||g||`` (:mod:`functrain.step.sam`).

    A padded batch (a :class:`~functrain.data.MaskedBatch`, ``Loader(..., pad_last=True)``) keeps the
    compiled shape for a short last batch: its masked rows weigh zero in the loss, the gradient, the
    metrics and the data-parallel example weighting (:func:`functrain.core.masked_batch.masked_loss` says
    when that is exact: per-example losses always; other losses without dropout or BatchNorm).

    Returns:
        ``train_step``; ``metrics`` holds ``loss`` (example-weighted over micro-batches),
        ``grad_norm`` (before clipping), the loss function's extra metrics and, with fp16,
        ``loss_scale``.
        ``train_step(state, batch, *, donated=False)``: ``donated=True`` (what ``jit(..., donate=True)``
        passes) lets the optimizer write into the incoming state's tensors.

    Example:
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
        >>> new_state, metrics = make_train_step(model, loss_fn, accumulate=2)(state, batch)
        >>> int(new_state.step), sorted(metrics)
        (1, ['grad_norm', 'loss'])
        >>> whole, _ = make_train_step(model, loss_fn)(state, batch)  # two micro-batches: the same update
        >>> torch.allclose(new_state.params["weight"], whole.params["weight"])
        True
    """
    _check_arguments(accumulate, strategy, sharding, gradient_reducer)
    cast = autocast_dtype(precision)
    bind = model_call(model)
    strategy = strategy or _strategy(model, sharding, gradient_reducer, cast)
    parts = _train_parts(
        model,
        loss_fn,
        bind,
        cast,
        strategy,
        accumulate=accumulate,
        metrics=metrics,
        freeze_batchnorm=freeze_batchnorm,
        per_example=per_example,
        sam_rho=sam_rho,
    )
    return _as_step(parts, model, sharding)


def _check_arguments(accumulate: Any, strategy: Any, sharding: Any, gradient_reducer: Any) -> None:
    """Refuse :func:`make_train_step` arguments that cannot go together, before anything is built."""
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
    if strategy is not None and (sharding is not None or gradient_reducer is not None):
        raise ValueError("make_train_step: pass strategy=, or sharding= / gradient_reducer=, not both")


def _train_parts(
    model: nn.Module | ApplyFn,
    loss_fn: LossFn,
    bind: Callable[[dict, dict], Callable[..., Any]],
    cast: torch.dtype | None,
    strategy: Replicated,
    *,
    accumulate: int,
    metrics: Any,
    freeze_batchnorm: bool,
    per_example: bool | int,
    sam_rho: float | None,
) -> _TrainParts:
    """What the step's stages read, resolved from :func:`make_train_step`'s arguments (and checked: a
    per-example gradient and SAM refuse what they cannot run with)."""
    if per_example:
        check_per_example(
            model, accumulate=accumulate, freeze_batchnorm=freeze_batchnorm, parallel=_parallel(strategy)
        )
    return _TrainParts(
        loss_fn=loss_fn,
        accumulate=accumulate,
        cast=cast,
        metrics=metrics,
        freeze_batchnorm=freeze_batchnorm,
        strategy=strategy,
        expected=expected_names(model if isinstance(model, nn.Module) else None),
        batch_statistics=not freeze_batchnorm and _has_batchnorm(model),
        routing=model,
        bind=bind,
        set_mode=mode_setter(model),
        grad_fn=_gradient_stage(loss_fn, bind, cast, strategy, per_example, sam_rho),
        per_example=bool(per_example),
    )


def _as_step(parts: _TrainParts, model: nn.Module | ApplyFn, sharding: Any) -> Step:
    """The train step as a :class:`Step`: its function over ``parts`` and the fields ``jit`` and ``fit``
    read."""

    def settle(state: Any, batch: Batch) -> None:
        _settle(parts, state, batch)

    def train_step(state: Any, batch: Batch, *, donated: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
        return _train_step(parts, state, batch, donated)

    return Step(
        train_step,
        kind="train",
        model=model,
        metrics=parts.metrics,
        # a sharded step reduces over its ranks too (what fit checks before it trains on several processes)
        gradient_reducer=parts.strategy.reducer,
        settle=settle if isinstance(model, nn.Module) else None,
        sharding=sharding,
        masked_batches=True,
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
    per_example: bool  # grads have a leading batch axis (functrain.step.per_example)


def _gradient_stage(
    loss_fn: LossFn,
    bind: Callable[..., Any],
    cast: torch.dtype | None,
    strategy: Replicated,
    per_example: bool | int,
    sam_rho: float | None,
) -> Callable[..., Any]:
    """The micro-batch's gradient function: the batch's (:func:`_loss_and_grad`) or every example's
    (:mod:`functrain.step.per_example`), taken at SAM's perturbed params with ``sam_rho``."""
    sam_rho = check_sam_rho(sam_rho)
    if per_example:
        grad_fn = per_example_loss_and_grad(loss_fn, bind, cast, per_example_chunk(per_example))
    else:
        grad_fn = _loss_and_grad(loss_fn, bind, cast)
    if sam_rho is None:
        return grad_fn
    if per_example:
        raise ValueError(
            "make_train_step: sam_rho with per_example: SAM perturbs the params by the whole batch's "
            "gradient, so no example's gradient would be its own (nor private); use one of them"
        )
    if isinstance(strategy, ShardedStep):
        raise ValueError(
            "make_train_step: sam_rho with sharding= (ZeRO): the perturbation would need the global "
            "gradient norm of sharded rows; use SAM with data parallelism (gradient_reducer=) or one process"
        )
    return sam_loss_and_grad(grad_fn, sam_rho)


def _has_batchnorm(model: nn.Module | ApplyFn) -> bool:
    modules = model.modules() if isinstance(model, nn.Module) else ()
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)


def _loss_and_grad(loss_fn: LossFn, bind: Callable[..., Any], cast: torch.dtype | None) -> Callable[..., Any]:
    """``grad_fn(params, buffers, batch, factor, *masking) -> (grads, (loss * factor, (loss, aux,
    buffers)))``: the micro-batch's loss and its gradient w.r.t. ``params``
    (:func:`functrain.step.grad.loss_and_grad`: plain autograd on the eager tier)."""

    def loss_of(params: dict, buffers: dict, batch: Batch, factor: Any, *masking: Any) -> Any:
        # Buffers are inputs of the differentiated function and cloned, so modules that update them in
        # place (BatchNorm) write into the clones, which leave as auxiliary output.
        buffers = {k: v.clone() for k, v in buffers.items()}
        with autocast(device_of(params), cast):
            loss, aux = loss_over_real_rows(loss_fn, bind(params, buffers), batch, *masking)
        loss = loss.float()
        return loss * factor if factor is not None else loss, (loss.detach(), aux, buffers)

    return loss_and_grad(loss_of)


def _settle(parts: _TrainParts, state: Any, batch: Batch) -> None:
    """The loss function's forward, once, eagerly and without gradients: a model that settles its own
    Python attributes in its first forward (Hugging Face's ``config.problem_type``) does it here,
    before the first trace, so the compiled step guards the settled value (:func:`functrain.jit`)."""
    parts.set_mode(True, parts.freeze_batchnorm)
    batch, _ = unmask(batch)
    first = split_batch(batch, parts.accumulate)[0] if parts.accumulate > 1 else batch
    buffers = {k: v.clone() for k, v in state.buffers.items()}  # BatchNorm writes into the clones
    params = parts.strategy.params_whole(state)  # ZeRO-3: gathered
    with torch.no_grad(), autocast(device_of(params), parts.cast), checkpoint_routing(parts.routing):
        loss_over_real_rows(parts.loss_fn, parts.bind(params, buffers), first)  # the loss checked too


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
    examples = real_examples(batch, mask) if strategy.counts_examples else None
    acc = _Accumulated(strategy.params_for_grad(state), state.buffers, device_of(state.params))
    with checkpoint_routing(parts.routing), strategy.gathering():  # ZeRO-3 blocks gather inside
        for mb, share, masking in _micro_batches(batch, mask, parts.accumulate):
            _micro_step(parts, state, acc, mb, share, examples, masking)
    grads, loss, extra, buffers = strategy.reduce(
        state, acc.grads, acc.loss, acc.extra, acc.buffers, examples
    )
    grads, loss_scale, finite = _unscale(grads, state.loss_scale)
    # A donated state (jit(..., donate=True)) is overwritten anyway: unless an overflow may need the
    # old values, the optimizer may write into its tensors (Adam's fused kernel does).
    params, opt_state, grad_norm = _update(
        state, grads, strategy, in_place=donated and finite is None, per_example=parts.per_example
    )
    if finite is not None:  # an overflow skips the whole update
        params, opt_state = tree.keep_where(finite, (params, opt_state), (state.params, state.opt_state))
    metric_state = state.metrics
    if parts.metrics is not None and metric_state is not None:
        # a tensor-parallel step's logits and loss are replicated DTensors: the metric state stays plain
        inputs = whole_tensors(metric_inputs(acc.preds, acc.targets, loss, batch, mask))
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
    check_state_matches(state, expected)
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
    masked loss is already over the whole batch's real examples), ``masking`` its :func:`mask_parts`."""
    if parts == 1:
        return [(batch, 1.0, mask_parts(batch, mask, 1)[0])]
    micro = split_batch(batch, parts)
    total = sum(num_examples(b) for b in micro)
    shares = [1.0 if mask is not None else num_examples(b) / total for b in micro]
    return list(zip(micro, shares, mask_parts(batch, mask, parts)))


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


def _update(
    state: Any, grads: Any, strategy: Replicated, *, in_place: bool, per_example: bool = False
) -> tuple[Any, Any, torch.Tensor]:
    """The optimizer step on this process's rows, with the strategy's norms: new params (as the state
    keeps them), new optimizer state, and the gradients' global norm before clipping (per-example
    gradients: their batch mean's)."""
    old = strategy.opt_params(state)
    params, opt_state = apply_gradients(
        state.tx, grads, state.opt_state, old, norm=strategy.norm, in_place=in_place
    )
    if per_example:
        _check_shapes(params, old)
    grad_norm = tree.global_norm(
        tree.map(lambda g: g.mean(0), grads) if per_example else grads, strategy.norm
    )
    return strategy.params_at_rest(state, params), opt_state, grad_norm


def _check_shapes(new: Any, old: Any) -> None:
    """The update kept every param's shape (per-example gradients given to an optimizer that does not
    aggregate them broadcast the params to ``(B, ...)``)."""
    for i, (a, b) in enumerate(zip(tree.leaves(new), tree.leaves(old))):
        if a.shape != b.shape:
            raise ValueError(
                f"train step: the optimizer turned param {tree.paths(new)[i]} of shape {tuple(b.shape)} into "
                f"{tuple(a.shape)}. With make_train_step(..., per_example=True) the optimizer gets "
                "per-example gradients and must aggregate them first: ft.optim.dpsgd(...) or "
                "chain(ft.optim.differentially_private_aggregate(...), ...)"
            )


def _parallel(strategy: Replicated) -> str | None:
    """What the strategy runs over more than one process, named for a refusal (``None``: one process)."""
    if isinstance(strategy, ShardedStep):
        return "sharding= (ZeRO)"
    if type(strategy) is not Replicated:
        return f"the parallel strategy {type(strategy).__name__}"
    return None
