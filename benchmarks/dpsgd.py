"""DP-SGD's step cost: functrain's per-example step (``make_train_step(..., per_example=True)`` with
``ft.optim.dpsgd``) against a plain step of the same model, eager and compiled, and against Opacus
(``GradSampleModule`` + ``DPOptimizer``) when it is importable.

Variants (each on its own copy of the same initial weights and the same batch; SGD lr 0.05; DP with clip
1.0 and noise multiplier 1.0):

    plain-eager     make_train_step(model, loss) with ft.optim.sgd, called eagerly
    dp-eager        make_train_step(model, loss, per_example=True) with ft.optim.dpsgd, eagerly
    plain-jit       ft.jit of plain-eager's step (one graph)
    dp-jit          ft.jit of dp-eager's step (one graph: vmap(grad), clip, noise, update)
    torch-eager     model(x), loss.backward(), torch.optim.SGD: the plain PyTorch loop
    opacus          Opacus's GradSampleModule + DPOptimizer on the same model and batch (when importable)

Timing runs every variant in this one process, interleaved (each repeat times ``--steps`` steps of every
variant in turn, in a rotated order); the table gives the median ms/step over repeats with the
interquartile range, and the ratios the issue asks for (DP over plain, eager and compiled; functrain over
Opacus).

Usage:
    python benchmarks/dpsgd.py                      # writes benchmarks/results/dpsgd.md
    PYTHONPATH=/path/to/opacus python benchmarks/dpsgd.py --repeats 10
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

import functrain as ft

LR, CLIP, NOISE = 0.05, 1.0, 1.0


def _batch(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return common.MLP(width)


def _ft_variant(name: str, width: int, batch: tuple) -> Callable[[], None]:
    model = _model(width)
    dp = name.startswith("dp")
    tx = ft.optim.dpsgd(LR, CLIP, NOISE, seed=0) if dp else ft.optim.sgd(LR)
    step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy), per_example=dp)
    if name.endswith("jit"):
        step = ft.jit(step)
    box = [ft.TrainState.create(model, tx)]

    def run() -> None:
        box[0], _ = step(box[0], batch)

    return run


def _torch_variant(width: int, batch: tuple) -> Callable[[], None]:
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return run


def _opacus_variant(width: int, batch: tuple) -> Callable[[], None] | None:
    try:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return None
    model = GradSampleModule(_model(width))
    x, y = batch
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        noise_multiplier=NOISE,
        max_grad_norm=CLIP,
        expected_batch_size=len(x),
    )

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dpsgd.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = _batch(args.batch, args.width)
    variants: dict[str, Callable[[], None]] = {
        name: _ft_variant(name, args.width, batch)
        for name in ("plain-eager", "dp-eager", "plain-jit", "dp-jit")
    }
    variants["torch-eager"] = _torch_variant(args.width, batch)
    opacus = _opacus_variant(args.width, batch)
    if opacus is not None:
        variants["opacus"] = opacus
    for run in variants.values():  # warm up: compiles, first-call allocations
        for _ in range(3):
            run()
    times = common.interleaved(variants, args.repeats, args.steps)
    med = {name: common.median_spread(ts) for name, ts in times.items()}
    lines = [
        "# DP-SGD step cost (benchmarks/dpsgd.py)",
        "",
        f"MLP {args.width}-{args.width}-{args.width}-10 ({sum(p.numel() for p in _model(args.width).parameters())} "
        f"params), batch {args.batch}, clip {CLIP}, noise multiplier {NOISE}; {common.machine()}; "
        f"load average {common.load_average()}; {args.repeats} repeats of {args.steps} steps, interleaved.",
        "",
        "| variant | ms/step (median) | IQR |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {m:.2f} | {lo:.2f}-{hi:.2f} |" for name, (m, lo, hi) in med.items()]
    ratio = {name: m for name, (m, _, _) in med.items()}
    lines += [
        "",
        f"- DP over plain, eager: **{ratio['dp-eager'] / ratio['plain-eager']:.2f}x**",
        f"- DP over plain, compiled (ft.jit): **{ratio['dp-jit'] / ratio['plain-jit']:.2f}x**",
    ]
    if "opacus" in ratio:
        lines += [
            f"- functrain DP eager over Opacus: **{ratio['dp-eager'] / ratio['opacus']:.2f}x**",
            f"- functrain DP compiled over Opacus: **{ratio['dp-jit'] / ratio['opacus']:.2f}x**",
            f"- Opacus over the plain PyTorch loop: {ratio['opacus'] / ratio['torch-eager']:.2f}x",
        ]
    else:
        lines.append("- Opacus not importable here: no Opacus row (put it on PYTHONPATH to add one)")
    common.write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
