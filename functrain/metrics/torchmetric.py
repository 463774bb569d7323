"""torchmetrics metrics as functional metrics: their own states, their own update and compute.

``from_torchmetrics("F1Score", task="multiclass", num_classes=10, average="macro")`` builds a private
torchmetrics instance as a *template*. The functional state is exactly that metric's tensor states
(``tp/fp/tn/fn``, ``confmat``, ``sum_squared_error/total``...). ``update`` runs the metric class's own
``update`` code on a plain *shim* object holding copies of those states (no ``nn.Module``, no hidden
mutation, so ``torch.compile(fullgraph=True)`` traces it), and ``compute`` hands the accumulated states
to a copy of the template and calls the class's own ``compute``. The result therefore equals
torchmetrics' own result over the whole dataset.

Argument validation (``validate_args``) is switched off by default, because its checks branch on data
and would break the compiled graph; pass ``validate_args=True`` to debug eagerly.

Not supported, with a clear error:

- metrics whose states are lists that grow with every batch ("cat" states: AUROC/AveragePrecision
  without ``thresholds``, Spearman, retrieval metrics...): a compiled step needs fixed-shape states.
  The binned variants (``thresholds=100``) have fixed-shape states and are exact eagerly (on CPU their
  input normalisation branches on data, so they break a compiled graph there);
- metrics whose states reduce by mean or a custom function (they cannot be merged across ranks by
  sum/max/min).

Inputs whose selection depends on data (``ignore_index``, which drops entries by boolean indexing) work
eagerly but make dynamic shapes inside a compiled step; mask padding with the ``mask`` input instead:
given a per-example ``mask`` (the padding of a fixed-shape batch, :mod:`functrain.data.padding`), the
update counts the real rows only, at the batch's shape (see ``TorchMetric._masked_update``).

Example:
    >>> import torch
    >>> f1 = from_torchmetrics("F1Score", task="multiclass", num_classes=3, average="macro")
    >>> s = f1.update(f1.empty(), preds=torch.tensor([0, 1, 2, 2]), target=torch.tensor([0, 1, 2, 1]))
    >>> round(float(f1.compute(s)), 4)
    0.7778
"""

from __future__ import annotations

import copy
import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torchmetrics
from torchmetrics.classification import (
    BinaryConfusionMatrix,
    BinaryStatScores,
    MultilabelConfusionMatrix,
    MultilabelStatScores,
)

from functrain.metrics.base import require_input

__all__ = ["TorchMetric", "from_torchmetrics", "torchmetrics_names"]

# A metric's per-state reduction (``add_state(dist_reduce_fx=...)``) by the name of torchmetrics' public
# function; matched by name so that no private torchmetrics helper is imported.
_REDUCTION_NAMES = {"dim_zero_sum": "sum", "dim_zero_max": "max", "dim_zero_min": "min"}
_MERGE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
_MODULES = (torchmetrics, torchmetrics.classification, torchmetrics.regression)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
# Parameter names some torchmetrics updates use, and the functrain input that feeds them.
_INPUT_ALIASES = {"targets": "target"}
# Metrics that threshold scores into 0/1 labels. On CPU torchmetrics decides "logits or probabilities?"
# with a Python `if` on the data, which breaks the compiled graph; we decide with torch.where first.
_THRESHOLDED = (BinaryStatScores, MultilabelStatScores, BinaryConfusionMatrix, MultilabelConfusionMatrix)


def _squeeze_one_element(result: Any) -> Any:
    """One-element tensors (also inside a dict) to 0-d, as torchmetrics' ``Metric.compute`` wrapper does."""
    if isinstance(result, torch.Tensor):
        return result.squeeze() if result.numel() == 1 else result
    if isinstance(result, Mapping):
        return {k: _squeeze_one_element(v) for k, v in result.items()}
    return result


def _update_mean_absolute_error(self: Any, preds: torch.Tensor, target: torch.Tensor) -> None:
    # torchmetrics tests `preds.is_floating_point` (the method, always truthy), which dynamo cannot
    # trace; this is the same arithmetic on the same states.
    if self.num_outputs == 1:
        preds, target = preds.reshape(-1), target.reshape(-1)
    self.sum_abs_error = self.sum_abs_error + (preds - target).abs().sum(dim=0)
    self.total = self.total + target.shape[0]


# Traceable replacements for update methods that dynamo cannot trace, keyed by the concrete class name.
_TRACEABLE_UPDATES = {"MeanAbsoluteError": _update_mean_absolute_error}


def _scores_to_labels(preds: torch.Tensor, threshold: float) -> torch.Tensor:
    """torchmetrics' rule (sigmoid when any score lies outside [0, 1], then threshold) without a branch."""
    outside = ((preds < 0) | (preds > 1)).any()
    return (torch.where(outside, preds.sigmoid(), preds) > threshold).to(torch.int64)


