"""Compile time of a GRU sequence classifier's train step against the sequence length.

functrain runs ``nn.GRU``/``nn.LSTM``/``nn.RNN`` as a Python loop over time steps inside compiled
steps (``functrain.compile.rnn``), which dynamo unrolls: the graph, and so the compile time, grows with the
sequence length. Each sequence length runs in a fresh child process with an empty inductor cache
(a cold compile), and reports the first call (compile + one step) and the median of ``--steps``
compiled steps, beside the same step run eagerly with torch's own GRU kernel (``make_train_step``
without ``jit``).

Usage:
    python benchmarks/rnn.py                     # writes benchmarks/results/rnn.md
    python benchmarks/rnn.py --seqs 8 32 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

import functrain as ft


class GRUClassifier(nn.Module):
    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def child(seq: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = GRUClassifier()
    state = ft.TrainState.create(model, ft.optim.adam(1e-3))
    step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))
    compiled = ft.jit(step)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, seq, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
    t0 = time.perf_counter()
    compiled(state, batch)
    first_s = time.perf_counter() - t0

    def median_ms(fn: object) -> float:
        times = [common.timed(lambda: fn(state, batch), 1) for _ in range(steps)]  # type: ignore[operator]
        return statistics.median(times)

    return {
        "seq": seq,
        "first_call_s": first_s,
        "compiled_ms": median_ms(compiled),
        "eager_torch_ms": median_ms(step),
        "num_compiles": compiled.num_compiles,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", nargs="+", type=int, default=[8, 32, 128])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "rnn.md"))
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps)))
        return
    torch.set_num_threads(1)  # what the children run with (reported in the header)
    rows = []
    for seq in args.seqs:
        with tempfile.TemporaryDirectory() as cache:
            cmd = ["--child", str(seq), "--steps", str(args.steps)]
            rows.append(
                common.run_child(
                    __file__, cmd, f"seq {seq}", TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1"
                )
            )
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    lines = [
        f"# rnn: compile time of a GRU classifier's train step vs sequence length ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        "Model: 2-layer GRU (32 -> 64), linear head on the last output, batch 32, Adam. "
        f"Machine: {common.machine()}; load {common.load_average()}. "
        f"Command: `python benchmarks/rnn.py --seqs {' '.join(map(str, args.seqs))} --steps {args.steps}`",
        "",
        "| seq | first compiled call (s) | vs shortest | compiled step (ms) | eager step, torch's GRU (ms) | compiles |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['first_call_s']:.1f} | {r['first_call_s'] / base['first_call_s']:.2f}x | "
            f"{r['compiled_ms']:.1f} | {r['eager_torch_ms']:.1f} | {r['num_compiles']} |"
        )
    common.write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
