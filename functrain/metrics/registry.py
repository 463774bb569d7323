"""Metrics by name, for configuration files: ``"accuracy"``, ``"F1Score"`` or ``{"name": ..., **arguments}``.

Names are matched case-insensitively. ``"accuracy"`` (arguments: ``top_k``) and ``"average"`` /
``"loss"`` (argument: ``of``) are functrain's own metrics; any other name, or ``"Accuracy"`` with
torchmetrics arguments such as ``task``/``num_classes``, is a torchmetrics class built by
:func:`~functrain.metrics.from_torchmetrics`.

Example:
    >>> metric_from_spec({"name": "f1score", "task": "multiclass", "num_classes": 4, "average": "macro"})
    from_torchmetrics('F1Score', task='multiclass', num_classes=4, average='macro', validate_args=False)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from functrain.metrics.accuracy import Accuracy
from functrain.metrics.average import Average
from functrain.metrics.base import Metric
from functrain.metrics.torchmetric import TorchMetric, torchmetrics_names

__all__ = ["TESTED_TORCHMETRICS", "available_metrics", "metric_from_spec"]

_NATIVE: dict[str, tuple[Callable[..., Metric], frozenset[str], dict[str, Any]]] = {
    "accuracy": (Accuracy, frozenset({"top_k"}), {}),
    "average": (Average, frozenset({"of", "dtype"}), {}),
    "loss": (Average, frozenset({"of", "dtype"}), {"of": "loss"}),
}

# torchmetrics classes checked by tests/test_metrics_torchmetric.py: batch-wise accumulation equals the
# whole-dataset result, and update traces with torch.compile(fullgraph=True) on CPU. AUROC and
# AveragePrecision with `thresholds=` have fixed-size states and are exact when updated eagerly, but on CPU
# torchmetrics picks softmax-or-not with a Python `if` on the data, which breaks a compiled graph.
TESTED_TORCHMETRICS = (
    "Accuracy",
    "CohenKappa",
    "ConfusionMatrix",
    "CriticalSuccessIndex",
    "ExactMatch",
    "ExplainedVariance",
    "F1Score",
    "FBetaScore",
    "HammingDistance",
    "JaccardIndex",
    "LogCoshError",
    "MatthewsCorrCoef",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredError",
    "MeanSquaredLogError",
    "MinkowskiDistance",
    "Precision",
    "R2Score",
    "Recall",
    "RelativeSquaredError",
    "Specificity",
    "StatScores",
    "SymmetricMeanAbsolutePercentageError",
    "TweedieDevianceScore",
)

_ALIASES = {"f1": "F1Score", "mse": "MeanSquaredError", "mae": "MeanAbsoluteError", "mean": "average"}


def available_metrics() -> list[str]:
    """Names :func:`metric_from_spec` is known to handle: functrain's own, then tested torchmetrics names.

    Other torchmetrics classes are tried too; those with list ("cat") states raise a clear error.

    Example:
        >>> names = available_metrics()
        >>> "accuracy" in names and "F1Score" in names
        True
    """
    return [*_NATIVE, *TESTED_TORCHMETRICS]


def _split_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"metric spec {dict(spec)!r} has no 'name' key; e.g. {{'name': 'F1Score', ...}}")
        arguments = {k: v for k, v in spec.items() if k != "name"}
        if not all(isinstance(k, str) for k in arguments):
            raise TypeError(f"metric spec {dict(spec)!r}: argument names must be strings")
        return spec["name"], arguments
    raise TypeError(f"a metric spec is a name or a dict with 'name', got {type(spec).__name__}: {spec!r}")


def metric_from_spec(spec: str | Mapping[str, Any]) -> Metric:
    """Build a metric from a name or ``{"name": ..., **arguments}``; unknown names list close matches.

    Example:
        >>> metric_from_spec("accuracy")
        Accuracy(top_k=1)
        >>> metric_from_spec({"name": "MeanSquaredError"})
        from_torchmetrics('MeanSquaredError')
    """
    name, arguments = _split_spec(spec)
    if not isinstance(name, str) or not name:
        raise TypeError(f"metric spec name must be a non-empty string, got {name!r}")
    key = _ALIASES.get(name.lower(), name)
    native = _NATIVE.get(key.lower())
    if native is not None:
        factory, accepted, defaults = native
        if set(arguments) <= accepted:
            return factory(**{**defaults, **arguments})
        if key.lower() not in {n.lower() for n in torchmetrics_names()}:
            unknown = sorted(set(arguments) - accepted)
            raise ValueError(f"metric {name!r} does not take {unknown}; it accepts {sorted(accepted)}")
    canonical = {n.lower(): n for n in torchmetrics_names()}
    if key.lower() in canonical:
        return TorchMetric(canonical[key.lower()], **arguments)
    known = [*_NATIVE, *_ALIASES, *canonical.values()]
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    close += [n for n in known if n.lower() == name.lower() and n not in close]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown metric {name!r}.{hint} See functrain.metrics.available_metrics().")
