"""`Collection`: named metrics fed by one call, itself a metric over a dict of states.

Example:
    >>> import torch
    >>> from functrain.metrics import Accuracy, Average
    >>> metrics = Collection({"loss": Average("loss"), "accuracy": Accuracy()})
    >>> s = metrics.update(metrics.empty(), preds=torch.tensor([[1.0, 0.0]]), target=torch.tensor([0]),
    ...                    loss=torch.tensor(0.3), num_examples=1)
    >>> {k: round(float(v), 3) for k, v in metrics.compute(s).items()}
    {'loss': 0.3, 'accuracy': 1.0}
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from functrain.metrics.base import Metric

__all__ = ["Collection"]


class Collection:
    """A dict of named metrics; its state is ``{name: state}`` and ``update`` passes every input to each.

    ``compute`` returns a flat ``{name: tensor}``; a metric whose result is a dict contributes
    ``"name/key"`` entries.

    Example:
        >>> from functrain.metrics import Average
        >>> c = Collection({"loss": Average()})
        >>> sorted(c.empty())
        ['loss']
    """

    def __init__(self, metrics: Mapping[str, Metric]) -> None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"Collection needs a mapping {{name: metric}}, got {type(metrics).__name__}")
        for name, metric in metrics.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"Collection: metric names must be non-empty strings, got {name!r}")
            if not isinstance(metric, Metric):
                raise TypeError(
                    f"Collection: metric {name!r} is a {type(metric).__name__}, which lacks "
                    "empty/update/merge/reductions/compute; build it with functrain.metrics.metric_from_spec"
                )
        self._metrics: dict[str, Metric] = dict(metrics)

    @property
    def metrics(self) -> dict[str, Metric]:
        """A copy of the ``{name: metric}`` mapping."""
        return dict(self._metrics)

    def __iter__(self) -> Iterator[str]:
        return iter(self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def __repr__(self) -> str:
        return f"Collection({self._metrics!r})"

    def _check(self, state: Mapping[str, Any], what: str) -> None:
        if not isinstance(state, Mapping) or set(state) != set(self._metrics):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"Collection.{what}: state keys {got} do not match the metrics {sorted(self._metrics)}; "
                "start from Collection.empty()"
            )

    def empty(self, device: torch.device | str | None = None) -> dict[str, Any]:
        return {name: m.empty(device) for name, m in self._metrics.items()}

    def update(self, state: Mapping[str, Any], **inputs: Any) -> dict[str, Any]:
        self._check(state, "update")
        return {name: m.update(state[name], **inputs) for name, m in self._metrics.items()}

    def merge(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
        self._check(a, "merge")
        self._check(b, "merge")
        return {name: m.merge(a[name], b[name]) for name, m in self._metrics.items()}

    def reductions(self) -> dict[str, Any]:
        return {name: m.reductions() for name, m in self._metrics.items()}

    def compute(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        self._check(state, "compute")
        out: dict[str, torch.Tensor] = {}
        for name, m in self._metrics.items():
            result = m.compute(state[name])
            if isinstance(result, Mapping):
                out.update({f"{name}/{key}": value for key, value in result.items()})
            else:
                out[name] = result
        return out
