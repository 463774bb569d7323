"""The member axis of a stacked (ensemble) train state: is there one, how long, how its metrics are named.

Below both the step (which refuses a one-model step on an ensemble state) and :mod:`functrain.ensemble`
(which builds stacked states and their steps); the public names are ``ft.ensemble.is_ensemble`` and
``ft.ensemble.size``.

Example:
    >>> import torch, functrain as ft
    >>> is_ensemble(ft.ensemble.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1), n=2))
    True
"""

from __future__ import annotations

from typing import Any

import torch

from functrain.core.member_names import MemberNaming, MetricNaming

__all__ = ["is_ensemble", "metric_naming", "size"]


def is_ensemble(state: Any) -> bool:
    """True for a stacked state (its ``step`` has a member axis).

    Example:
        >>> import functrain as ft
        >>> is_ensemble(ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1)))
        False
    """
    step = getattr(state, "step", None)
    return isinstance(step, torch.Tensor) and step.ndim == 1


def size(state: Any) -> int:
    """The number of members of a stacked state.

    Example:
        >>> import functrain as ft
        >>> size(ft.ensemble.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1), n=4))
        4
    """
    if not is_ensemble(state):
        raise ValueError(
            "not an ensemble state: its step is 0-d; build one with functrain.ensemble.create(...) or stack([...])"
        )
    return int(state.step.shape[0])


def metric_naming(state: Any) -> MetricNaming:
    """How the loop names ``state``'s metrics: each member's, the mean, best and worst for an ensemble
    (:class:`~functrain.core.member_names.MemberNaming`), plain scalars for one model.

    Example:
        >>> import functrain as ft
        >>> metric_naming(ft.ensemble.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1), n=3)).shape
        (3,)
    """
    return MemberNaming(size(state)) if is_ensemble(state) else MetricNaming()
