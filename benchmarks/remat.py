"""Peak memory of one training step of a 12-layer transformer, with and without ``ft.remat``.

Variants (the same initial weights, batch and SGD step; each in a fresh child process):

    eager-plain      ft.jit(step, compile=False), every block keeps its activations
    eager-remat      the same with ft.remat on each of the 12 blocks
    compiled-plain   ft.jit(step): forward, backward and update in one graph
    compiled-remat   the same with ft.remat on each block

Each child builds the model and state, runs one warm-up step (the compile, for compiled variants),
then resets the peak RSS (``VmHWM``) and runs ``--steps`` more; the table gives the peak RSS of those
steps above the RSS just before them (activations, gradients and temporaries: the state itself is
excluded), and its ratio to the plain variant of the same mode. ``MALLOC_MMAP_THRESHOLD_=65536`` makes
freed tensors leave the RSS. Every child also writes the parameters after its steps; the parent
reports the largest difference between the remat and the plain variant (gradients equal -> 0 in
float64 eagerly; compiled graphs may order float sums differently).

Usage:
    python benchmarks/remat.py                    # writes benchmarks/results/remat.md
    python benchmarks/remat.py --variants eager-plain eager-remat --seq 256
"""

from __future__ import annotations

import argparse
import json
import os
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

VARIANTS = ("eager-plain", "eager-remat", "compiled-plain", "compiled-remat")


class Block(nn.Module):
    """A pre-norm transformer block (causal self-attention via SDPA, GELU MLP), no dropout."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int, remat: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        if remat:
            for block in self.blocks:
                ft.remat(block)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x)).flatten(0, 1)


def child(args: argparse.Namespace, variant: str, params_path: str) -> dict:
    torch.manual_seed(0)
    dtype = torch.float64 if args.float64 else torch.float32
    model = LM(args.vocab, args.d, args.heads, args.layers, args.seq, "remat" in variant).to(dtype)
    state = ft.TrainState.create(model, ft.optim.sgd(1e-2), copy=False)
    step = ft.jit(
        ft.make_train_step(model, ft.supervised_loss(F.cross_entropy)), compile=variant.startswith("compiled")
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = (tokens, torch.randint(0, args.vocab, (args.batch * args.seq,), generator=g))
    t0 = time.perf_counter()
    state, _ = step(state, batch)
    first_s = time.perf_counter() - t0
    before = common.rss_mb()
    resettable = common.reset_peak_rss()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, batch)
    step_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    peak = common.peak_rss_mb() if resettable else float("nan")
    torch.save({k: v.detach().clone() for k, v in state.params.items()}, params_path)
    return {
        "variant": variant,
        "step_extra_mb": peak - before,
        "state_rss_mb": before,
        "first_call_s": first_s,
        "step_ms": step_ms,
        "loss": float(metrics["loss"]),
        "num_compiles": step.num_compiles,
    }


def run_child(args: argparse.Namespace, variant: str, params_path: str) -> dict:
    return common.run_child(
        __file__,
        ["--child", variant, "--params-path", params_path, *args.forward],
        variant,
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS=str(args.threads),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--float64", action="store_true", help="exact gradient comparison (slower)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "remat.md"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--params-path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args, args.child, args.params_path)))
        return
    torch.set_num_threads(args.threads)  # what the children run with (reported in the header)
    args.forward = [
        f"--layers={args.layers}", f"--d={args.d}", f"--heads={args.heads}", f"--seq={args.seq}",
        f"--batch={args.batch}", f"--vocab={args.vocab}", f"--steps={args.steps}",
        *(["--float64"] if args.float64 else []),
    ]  # fmt: skip
    results, params = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            path = os.path.join(tmp, f"{variant}.pt")
            results[variant] = run_child(args, variant, path)
            params[variant] = torch.load(path, weights_only=True)
            print(json.dumps(results[variant]), flush=True)
    dtype = "float64" if args.float64 else "float32"
    lines = [
        f"# remat: peak memory of one training step ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Model: {args.layers}-layer pre-norm transformer, d_model {args.d}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, vocab {args.vocab}, {dtype}, SGD. Machine: {common.machine()}; load "
        f"{common.load_average()}. Command: `python benchmarks/remat.py {' '.join(args.forward)}`",
        "",
        "| variant | step peak above state (MB) | vs plain | state RSS (MB) | first call (s) | step (ms) | "
        "max param diff vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, r in results.items():
        plain = variant.replace("remat", "plain")
        ratio = r["step_extra_mb"] / results[plain]["step_extra_mb"] if plain in results else float("nan")
        diff = (
            max((params[variant][k] - params[plain][k]).abs().max().item() for k in params[plain])
            if plain in params
            else float("nan")
        )
        lines.append(
            f"| {variant} | {r['step_extra_mb']:.0f} | {ratio:.2f}x | {r['state_rss_mb']:.0f} | "
            f"{r['first_call_s']:.1f} | {r['step_ms']:.0f} | {diff:.1e} |"
        )
    common.write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
