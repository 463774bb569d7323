"""How the Trainer reads a batch: ``(inputs, target)`` for a criterion, or a Hugging Face batch dict whose
``labels`` the model turns into its own loss; and what a prediction of either is.

Example:
    >>> forward_takes_labels(torch.nn.Linear(2, 1))
    False
    >>> output_field({"loss": 1.0, "logits": 2.0}, "logits", 1)
    2.0
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from functrain.step.batch import INPUT_KEYS, inputs_and_target

__all__ = [
    "criterion_argument",
    "forward_takes_labels",
    "labels_loss",
    "output_field",
    "pad_token_id",
    "predict_forward",
    "refuse_model_output",
]


def criterion_argument(criterion: Any, loss_fn: Any) -> Any:
    """The Trainer's ``criterion``, which ``loss_fn`` (the whole loss) excludes.

    Example:
        >>> criterion_argument(None, None) is None
        True
    """
    if loss_fn is not None and criterion is not None:
        raise TypeError(
            "Trainer: give loss_fn(model, batch) or criterion(preds, target), not both (loss_fn "
            "computes the whole loss, so the criterion would never be used)"
        )
    return criterion


def forward_takes_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``labels`` (a Hugging Face model computes its loss from them)."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read (a C extension's forward)
        return False


def output_field(out: Any, name: str, position: int) -> Any:
    """``out.<name>`` of a model output: a Hugging Face ``ModelOutput`` (a mapping with attributes), a
    dict, or the tuple of ``return_dict=False`` (``(loss, logits, ...)`` with labels, ``(logits, ...)``
    without); a plain tensor is its own logits."""
    if isinstance(out, torch.Tensor):
        return out if name == "logits" else None
    if isinstance(out, Mapping):
        return out.get(name)
    if isinstance(out, Sequence) and len(out) > position:
        return out[position]
    return getattr(out, name, None)


def labels_loss(
    model: Callable[..., Any],
    batch: Mapping[str, Any],
    criterion: Callable[[Any, Any], torch.Tensor] | None,
    model_name: str,
) -> tuple[Any, dict[str, Any]]:
    """A batch dict with ``labels``: ``model(**batch)``; the output's ``loss`` (``criterion=None``) or
    ``criterion(logits, labels)``; ``logits`` and ``labels`` for the metrics."""
    out = model(**batch)
    logits = output_field(out, "logits", 1)
    if criterion is None:
        loss = output_field(out, "loss", 0)
        if loss is None:
            raise ValueError(
                f"Trainer: {model_name} returned no loss for a batch with labels; "
                "pass criterion=... (applied to its logits) or loss_fn=(model, batch) -> loss"
            )
    else:
        loss = criterion(logits, batch["labels"])
    return loss, {"preds": logits, "target": batch["labels"]}


def pad_token_id(model: nn.Module) -> int:
    """The token id a Hugging Face model pads with (``config.pad_token_id``), else 0.

    Example:
        >>> pad_token_id(torch.nn.Linear(2, 1))
        0
    """
    value = getattr(getattr(model, "config", None), "pad_token_id", None)
    return value if isinstance(value, int) else 0


def refuse_model_output(preds: Any, model_name: str) -> None:
    """Refuse a Hugging Face model's output (a mapping with ``logits``) met on the ``(inputs, target)``
    path, where the criterion expects a tensor: the batches are not the dicts with ``labels`` that such a
    model's loss reads (a ``TensorDataset`` given to a ``BertForSequenceClassification``)."""
    if isinstance(preds, Mapping) and "logits" in preds:
        raise TypeError(
            f"Trainer: {model_name} returned a {type(preds).__name__}, not a tensor, for an (inputs, target) "
            "batch; give it dict batches with its inputs and 'labels' (e.g. {'input_ids': ..., "
            "'attention_mask': ..., 'labels': ...}, as a tokenized Hugging Face dataset gives them), or pass "
            "loss_fn=(model, batch) -> loss"
        )


def predict_forward(model: Callable[..., Any], batch: Any, takes_labels: bool) -> Any:
    """The model's prediction for a batch: its inputs (a tensor, the input of ``(inputs, target)`` or of a
    dict), or for a Hugging Face batch the logits, without computing a loss."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if takes_labels and isinstance(batch, Mapping) and not any(k in batch for k in INPUT_KEYS):
        return output_field(model(**{k: v for k, v in batch.items() if k != "labels"}), "logits", 0)
    try:
        x, _ = inputs_and_target(batch)
    except (KeyError, TypeError):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return model(x)
