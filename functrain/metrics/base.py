"""The metric protocol: a metric is a recipe, its state is a pytree of tensors.

A metric object holds only static configuration. Everything that accumulates lives in a *state*
(a :func:`functrain.tree.struct` or a dict of tensors) that the train/eval step carries and returns:

- ``empty(device=None) -> state``: the state before any batch;
- ``update(state, **inputs) -> state``: pure tensor code, traced inside the compiled step;
- ``merge(a, b) -> state``: combine two states (batches, shards, ranks);
- ``reductions() -> pytree``: per state leaf, ``"sum"``, ``"max"`` or ``"min"`` — how ranks all-reduce it;
- ``compute(state) -> Tensor | dict[str, Tensor]``: host side, after the loop; may synchronise.

Inputs are passed by name and every metric picks what it needs, so one call feeds a whole
:class:`~functrain.metrics.Collection`. The names functrain uses:

``preds``        model output (logits for classification, values for regression);
``target``       labels / regression targets;
``loss``         a 0-d mean loss for the batch;
``num_examples`` how many examples that mean was taken over (int or 0-d tensor);
``mask``         optional per-example 0/1 weights (padding of a fixed-shape last batch).

Example:
    >>> import torch
    >>> from functrain import metrics
    >>> acc = metrics.Accuracy()
    >>> state = acc.update(acc.empty(), preds=torch.tensor([[2.0, 0.0]]), target=torch.tensor([0]))
    >>> float(acc.compute(state))
    1.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from functrain.tree import PyTree

__all__ = ["INPUT_NAMES", "Metric", "require_input"]

INPUT_NAMES = ("preds", "target", "loss", "num_examples", "mask")


@runtime_checkable
class Metric(Protocol):
    """What every functrain metric provides (see the module docstring for the contract).

    Example:
        >>> from functrain import metrics
        >>> isinstance(metrics.Average(), metrics.Metric)
        True
    """

    def empty(self, device: torch.device | str | None = None) -> PyTree: ...

    def update(self, state: PyTree, **inputs: Any) -> PyTree: ...

    def merge(self, a: PyTree, b: PyTree) -> PyTree: ...

    def reductions(self) -> PyTree: ...

    def compute(self, state: PyTree) -> torch.Tensor | dict[str, torch.Tensor]: ...


def require_input(inputs: Mapping[str, Any], name: str, metric: str, what: str) -> Any:
    """``inputs[name]``, or a ``TypeError`` saying which metric needed it and what it should be.

    Runs at trace time only (a Python dict lookup), so it costs nothing inside the compiled step.

    Example:
        >>> require_input({"loss": 1.0}, "loss", "Average", "a 0-d loss")
        1.0
    """
    if name in inputs and inputs[name] is not None:
        return inputs[name]
    given = ", ".join(sorted(k for k, v in inputs.items() if v is not None)) or "nothing"
    raise TypeError(f"{metric}.update needs input {name!r} ({what}); it was given: {given}")
