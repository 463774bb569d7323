"""The logging window: running sums of the step metrics since the last log, kept on the device."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from functrain.core.member_names import MetricNaming
from functrain.loop.data import scalar_dict

__all__ = ["Window"]


class Window:
    """Running sums of the step metrics since the last log, kept on the device (no sync per step).
    Metrics of ``naming.shape`` are summed: scalars for one model, ``[members]`` vectors for an ensemble."""

    def __init__(self, naming: MetricNaming | None = None) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.naming = naming or MetricNaming()
        self.shape = self.naming.shape

    def add(self, metrics: Mapping[str, torch.Tensor]) -> None:
        shape = self.shape
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor) and v.shape == shape:
                v = v.detach().float()
                self.sums[k] = v if k not in self.sums else self.sums[k] + v
        self.count += 1

    def flush(self) -> dict[str, Any]:
        out = {f"train/{k}": v / self.count for k, v in self.sums.items()} if self.count else {}
        self.sums, self.count = {}, 0
        return out

    def to_json(self) -> str:
        def number(v: float) -> float | str:
            return v if math.isfinite(v) else repr(v)

        if not self.shape:
            sums: dict[str, Any] = {k: number(v) for k, v in scalar_dict(self.sums).items()}
        else:
            sums = {k: [number(x) for x in v.detach().cpu().tolist()] for k, v in self.sums.items()}
        return json.dumps({"count": self.count, "sums": sums})

    @classmethod
    def from_json(
        cls, text: str, like: Mapping[str, torch.Tensor], naming: MetricNaming | None = None
    ) -> Window:
        data = json.loads(text)
        window = cls(naming)
        window.count = int(data["count"])
        device = next(iter(like.values())).device if like else torch.device("cpu")

        def tensor(v: Any) -> torch.Tensor:
            value = [float(x) for x in v] if isinstance(v, list) else float(v)
            return torch.tensor(value, dtype=torch.float32, device=device)

        window.sums = {k: tensor(v) for k, v in data["sums"].items()}
        return window
