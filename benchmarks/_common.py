"""Shared pieces of the step and loop benchmarks: the workloads, timing and memory helpers.

A *workload* is a model factory plus a fixed batch; every variant of a benchmark builds its own copy of
the model from the same seed, so all variants start from identical weights.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

LR = 1e-3
WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, matched by functrain.optim.adamw


# ------------------------------------------------------------------------------------------ models


class MLP(nn.Sequential):
    """512-512-512-10."""

    def __init__(self, width: int = 512, depth: int = 3, classes: int = 10) -> None:
        layers: list[nn.Module] = []
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers, nn.Linear(width, classes))


class CNN(nn.Module):
    """Two conv-BatchNorm-ReLU-pool blocks and a dropout MLP head, for 1x28x28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(128, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Transformer(nn.Module):
    """A 2-layer pre-norm transformer encoder with dropout over token ids, predicting a class per token."""

    def __init__(self, vocab: int = 1000, d_model: int = 128, heads: int = 4, layers: int = 2, seq: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos)
        return self.out(self.norm(h)).flatten(0, 1)  # (batch * seq, vocab)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def _mlp_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(256, 512, generator=g), torch.randint(0, 10, (256,), generator=g)


def _mlp_big_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(256, 2048, generator=g), torch.randint(0, 10, (256,), generator=g)


def _cnn_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(128, 1, 28, 28, generator=g), torch.randint(0, 10, (128,), generator=g)


def _channels_last_cnn() -> nn.Module:
    return CNN().to(memory_format=torch.channels_last)


def _cnn_channels_last_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _cnn_batch(g)
    return x.to(memory_format=torch.channels_last), y


def _transformer_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (32, 64), generator=g), torch.randint(0, 1000, (32 * 64,), generator=g)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("mlp", "MLP 512-512-512-10, batch 256", MLP, _mlp_batch),
        Workload("cnn", "CNN (2 conv+BatchNorm, dropout), 1x28x28, batch 128", CNN, _cnn_batch),
        # Layouts: a pure step must return channels_last weights and moments as channels_last (issue 10).
        Workload(
            "cnn-cl",
            "the CNN with channels_last weights and images",
            _channels_last_cnn,
            _cnn_channels_last_batch,
        ),
        Workload(
            "transformer",
            "2-layer transformer, d_model 128, seq 64, dropout 0.1, batch 32",
            Transformer,
            _transformer_batch,
        ),
        # Memory only: large enough (25.2M params) that params/grads/Adam moments dominate the process.
        Workload(
            "mlp-25m",
            "MLP 2048 wide, 7 layers (25.2M params), batch 256",
            lambda: MLP(2048, 7),
            _mlp_big_batch,
        ),
    )
}


def build_model(workload: Workload, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return workload.make_model()


def build_batch(workload: Workload, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return workload.make_batch(torch.Generator().manual_seed(seed))


def ft_step_fn(
    model: nn.Module,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    donate: bool = False,
    jit_kwargs: dict | None = None,
    tx: Any = None,
    **step_kwargs: Any,
) -> Callable[[], None]:
    """A zero-argument callable running one ``ft.jit`` step (``tx``, default AdamW) on ``batch``;
    ``.compiled`` is the step.

    The state shares the model's weights (``copy=False``) instead of holding a second copy of them.
    ``step_kwargs`` go to :func:`functrain.make_train_step` (``precision="bf16"``, ...).
    """
    import functrain as ft  # imported on first use: the scripts import this module first

    tx = tx if tx is not None else ft.optim.adamw(LR, weight_decay=WEIGHT_DECAY)
    state = ft.TrainState.create(model, tx, copy=False)
    step = ft.jit(
        ft.make_train_step(model, ft.supervised_loss(criterion), **step_kwargs),
        donate=donate,
        **(jit_kwargs or {}),
    )
    box = [state]

    def ft_step() -> None:
        box[0], _ = step(box[0], batch)

    ft_step.compiled = step  # type: ignore[attr-defined]
    return ft_step


# ------------------------------------------------------------------------------------------ stats


def median_spread(xs: list[float]) -> tuple[float, float, float]:
    """(median, low quartile, high quartile) of ``xs``."""
    xs = sorted(xs)
    if len(xs) < 4:
        return statistics.median(xs), xs[0], xs[-1]
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs), q[0], q[2]


def timed(fn: Callable[[], Any], n: int) -> float:
    """Milliseconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, calls: int) -> dict[str, list[float]]:
    """``{name: [ms per call, one per repeat]}``: each repeat times ``calls`` calls of every function,
    starting one function later each repeat, so that a drift of the machine's speed spreads evenly."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(fns[name], calls))
    return times


# ------------------------------------------------------------------------------------------ children


def run_child(script: str, args: list[str], what: str, **env: str) -> dict:
    """Run ``python script *args`` in a fresh process (``env`` added to this one's) and return the JSON
    object on the last line of its stdout; raise with the tail of its stderr, naming ``what``, if it fails."""
    out = subprocess.run(
        [sys.executable, script, *args],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_report(text: str, out: str | Path, *, echo: bool = True) -> None:
    """Print the report ``text`` (unless ``echo=False``: already printed piece by piece) and write it
    to ``out`` (creating its folder)."""
    if echo:
        print(text)
    else:
        print(f"wrote {out}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.rstrip("\n") + "\n")


# ------------------------------------------------------------------------------------------ memory


def rss_mb() -> float:
    """Current resident set size in MB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """Peak resident set size (VmHWM) in MB since the process started or :func:`reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ machine


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"