def torchmetrics_names() -> list[str]:
    """Every metric class name torchmetrics exports (top level, classification, regression).

    Not all of them fit a compiled state; :func:`functrain.metrics.available_metrics` lists those tested.

    Example:
        >>> "F1Score" in torchmetrics_names()
        True
    """
    names = set()
    for module in _MODULES:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if isinstance(obj, type) and issubclass(obj, torchmetrics.Metric):
                names.add(name)
    return sorted(names)


def _find_class(name: str) -> type[torchmetrics.Metric]:
    for module in _MODULES:
        obj = getattr(module, name, None)
        if isinstance(obj, type) and issubclass(obj, torchmetrics.Metric):
            return obj
    close = difflib.get_close_matches(name, torchmetrics_names(), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown torchmetrics metric {name!r}{hint}")


def _accepted_arguments(cls: type) -> set[str] | None:
    """Keyword names ``cls(...)`` accepts, or None when it takes ``**kwargs`` we cannot see through."""
    # Task wrappers (Accuracy, F1Score...) construct the concrete class in __new__.
    constructor = cls.__new__ if "__new__" in vars(cls) else cls.__init__
    params = inspect.signature(constructor).parameters
    return {p.name for p in params.values() if p.kind is not inspect.Parameter.VAR_KEYWORD}


def _prepare_arguments(name: str, cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    accepted = _accepted_arguments(cls) or set()
    if "validate_args" in accepted:
        kwargs.setdefault("validate_args", False)
    if "task" in accepted and "task" not in kwargs:
        if "num_classes" in kwargs:
            kwargs["task"] = "multiclass"
        elif "num_labels" in kwargs:
            kwargs["task"] = "multilabel"
        else:
            raise ValueError(
                f"torchmetrics {name} needs task='binary', 'multiclass' (with num_classes=...) or "
                f"'multilabel' (with num_labels=...), e.g. {{'name': {name!r}, 'task': 'multiclass', "
                "'num_classes': 10}"
            )
    return kwargs


def _shim_class(template: torchmetrics.Metric) -> type:
    """A plain class with the metric's methods and configuration but none of nn.Module's machinery."""
    namespace: dict[str, Any] = {}
    for klass in reversed(type(template).__mro__):
        if klass is object or klass.__module__.startswith("torch.nn"):
            continue
        for key, value in vars(klass).items():
            if key.startswith("__"):
                continue
            if inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod)):
                namespace[key] = value
    # Registered buffers (e.g. the threshold grid of binned curves) are configuration too.
    namespace.update({k: v for k, v in template._buffers.items() if k not in template._defaults})
    if type(template).__name__ in _TRACEABLE_UPDATES:
        namespace["update"] = _TRACEABLE_UPDATES[type(template).__name__]
    for key, value in vars(template).items():
        if key in template._defaults or key in _MODULE_INTERNALS:
            continue
        # Instance-level wrappers of update/compute/forward must not shadow the class's own methods.
        if callable(value) and hasattr(type(template), key):
            continue
        namespace[key] = value
    return type(f"_StateShim_{type(template).__name__}", (), namespace)


