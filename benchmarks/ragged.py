"""A ragged last batch: pad it to the compiled shape with a mask, or mark the batch dimension dynamic?

An evaluation set that is not a multiple of the batch size ends with a short batch. Variants, each over
the same data (``--batches`` full batches and one of ``--remainder`` examples), the same weights:

    static        the status quo: jit(eval_step), unpadded; the short batch compiles a second graph
    padded        functrain's choice: evaluate() pads the short batch to the batch size with a validity
                  mask (functrain.data.padding): one graph at one shape
    mark-dynamic  torch._dynamo.mark_dynamic(x, 0) on the first batch's tensors, jit(..., dynamic=None):
                  one graph with a symbolic batch size

and the same three for a training epoch (``train-*``: ``Loader(pad_last=True)`` for the padded one).
Compile seconds (``CompiledStep.compile_seconds``, all compiles of a pass) are measured cold: each
variant in a fresh child process with an empty inductor cache, ``--rounds`` times in a rotated order,
median. Step times are measured in one child with all three variants compiled, interleaved (each repeat
runs every variant in turn, rotated), median: ms of one full batch and of a whole pass (every batch, one
sync at the end). Ratios are against ``padded`` of the same run.

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


class Runner:
    """One variant of one step over the ragged data: ``one_pass()`` (every batch, one sync at the end, the
    loop of ``evaluate``) and ``full_batch()`` (one full batch, synced)."""

    def __init__(self, workload_name: str, variant: str, kind: str, batches: int, remainder: int) -> None:
        workload = common.WORKLOADS[workload_name]
        model = common.build_model(workload)
        self.variant, self.kind = variant, kind
        self.size = common.build_batch(workload)[0].shape[0]
        self.state = ft.TrainState.create(model, ft.optim.adamw(common.LR), copy=False)
        padded = variant == "padded"
        if kind == "eval":
            step = ft.make_eval_step(model, _loss)
            step.masked_batches = padded
        else:
            step = ft.make_train_step(model, _loss)
        dynamic = None if variant == "mark-dynamic" else False
        self.jitted = ft.jit(step, dynamic=dynamic, max_compiles=4)
        data = _data(workload, batches, remainder)
        self.loader = Loader(data, self.size, shuffle=False, prefetch=0, pad_last=padded and kind == "train")
        full = next(iter(self.loader.epoch(0)))
        self.full = padding.pad_batch(full, self.size) if padded and kind == "eval" else full

    def one_pass(self) -> None:
        marked = self.variant == "mark-dynamic" and self.jitted.num_compiles == 0
        batches = _marked(self.loader.epoch(0), marked)
        if self.kind == "eval":
            total = torch.zeros(())
            for batch, real in padding.padded(batches, self.jitted, self.size):
                out = self.jitted(self.state, batch)
                total = total + out["loss"] * (real if real is not None else out["num_examples"])
            total.item()
        else:
            for batch in batches:
                self.state, metrics = self.jitted(self.state, batch)
            metrics["loss"].item()

    def full_batch(self) -> None:
        out = self.jitted(self.state, self.full)
        if self.kind == "train":
            self.state, out = out
        out["loss"].item()


def child_compile(workload: str, variant: str, kind: str, batches: int, remainder: int) -> dict:
    """Compiles and compile seconds of one variant: its first pass, in a process of its own."""
    runner = Runner(workload, variant, kind, batches, remainder)
    runner.one_pass()
    return {"compiles": runner.jitted.num_compiles, "compile_s": runner.jitted.compile_seconds}


def child_timing(workload: str, kind: str, batches: int, remainder: int, repeats: int) -> dict:
    """Median ms of a whole pass and of a full batch per variant, compiled, timed interleaved in one process
    (each repeat runs every variant in turn, in a rotated order)."""
    runners = {v: Runner(workload, v, kind, batches, remainder) for v in VARIANTS}
    for runner in runners.values():
        runner.one_pass()  # compiles
    times: dict[str, dict[str, list[float]]] = {v: {"pass": [], "full": []} for v in VARIANTS}
    for r in range(repeats):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            for what, run, calls in (
                ("pass", runners[variant].one_pass, 1),
                ("full", runners[variant].full_batch, 4),
            ):
                started = time.perf_counter()
                for _ in range(calls):
                    run()
                times[variant][what].append((time.perf_counter() - started) / calls)
    return {
        v: {
            "pass_ms": 1000 * statistics.median(t["pass"]),
            "full_batch_ms": 1000 * statistics.median(t["full"]),
        }
        for v, t in times.items()
    }


def run_child(args: argparse.Namespace, *child: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ragged-bench-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
        argv = [sys.executable, __file__, "--child", *child]
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
        raise RuntimeError(f"{' '.join(child)} failed:\n{out.stderr[-3000:]}")
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
    parser.add_argument("--rounds", type=int, default=2, help="cold compiles per variant (median)")
    parser.add_argument("--child", nargs="+", metavar="ARG")
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "compile":
            result = child_compile(*rest, args.batches, args.remainder)
        else:
            result = child_timing(*rest, args.batches, args.remainder, args.repeats)
        print(json.dumps(result))
        return
    rows = [
        "| workload | step | variant | compiles | compile s | x padded | full batch ms | x padded "
        "| whole pass ms | x padded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in args.workloads:
        for kind in args.kinds:
            compiles: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for r in range(args.rounds):  # cold compiles, each in its own process, rotated order
                for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                    compiles[variant].append(run_child(args, "compile", workload, variant, kind))
            timing = run_child(args, "timing", workload, kind)
            seconds = {v: statistics.median(c["compile_s"] for c in compiles[v]) for v in VARIANTS}
            base, base_s = timing["padded"], seconds["padded"]
            for variant in VARIANTS:
                r = timing[variant]
                rows.append(
                    f"| {workload} | {kind} | {variant} | {compiles[variant][0]['compiles']} | "
                    f"{seconds[variant]:.1f} | {seconds[variant] / base_s:.2f} | {r['full_batch_ms']:.2f} | "
                    f"{r['full_batch_ms'] / base['full_batch_ms']:.2f} | {r['pass_ms']:.1f} | "
                    f"{r['pass_ms'] / base['pass_ms']:.2f} |"
                )
                print(rows[-1], flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    header = (
        f"# Ragged last batch: padded vs mark_dynamic vs recompiling\n\n`python benchmarks/ragged.py "
        f"--workloads {' '.join(args.workloads)} --batches {args.batches} --remainder {args.remainder} "
        f"--repeats {args.repeats} --rounds {args.rounds}`; torch {torch.__version__}, {device}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}.\n\n"
    )
    args.out.write_text(header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
