"""Metrics whose state is a pytree: ``empty``, ``update`` (inside the compiled step), ``merge``, ``compute``.

Example:
    >>> import torch
    >>> from functrain import metrics
    >>> collection = metrics.Collection({"loss": metrics.Average(), "accuracy": metrics.Accuracy()})
    >>> state = collection.empty()
    >>> state = collection.update(state, preds=torch.tensor([[0.0, 1.0]]), target=torch.tensor([1]),
    ...                           loss=torch.tensor(0.5), num_examples=1)
    >>> {k: float(v) for k, v in collection.compute(state).items()}
    {'loss': 0.5, 'accuracy': 1.0}
"""

from functrain.metrics.accuracy import Accuracy
from functrain.metrics.average import Average, AverageState
from functrain.metrics.base import INPUT_NAMES, Metric
from functrain.metrics.collection import Collection

# torchmetrics takes seconds to import: the names that need it load on first use (PEP 562).
_LAZY = {
    "available_metrics": "functrain.metrics.registry",
    "metric_from_spec": "functrain.metrics.registry",
    "TorchMetric": "functrain.metrics.torchmetric",
    "from_torchmetrics": "functrain.metrics.torchmetric",
    "torchmetrics_names": "functrain.metrics.torchmetric",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'functrain.metrics' has no attribute {name!r}")


__all__ = [
    "INPUT_NAMES",
    "Accuracy",
    "Average",
    "AverageState",
    "Collection",
    "Metric",
    "TorchMetric",
    "available_metrics",
    "from_torchmetrics",
    "metric_from_spec",
    "torchmetrics_names",
]
