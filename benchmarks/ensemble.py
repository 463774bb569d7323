"""Ensembles: N members trained by one vmapped compiled step against N sequential single-model steps.

For each workload (the steps benchmark's MLP and CNN, and a tiny MLP) and each member count N, two
variants train N models on the same batch (AdamW lr 1e-3, wd 0.01), so both process N x batch examples
per round (``--donate``: both variants donate their input state):

    vmap        one ``functrain.jit(functrain.ensemble.step(train_step))`` call on a stacked state of N
                members (one compiled graph for all of them)
    sequential  N calls of one ``functrain.jit(train_step)`` (compiled once), one per member's state

Timing is interleaved in this one process: each repeat times ``--steps`` rounds of both variants, in an
order that alternates between repeats; the table gives the median speed-up (sequential ms / vmap ms, per
repeat) with its interquartile range and the throughput of each variant in examples/s. Memory: the
state's size (params, AdamW moments) and the transient peak of a step (``VmHWM`` reset just before
``--steps`` steps, minus the RSS before them, with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave
the RSS); both variants hold N members' states, the peak is what the step adds on top.

Usage:
    python benchmarks/ensemble.py                              # writes benchmarks/results/ensemble.md
    python benchmarks/ensemble.py --workloads mlp --members 1 8 --repeats 10 --donate
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # freed tensors must leave the RSS (memory column)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

import functrain as ft

LOSS = ft.supervised_loss(F.cross_entropy)


def _tiny_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)


# Besides the steps benchmark's workloads: a model small enough that a step's fixed cost (the Python call,
# guards, kernel launches) is a large part of it, the case an ensemble step amortises.
WORKLOADS = {
    **common.WORKLOADS,
    "mlp-tiny": common.Workload("mlp-tiny", "MLP 64-64-10, batch 64", lambda: common.MLP(64, 2), _tiny_batch),
}


def _tx() -> ft.optim.GradientTransformation:
    return ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY)


def make_vmap(
    workload: common.Workload, n: int, donate: bool = False
) -> tuple[Callable[[], None], ft.CompiledStep, ft.TrainState]:
    model = common.build_model(workload)
    batch = common.build_batch(workload)
    state = ft.ensemble.create(model, _tx(), n=n)
    step = ft.jit(ft.ensemble.step(ft.make_train_step(model, LOSS)), donate=donate)
    box = [state]

    def run() -> None:
        box[0], _ = step(box[0], batch)

    return run, step, state


def make_sequential(
    workload: common.Workload, n: int, step: ft.CompiledStep | None = None, donate: bool = False
) -> tuple[Callable[[], None], ft.CompiledStep, list[ft.TrainState]]:
    model = common.build_model(workload)
    batch = common.build_batch(workload)
    states = [ft.TrainState.create(ft.ensemble.initialise(model, i), _tx(), seed=i) for i in range(n)]
    step = step or ft.jit(ft.make_train_step(model, LOSS), donate=donate)

    def run() -> None:
        for i in range(n):
            states[i], _ = step(states[i], batch)

    return run, step, states


def transient_peak_mb(fn: Callable[[], None], steps: int) -> float:
    gc.collect()
    before = common.rss_mb()
    if not common.reset_peak_rss():
        return float("nan")
    for _ in range(steps):
        fn()
    return common.peak_rss_mb() - before


def measure(
    workload: common.Workload,
    n: int,
    repeats: int,
    steps: int,
    sequential_step: ft.CompiledStep | None,
    donate: bool = False,
) -> dict:
    vmap_fn, vmap_step, state = make_vmap(workload, n, donate)
    seq_fn, seq_step, _ = make_sequential(workload, n, sequential_step, donate)
    t0 = time.perf_counter()
    for _ in range(2):
        vmap_fn()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        seq_fn()
    times = common.interleaved({"vmap": vmap_fn, "sequential": seq_fn}, repeats, steps)
    vmap_ms, seq_ms = times["vmap"], times["sequential"]
    ratios = [s / v for v, s in zip(vmap_ms, seq_ms)]
    if vmap_step.num_compiles != 1:
        print(
            f"warning: {workload.name} N={n}: the vmapped step compiled {vmap_step.num_compiles} times",
            file=sys.stderr,
        )
    examples = n * common.build_batch(workload)[0].shape[0]
    return {
        "n": n,
        "vmap_ms": common.median_spread(vmap_ms),
        "seq_ms": common.median_spread(seq_ms),
        "ratio": common.median_spread(ratios),
        "examples": examples,
        "state_mb": ft.tree.num_bytes(state) / 2**20,
        "vmap_peak_mb": transient_peak_mb(vmap_fn, steps),
        "seq_peak_mb": transient_peak_mb(seq_fn, steps),
        "vmap_compile_s": compile_s,
        "seq_step": seq_step,
    }


def table(workload: common.Workload, rows: list[dict]) -> str:
    lines = [
        f"### {workload.name}: {workload.description}",
        "",
        "| members | vmap ms/round | sequential ms/round | speed-up (IQR) | vmap ex/s | sequential ex/s "
        "| state MB | step peak MB vmap | step peak MB sequential | vmap compile s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        v, s, q = r["vmap_ms"], r["seq_ms"], r["ratio"]
        lines.append(
            f"| {r['n']} | {v[0]:.2f} | {s[0]:.2f} | **{q[0]:.2f}x** ({q[1]:.2f}-{q[2]:.2f}) "
            f"| {r['examples'] / v[0] * 1e3:,.0f} | {r['examples'] / s[0] * 1e3:,.0f} | {r['state_mb']:.1f} "
            f"| {r['vmap_peak_mb']:.1f} | {r['seq_peak_mb']:.1f} | {r['vmap_compile_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "mlp-tiny"])
    p.add_argument("--members", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=5, help="rounds per timed repeat")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the shared 2-core machine)")
    p.add_argument("--donate", action="store_true", help="both variants donate (jit(..., donate=True))")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ensemble.md"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    started = time.strftime("%Y-%m-%d %H:%M")
    load_start = common.load_average()
    sections = []
    for name in args.workloads:
        workload = WORKLOADS[name]
        rows: list[dict] = []
        sequential_step = None
        for n in args.members:
            print(
                f"{name} N={n}: {args.repeats} x {args.steps} rounds (load {common.load_average()})",
                flush=True,
            )
            row = measure(workload, n, args.repeats, args.steps, sequential_step, args.donate)
            sequential_step = row["seq_step"]  # one compiled single-model step serves every N
            rows.append(row)
            print(table(workload, rows[-1:]).splitlines()[-1], flush=True)
        sections.append(table(workload, rows))
    text = "\n\n".join(
        [
            f"Run {started}, load average {load_start} at the start, {common.load_average()} at the end; "
            f"{common.machine()}",
            f"Command: python benchmarks/ensemble.py {' '.join(sys.argv[1:])}".rstrip(),
            *sections,
        ]
    )
    common.write_report(text, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
