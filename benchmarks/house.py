"""Two source trees of functrain side by side: step time, fit overhead, cold and warm compile (issue #32).

Each measurement runs in a fresh subprocess with ``PYTHONPATH`` set to one tree; the trees alternate
(before, after, before, after, ...) so that a machine's load drifts over both alike, and the table gives
each tree's median and the after/before ratio. One thread (``torch.set_num_threads(1)``).

    eager-mlp / eager-cnn   ms per eager train step (make_train_step, no jit): MLP 64-256-256-10,
                            a BatchNorm CNN on 8x8 images; batch 64, AdamW
    jit-mlp                 ms per compiled step (ft.jit, inductor), after its compile
    fit-eager / fit-jit     fit's host cost per step: ms per step of ft.fit over 200 steps (no eval, no
                            bar, no checkpoints; after a 5-step fit) minus the same step called in a bare loop
    cold / warm             seconds from the first call to its return for the MLP's jit step, on an
                            empty inductor cache dir (cold) and on the cache the cold run left (warm)

Usage:
    git worktree add /tmp/before 2cb5df7
    python benchmarks/house.py --before /tmp/before --after . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import functrain as ft
from torch import nn

what = sys.argv[1]
torch.manual_seed(0)
if what.endswith("cnn"):
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 64, 10))
    x = torch.randn(64, 1, 8, 8)
else:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(64, 64)
y = torch.randint(0, 10, (64,))
state = ft.TrainState.create(model, ft.optim.adamw(1e-3))
step = ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy))
if what.startswith(("jit", "cold", "warm")) or what == "fit-jit":
    step = ft.jit(step)


def per_step(n):
    global state
    for _ in range(5):
        state, m = step(state, (x, y))
    m["loss"].item()
    t = time.perf_counter()
    for _ in range(n):
        state, m = step(state, (x, y))
    m["loss"].item()
    return (time.perf_counter() - t) / n * 1e3


if what in ("cold", "warm"):
    t = time.perf_counter()
    state, m = step(state, (x, y))
    m["loss"].item()
    print(json.dumps(time.perf_counter() - t))
elif what.startswith("fit"):
    n = 200
    data = torch.utils.data.TensorDataset(x.repeat(n, *[1] * (x.ndim - 1)), y.repeat(n))
    bare = per_step(n)
    kw = dict(batch_size=64, eval_every=None, progress_bar=False, log_steps=n)
    ft.fit(state, step, data, additional_steps=5, **kw)  # its batches' first compile (if any) and imports
    t = time.perf_counter()
    ft.fit(state, step, data, additional_steps=n, **kw)
    print(json.dumps((time.perf_counter() - t) / n * 1e3 - bare))
else:
    print(json.dumps(per_step(300)))
"""

MEASURES = ("eager-mlp", "eager-cnn", "jit-mlp", "fit-eager", "fit-jit", "cold", "warm")


def run(tree: Path, what: str, cache: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, what],
        env=env,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    if out.returncode:
        raise RuntimeError(f"{what} on {tree}: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def rounds(args: argparse.Namespace, trees: dict[str, Path], results: dict, scratch: str) -> None:
    """``args.rounds`` rounds of every measure, the trees alternating, cache dirs under ``scratch``."""
    for r in range(args.rounds):
        caches = {side: tempfile.mkdtemp(prefix=f"{side}-", dir=scratch) for side in trees}  # cold, then warm
        for what in args.measures:
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                shared = caches[side] if what in ("cold", "warm") else tempfile.mkdtemp(dir=scratch)
                results[what][side].append(run(trees[side], what, shared))
        last = {w: {k: v[-1] for k, v in sides.items()} for w, sides in results.items()}
        print(f"round {r + 1}/{args.rounds}: {json.dumps(last)}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measures", nargs="+", default=list(MEASURES), choices=MEASURES)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, dict[str, list[float]]] = {m: {"before": [], "after": []} for m in args.measures}
    scratch = tempfile.mkdtemp(prefix="house-")  # every cache dir lives here, removed at the end
    try:
        rounds(args, trees, results, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("| measure | before (median) | after (median) | after / before |")
    print("|---|---|---|---|")
    for what, sides in results.items():
        b, a = statistics.median(sides["before"]), statistics.median(sides["after"])
        unit = "s" if what in ("cold", "warm") else "ms"
        print(f"| {what} | {b:.3f} {unit} | {a:.3f} {unit} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