class TorchMetric:
    """A torchmetrics metric as a functional metric; build it with :func:`from_torchmetrics`.

    The state is ``{state_name: tensor}`` with torchmetrics' own state names. ``update`` reads the
    inputs named like the parameters of the metric's ``update`` (``preds``, ``target``).

    Example:
        >>> import torch
        >>> mse = TorchMetric("MeanSquaredError")
        >>> s = mse.update(mse.empty(), preds=torch.tensor([1.0, 2.0]), target=torch.tensor([1.0, 4.0]))
        >>> sorted(s), float(mse.compute(s))
        (['sum_squared_error', 'total'], 2.0)
    """

    def __init__(self, name: str, **kwargs: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"torchmetrics metric name must be a string, got {name!r}")
        cls = _find_class(name)
        arguments = _prepare_arguments(name, cls, kwargs)
        try:
            template = cls(**arguments)
        except (TypeError, ValueError) as err:
            args = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
            raise ValueError(f"torchmetrics {name}({args}) could not be built: {err}") from err
        self.name = name
        self.arguments = arguments
        self._template = template
        self._reductions: dict[str, str] = {}
        for state_name, default in template._defaults.items():
            if not isinstance(default, torch.Tensor):
                hint = (
                    " Pass thresholds=100 (a fixed grid) for a fixed-size state."
                    if "thresholds" in (_accepted_arguments(cls) or set())
                    else ""
                )
                raise ValueError(
                    f"torchmetrics {name} keeps state {state_name!r} as a list that grows with every batch "
                    f"(a 'cat' state); it cannot live in the fixed-shape state of a compiled step.{hint} "
                    "Otherwise compute it eagerly with torchmetrics on collected predictions."
                )
            reduction = _REDUCTION_NAMES.get(getattr(template._reductions.get(state_name), "__name__", ""))
            if reduction is None:
                raise ValueError(
                    f"torchmetrics {name} reduces state {state_name!r} with "
                    f"{template._reductions.get(state_name)!r}, not sum/max/min, so its states cannot be "
                    "merged across batches and ranks; it is not supported as a functional metric"
                )
            self._reductions[state_name] = reduction
        self._shim = _shim_class(template)
        # torchmetrics' `_XLA_AVAILABLE` is a lazy package check (importlib.metadata) evaluated on first
        # use; inside a compiled step dynamo cannot trace it, so resolve it now, eagerly.
        bool(getattr(torchmetrics.utilities.data, "_XLA_AVAILABLE", False))
        self._thresholded = isinstance(template, _THRESHOLDED)
        update_params = list(inspect.signature(type(template).update).parameters.values())[1:]
        self._inputs = tuple(
            (p.name, p.default is inspect.Parameter.empty)
            for p in update_params
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        return f"from_torchmetrics({self.name!r}, {args})" if args else f"from_torchmetrics({self.name!r})"

    def empty(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        return {n: d.detach().clone().to(device) for n, d in self._template._defaults.items()}

    def update(self, state: Mapping[str, torch.Tensor], **inputs: Any) -> dict[str, torch.Tensor]:
        if not isinstance(state, Mapping) or set(state) != set(self._reductions):
            raise ValueError(
                f"{self!r}.update: state must hold {sorted(self._reductions)}; start from .empty()"
            )
        arguments = {}
        for parameter, required in self._inputs:
            input_name = _INPUT_ALIASES.get(parameter, parameter)
            if required:
                arguments[parameter] = require_input(inputs, input_name, self.name, "see torchmetrics docs")
            elif inputs.get(input_name) is not None:
                arguments[parameter] = inputs[input_name]
        arguments = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in arguments.items()}
        preds = arguments.get("preds")
        if self._thresholded and isinstance(preds, torch.Tensor) and preds.is_floating_point():
            arguments["preds"] = _scores_to_labels(preds, self._template.threshold)
        mask = inputs.get("mask")
        if mask is not None and "mask" not in dict(self._inputs):
            return self._masked_update(state, arguments, mask.detach().bool())
        return self._run_update(state, arguments)

    def _masked_update(
        self, state: Mapping[str, torch.Tensor], arguments: dict[str, Any], mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The update over the rows where ``mask`` (``[rows]``) is true, at the batch's fixed shape.

        torchmetrics' sum states add up per example (counts, confusion matrices, sums of errors), so the
        masked rows are replaced by row 0 and row 0's own contribution, once per masked row, is taken
        back out; max/min states are unchanged by a repeated real row. Exact for integer states.
        """
        rows = int(mask.shape[0])

        def rows_of(x: Any, real: bool) -> Any:
            if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] != rows:
                return x
            if not real:
                return x[:1]
            return torch.where(mask.reshape((rows,) + (1,) * (x.ndim - 1)), x, x[:1])

        full = self._run_update(state, {k: rows_of(v, True) for k, v in arguments.items()})
        empty = self.empty(next(iter(state.values())).device)
        one = self._run_update(empty, {k: rows_of(v, False) for k, v in arguments.items()})
        masked_rows = rows - mask.sum()
        out = {}
        for name, reduction in self._reductions.items():
            if reduction == "sum":
                delta = one[name] - empty[name]
                out[name] = full[name] - delta * masked_rows.to(delta.dtype)
            else:  # no real row at all: the state as it was
                out[name] = torch.where(mask.any(), full[name], state[name])
        return out

    def _run_update(self, state: Mapping[str, torch.Tensor], arguments: dict[str, Any]) -> dict[str, Any]:
        shim = self._shim()
        for state_name, value in state.items():
            # Some torchmetrics updates add in place (`self.total += n`): never touch the caller's tensors.
            setattr(shim, state_name, value.clone())
        self._shim.update(shim, **arguments)
        return {state_name: getattr(shim, state_name) for state_name in self._reductions}

    def merge(self, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: _MERGE[r](a[n], b[n]) for n, r in self._reductions.items()}

    def reductions(self) -> dict[str, str]:
        return dict(self._reductions)

    def compute(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        metric = copy.deepcopy(self._template)
        for state_name, value in state.items():
            setattr(metric, state_name, value)
        # The class's own compute, not the instance wrapper (which caches and warns about update counts).
        # ... then the wrapper's one-element squeeze, so shapes match what torchmetrics returns.
        result = _squeeze_one_element(type(metric).compute(metric))
        if isinstance(result, (tuple, list)):
            raise ValueError(
                f"torchmetrics {self.name} computes a {type(result).__name__}, not a tensor or a dict; "
                "only metrics with a tensor (or dict) result can be logged"
            )
        return result


def from_torchmetrics(name: str, **kwargs: Any) -> TorchMetric:
    """The torchmetrics metric class ``name`` built with ``kwargs``, as a functional metric.

    Task wrappers get ``task='multiclass'`` when ``num_classes`` is given (``'multilabel'`` with
    ``num_labels``); ``validate_args`` defaults to False (data checks would break the compiled graph).

    Example:
        >>> acc = from_torchmetrics("Accuracy", task="multiclass", num_classes=10)
        >>> sorted(acc.empty())
        ['fn', 'fp', 'tn', 'tp']
    """
    return TorchMetric(name, **kwargs)
