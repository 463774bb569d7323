"""A ragged last batch: pad it to the compiled shape with a mask, or mark the batch dimension dynamic?

An evaluation set that is not a multiple of the batch size ends with a short batch. Variants, each over
the same data (``--batches`` full batches and one of ``--remainder`` examples), the same weights:

    static        the status quo: jit(eval_step), unpadded; the short batch compiles a second graph
    padded        functrain's choice: evaluate() pads the short batch to the batch size with a validity
                  mask (functrain.data.padding): one graph at one shape
    mark-dynamic  torch._dynamo.mark_dynamic(x, 0) on the first batch's tensors, jit(..., dynamic=None):
                  one graph with a symbolic batch size

and the same three for a training epoch (``train-*``: ``Loader(pad_last=True)`` for the padded one).
Each variant runs in a fresh child process with an empty inductor cache, so compile time is cold and no
variant profits from another's cache. Reported: compiles, compile seconds (``CompiledStep``), the
median ms of a full batch after compiling, and the whole pass (every batch, compiled already); ratios
against ``padded`` of the same run.

Usage:
    python benchmarks/ragged.py                         # mlp; writes benchmarks/results/ragged.md
    python benchmarks/ragged.py --workloads mlp transformer --repeats 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

import functrain as ft
from functrain.data import Loader, padding

VARIANTS = ("static", "padded", "mark-dynamic")
KINDS = ("eval", "train")


def _data(workload: common.Workload, batches: int, remainder: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    xs, ys = zip(
        *(common.build_batch(workload) if i == 0 else workload.make_batch(g) for i in range(batches + 1))
    )
    x, y = torch.cat(xs), torch.cat(ys)
    size = xs[0].shape[0]
    n = batches * size + remainder
    if y.shape[0] != x.shape[0]:  # per-token targets (the transformer): regroup per example
        y = y.reshape(x.shape[0], -1)
    return torch.utils.data.TensorDataset(x[:n], y[:n])


def _loss(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y.reshape(-1)), {"preds": logits, "target": y.reshape(-1)}


def _marked(batches, marked: bool):
    """The batches, the first one's tensors marked dynamic along dim 0 when ``marked``."""
    for batch in batches:
        if marked:
            for t in batch:
                torch._dynamo.mark_dynamic(t, 0)
            marked = False
        yield batch


def child(workload_name: str, variant: str, kind: str, batches: int, remainder: int, repeats: int) -> dict:
    workload = common.WORKLOADS[workload_name]
    model = common.build_model(workload)
    data = _data(workload, batches, remainder)
    size = common.build_batch(workload)[0].shape[0]
    state = ft.TrainState.create(model, ft.optim.adamw(common.LR), copy=False)
    dynamic = None if variant == "mark-dynamic" else False
    padded = variant == "padded"
    if kind == "eval":
        step = ft.make_eval_step(model, _loss)
        step.masked_batches = padded
    else:
        step = ft.make_train_step(model, _loss)
    jitted = ft.jit(step, dynamic=dynamic, max_compiles=4)
    loader = Loader(data, size, shuffle=False, prefetch=0, pad_last=padded and kind == "train")

    def one_pass() -> None:
        # The same loop for every variant (evaluate()'s: the loss summed on the device, one sync).
        nonlocal state
        batches = _marked(loader.epoch(0), variant == "mark-dynamic" and jitted.num_compiles == 0)
        if kind == "eval":
            total = torch.zeros(())
            for batch, real in padding.padded(batches, jitted, size):
                out = jitted(state, batch)
                total = total + out["loss"] * (real if real is not None else out["num_examples"])
            total.item()
        else:
            for batch in batches:
                state, metrics = jitted(state, batch)
            metrics["loss"].item()

    started = time.perf_counter()
    one_pass()  # compiles
    first_pass = time.perf_counter() - started
    passes = []
    for _ in range(repeats):
        started = time.perf_counter()
        one_pass()
        passes.append(time.perf_counter() - started)
    full = next(iter(loader.epoch(0)))
    if padded and kind == "eval":
        full = padding.pad_batch(full, size)  # the padded stream's structure: no new graph
    per_batch = []
    for _ in range(repeats * 4):
        started = time.perf_counter()
        out = jitted(state, full)
        (out["loss"] if kind == "eval" else out[1]["loss"]).item()
        if kind == "train":
            state = out[0]
        per_batch.append(time.perf_counter() - started)
    return {
        "compiles": jitted.num_compiles,
        "compile_s": jitted.compile_seconds,
        "first_pass_s": first_pass,
        "pass_ms": 1000 * statistics.median(passes),
        "full_batch_ms": 1000 * statistics.median(per_batch),
    }


def run_child(workload: str, variant: str, kind: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ragged-bench-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
        argv = [sys.executable, __file__, "--child", workload, variant, kind]
        argv += [
            "--batches",
            str(args.batches),
            "--remainder",
            str(args.remainder),
            "--repeats",
            str(args.repeats),
        ]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{workload}/{kind}/{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", default=["mlp"], choices=sorted(common.WORKLOADS))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--batches", type=int, default=8, help="full batches before the short one")
    parser.add_argument("--remainder", type=int, default=5, help="examples in the short last batch")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ragged.md")
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "VARIANT", "KIND"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.batches, args.remainder, args.repeats)))
        return
    rows = [
        "| workload | step | variant | compiles | compile s | x padded | full batch ms | x padded "
        "| whole pass ms | x padded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in args.workloads:
        for kind in args.kinds:
            results = {v: run_child(workload, v, kind, args) for v in VARIANTS}
            base = results["padded"]
            for variant, r in results.items():
                rows.append(
                    f"| {workload} | {kind} | {variant} | {r['compiles']} | {r['compile_s']:.1f} | "
                    f"{r['compile_s'] / base['compile_s']:.2f} | {r['full_batch_ms']:.2f} | "
                    f"{r['full_batch_ms'] / base['full_batch_ms']:.2f} | {r['pass_ms']:.1f} | "
                    f"{r['pass_ms'] / base['pass_ms']:.2f} |"
                )
                print(rows[-1], flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    header = (
        f"# Ragged last batch: padded vs mark_dynamic vs recompiling\n\n`python benchmarks/ragged.py "
        f"--workloads {' '.join(args.workloads)} --batches {args.batches} --remainder {args.remainder} "
        f"--repeats {args.repeats}`; torch {torch.__version__}, {device}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}.\n\n"
    )
    args.out.write_text(header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
