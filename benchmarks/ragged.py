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


class _Rows(torch.utils.data.Dataset):
    """Examples ``(x, y)``, or ``{"input": x, "labels": y}`` (the layout of Hugging Face batches)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, as_dict: bool) -> None:
        self.x, self.y, self.as_dict = x, y, as_dict

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"input": self.x[i], "labels": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


def _data(workload: common.Workload, batches: int, remainder: int, as_dict: bool) -> _Rows:
    g = torch.Generator().manual_seed(0)
    xs, ys = zip(
        *(common.build_batch(workload) if i == 0 else workload.make_batch(g) for i in range(batches + 1))
    )
    x, y = torch.cat(xs), torch.cat(ys)
    n = batches * xs[0].shape[0] + remainder
    if y.shape[0] != x.shape[0]:  # per-token targets (the transformer): regroup per example
        y = y.reshape(x.shape[0], -1)
    return _Rows(x[:n], y[:n], as_dict)


def _own_loss(model, batch):
    """A loss function of one's own (padded: row 0 run once more to take the padding back out)."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y.reshape(-1)), {"preds": logits, "target": y.reshape(-1)}


def _labels_loss(model, batch):
    """A per-token loss on a dict batch with ``labels`` (padded: the padded rows' labels are -100)."""
    logits, labels = model(batch["input"]), batch["labels"].reshape(-1)
    return F.cross_entropy(logits, labels), {"preds": logits, "target": labels}


def _loss_fn(workload: str, loss: str):
    """``--loss default``: supervised_loss (per-example losses) for the MLP, labels for the transformer."""
    if loss == "own":
        return _own_loss
    return _labels_loss if workload == "transformer" else ft.supervised_loss(F.cross_entropy)


def _marked(batches, marked: bool):
    """The batches, the first one's tensors marked dynamic along dim 0 when ``marked``."""
    for batch in batches:
        if marked:
            for t in ft.tree.leaves(batch):
                torch._dynamo.mark_dynamic(t, 0)
            marked = False
        yield batch


class Runner:
    """One variant of one step over the ragged data: ``one_pass()`` (every batch, one sync at the end, the
    loop of ``evaluate``) and ``full_batch()`` (one full batch, synced)."""

    def __init__(
        self, workload_name: str, variant: str, kind: str, batches: int, remainder: int, loss: str
    ) -> None:
        workload = common.WORKLOADS[workload_name]
        model = common.build_model(workload)
        self.variant, self.kind = variant, kind
        self.size = common.build_batch(workload)[0].shape[0]
        self.state = ft.TrainState.create(model, ft.optim.adamw(common.LR), copy=False)
        padded = variant == "padded"
        if kind == "eval":
            step = ft.make_eval_step(model, _loss_fn(workload_name, loss)).replace(masked_batches=padded)
        else:
            step = ft.make_train_step(model, _loss_fn(workload_name, loss))
        dynamic = None if variant == "mark-dynamic" else False
        self.jitted = ft.jit(step, dynamic=dynamic, max_compiles=4)
        as_dict = loss == "default" and workload_name == "transformer"
        data = _data(workload, batches, remainder, as_dict)
        self.loader = Loader(data, self.size, shuffle=False, prefetch=0, pad_last=padded and kind == "train")
        full = next(iter(self.loader.epoch(0)))
        self.full = padding.pad_batch(full, self.size) if padded and kind == "eval" else full

    def one_pass(self) -> None:
        marked = self.variant == "mark-dynamic" and self.jitted.num_compiles == 0
        batches = _marked(self.loader.epoch(0), marked)
        if self.kind == "eval":
            total = torch.zeros(())
            for batch, real in padding.padded(batches, self.jitted.step.masked_batches, self.size):
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


def child_compile(workload: str, variant: str, kind: str, batches: int, remainder: int, loss: str) -> dict:
    """Compiles and compile seconds of one variant: its first pass, in a process of its own."""
    runner = Runner(workload, variant, kind, batches, remainder, loss)
    runner.one_pass()
    return {"compiles": runner.jitted.num_compiles, "compile_s": runner.jitted.compile_seconds}


def child_timing(workload: str, kind: str, batches: int, remainder: int, repeats: int, loss: str) -> dict:
    """Median ms of a whole pass and of a full batch per variant, compiled, timed interleaved in one process
    (each repeat runs every variant in turn, in a rotated order)."""
    runners = {}
    for variant in VARIANTS:
        runner = Runner(workload, variant, kind, batches, remainder, loss)
        try:
            runner.one_pass()  # compiles
        except Exception as e:  # reported by the compile child; left out of the timing
            print(f"{variant}: {type(e).__name__}", file=sys.stderr)
            continue
        runners[variant] = runner
    times: dict[str, dict[str, list[float]]] = {v: {"pass": [], "full": []} for v in runners}
    names = tuple(runners)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
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
        for option in ("batches", "remainder", "repeats", "loss"):
            argv += [f"--{option}", str(getattr(args, option))]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        errors = [line for line in out.stderr.splitlines() if "Error" in line and ":" in line]
        print(f"{' '.join(child)} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
        # the innermost message: dynamo wraps it as "... got RuntimeError('<message>\n<C++ frames>')"
        error = (errors or ["failed"])[-1].split(" got ")[-1].split("\\n")[0].strip()
        return {"error": error[:120]}
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
    parser.add_argument(
        "--loss",
        default="default",
        choices=("default", "own"),
        help="default: supervised_loss for the MLP (per-example losses), a dict batch with labels for the "
        "transformer (-100 on padded rows); own: a loss function of one's own (row 0 run once more)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="cold compiles per variant (median)")
    parser.add_argument("--child", nargs="+", metavar="ARG")
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "compile":
            result = child_compile(*rest, args.batches, args.remainder, args.loss)
        else:
            result = child_timing(*rest, args.batches, args.remainder, args.repeats, args.loss)
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
            failed = {v: c[0]["error"] for v, c in compiles.items() if "error" in c[0]}
            seconds = {
                v: statistics.median(c["compile_s"] for c in compiles[v]) for v in VARIANTS if v not in failed
            }
            base, base_s = timing["padded"], seconds["padded"]
            for variant in VARIANTS:
                if variant in failed:
                    rows.append(
                        f"| {workload} | {kind} | {variant} | does not compile: `{failed[variant]}` |||||||"
                    )
                    print(rows[-1], flush=True)
                    continue
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
        f"--repeats {args.repeats} --rounds {args.rounds} --loss {args.loss}`; torch {torch.__version__}, {device}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}.\n\n"
    )
    args.out.write_text(header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
