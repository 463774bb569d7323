"""Scalars of an ensemble: a value per member (a 1-d tensor along the member axis) as named scalars.

``{"eval/accuracy": tensor([a0, a1, a2])}`` becomes ``eval/accuracy`` (the members' mean),
``eval/accuracy/best`` (the best member's value: the highest, or the lowest for a loss-like name),
``eval/accuracy/worst`` and ``eval/accuracy/member_0`` ... ``member_2``. History, JSONL/CSV and
TensorBoard then record every member under its own key, and a callback monitors any of them
(``EarlyStopping(monitor="eval/accuracy/best", mode="max")`` or ``"eval/loss/member_2"``). Everything stays
a tensor (no host sync).

Example:
    >>> import torch
    >>> out = expand_members({"eval/loss": torch.tensor([0.5, 0.3]), "lr": 0.1}, members=2)
    >>> {k: round(float(v), 3) for k, v in out.items()}
    {'eval/loss': 0.4, 'eval/loss/best': 0.3, 'eval/loss/worst': 0.5, 'eval/loss/member_0': 0.5, 'eval/loss/member_1': 0.3, 'lr': 0.1}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

__all__ = ["MemberNaming", "MetricNaming", "expand_members", "lower_is_better", "member_key"]

_LOWER_IS_BETTER = ("loss", "error", "perplexity", "mse", "mae", "nll", "norm", "time")


def lower_is_better(name: str) -> bool:
    """Whether a smaller value of the scalar ``name`` is better (losses, errors, norms): how ``/best``
    picks a member.

    Example:
        >>> lower_is_better("eval/loss"), lower_is_better("eval/accuracy")
        (True, False)
    """
    leaf = name.lower()
    return any(word in leaf for word in _LOWER_IS_BETTER)


def member_key(name: str, i: int | Literal["best", "worst"]) -> str:
    """The key of member ``i``'s (or the best member's) value of ``name``: ``"eval/loss/member_2"``."""
    return f"{name}/{i}" if isinstance(i, str) else f"{name}/member_{i}"


def expand_members(values: Mapping[str, Any], members: int | None) -> dict[str, Any]:
    """Expand each ``[members]``-shaped tensor into the mean, best, worst and per-member scalars; other
    values pass through. ``members=None`` (not an ensemble) returns ``values`` as a dict."""
    if members is None:
        return dict(values)
    out: dict[str, Any] = {}
    for name, value in values.items():
        if not (isinstance(value, torch.Tensor) and value.shape == (members,)):
            out[name] = value
            continue
        v = value.detach().float()
        low = lower_is_better(name)
        out[name] = v.mean()
        out[member_key(name, "best")] = v.min() if low else v.max()
        out[member_key(name, "worst")] = v.max() if low else v.min()
        for i in range(members):
            out[member_key(name, i)] = v[i]
    return out


class MetricNaming:
    """How one model's metrics become logged names: nested dicts -> ``prefix/name``, a vector metric (per
    class) -> ``name_0``, ``name_1``...; each value a scalar (``shape == ()``).

    Example:
        >>> MetricNaming().flatten("eval", {"f1": torch.tensor([0.5, 1.0])})
        {'eval/f1_0': tensor(0.5000), 'eval/f1_1': tensor(1.)}
    """

    members: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one step metric (a loss): ``()``, or ``(members,)`` for an ensemble."""
        return () if self.members is None else (self.members,)

    def flatten(self, prefix: str, computed: Any) -> dict[str, Any]:
        """Nested metric values -> flat ``prefix/name`` keys (a member axis is kept, for :meth:`expand`)."""
        out: dict[str, Any] = {}
        if isinstance(computed, Mapping):
            for name, value in computed.items():
                out.update(self.flatten(f"{prefix}/{name}" if prefix else str(name), value))
        elif isinstance(computed, torch.Tensor) and computed.numel() > (self.members or 1):
            flat = computed.reshape(self.members, -1) if self.members else computed.reshape(-1)
            for i in range(flat.shape[-1]):
                out[f"{prefix}_{i}"] = flat[..., i]
        else:
            out[prefix] = computed
        return out

    def expand(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The logged scalars of ``values``: as they are for one model."""
        return expand_members(values, self.members)


class MemberNaming(MetricNaming):
    """An ensemble's naming: every value carries a leading member axis, logged as the mean, best, worst
    and each member's (``eval/loss/member_2``), by :func:`expand_members`.

    Example:
        >>> sorted(MemberNaming(2).expand({"train/loss": torch.tensor([1.0, 3.0])}))
        ['train/loss', 'train/loss/best', 'train/loss/member_0', 'train/loss/member_1', 'train/loss/worst']
    """

    def __init__(self, members: int) -> None:
        self.members = members
