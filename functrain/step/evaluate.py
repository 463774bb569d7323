"""The eval and predict steps: eval-mode forwards without gradients, over a state's (gathered) params.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 3)
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> make_predict_step(model)(state, torch.randn(2, 4)).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from functrain.core.masked_batch import unmask
from functrain.distributed.data_ranks import whole_tensors
from functrain.distributed.tp_forward import tensor_parallel_forward
from functrain.precision import autocast_dtype
from functrain.step.base import Step, check_state_matches, expected_names
from functrain.step.batch import (
    INPUT_KEYS,
    Batch,
    LossFn,
    loss_over_real_rows,
    mask_parts,
    metric_inputs,
    real_examples,
)
from functrain.step.bind import ApplyFn, autocast, device_of, forward_params, mode_setter, model_call

__all__ = ["make_eval_step", "make_predict_step"]


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
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> eval_step = make_eval_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> out = eval_step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
        >>> out["loss"].shape
        torch.Size([])
    """
    cast = autocast_dtype(precision)
    expected = expected_names(model if isinstance(model, nn.Module) else None)
    bind, set_mode = model_call(model), mode_setter(model)

    def eval_step(state: Any, batch: Batch) -> dict[str, Any]:
        check_state_matches(state, expected)
        set_mode(False)
        batch, mask = unmask(batch)  # a padded batch (functrain.data.padding): its real rows count
        params = forward_params(state)
        with torch.no_grad(), autocast(device_of(params), cast), _placed_forward(model):
            call = bind(params, state.buffers)
            loss, aux = loss_over_real_rows(loss_fn, call, batch, *mask_parts(batch, mask, 1)[0])
        loss = loss.float()
        preds = [aux["preds"]] if "preds" in aux else []
        targets = [aux["target"]] if "target" in aux else []
        out: dict[str, Any] = {"loss": loss, "num_examples": real_examples(batch, mask), "metrics": None}
        out.update({k: v.float() for k, v in dict(aux.get("metrics", {})).items()})
        if metrics is not None:
            empty = metrics.empty(device_of(state.params))
            # plain tensors: the metrics update outside the forward's implicit replication
            inputs = whole_tensors(metric_inputs(preds, targets, loss, batch, mask))
            out["metrics"] = metrics.update(empty, **inputs)
        if return_preds:
            out["preds"] = aux.get("preds")
        return whole_tensors(out)  # tensor parallelism: plain tensors, as one process gives

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
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> predict_step = make_predict_step(model)
        >>> predict_step(state, torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """
    cast = autocast_dtype(precision)

    def default_forward(call: Callable[..., Any], batch: Batch) -> Any:
        if isinstance(batch, torch.Tensor):
            return call(batch)
        if isinstance(batch, Mapping):
            for k in INPUT_KEYS:
                if k in batch:
                    return call(batch[k])
            return call(**batch)
        if isinstance(batch, Sequence):
            return call(batch[0])
        raise TypeError(f"predict: cannot find the inputs in a {type(batch).__name__}; pass forward=...")

    fwd = forward or default_forward
    bind, set_mode = model_call(model), mode_setter(model)

    def predict_step(state: Any, batch: Batch) -> Any:
        set_mode(False)
        batch, _ = unmask(batch)  # a padded batch: the loop cuts the padded rows off the outputs
        params = forward_params(state)
        with torch.no_grad(), autocast(device_of(params), cast), _placed_forward(model):
            return whole_tensors(fwd(bind(params, state.buffers), batch))

    return Step(predict_step, kind="predict", model=model, masked_batches=True)


def _placed_forward(model: nn.Module | ApplyFn) -> contextlib.AbstractContextManager[None]:
    """A tensor-parallel model's forward outside ``functrain.jit`` (which enters it around the compiled
    call, where dynamo cannot trace the switch): the batch met as replicated by the DTensor params."""
    if torch.compiler.is_dynamo_compiling():
        return contextlib.nullcontext()
    return tensor_parallel_forward(model)
