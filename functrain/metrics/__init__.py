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
from functrain.metrics.registry import available_metrics, metric_from_spec
from functrain.metrics.torchmetric import TorchMetric, from_torchmetrics, torchmetrics_names

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
