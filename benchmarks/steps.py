"""ms/step, compile time and peak memory: plain PyTorch loops against functrain's compiled steps.

Variants (each on its own copy of the same initial weights, the same batch, AdamW lr 1e-3, wd 0.01):

    eager-foreach   model(x), loss.backward(), torch.optim.AdamW(foreach=True)
    eager-fused     the same with torch.optim.AdamW(fused=True)
    compile-fused   torch.compile(model) with fused AdamW (the optimizer runs eagerly)
    ft-jit          functrain.jit(make_train_step(...)): forward, backward and AdamW in one graph
    ft-donate       the same with jit(..., donate=True): results written into the incoming state
    ft-jit-in-graph, ft-donate-in-graph
                    the same two with ``adamw(..., fused=False)``: AdamW as foreach ops that inductor
                    fuses into the backward, instead of torch's fused kernel as one opaque op (not run
                    by default; ``--variants``)

Timing runs every variant of a workload in this one process, interleaved: each repeat times
``--steps`` consecutive steps of every variant in turn (in a rotated order), and the table gives the
median over repeats with the interquartile range. Compile time and memory are measured in a fresh
child process per variant: compile time cold (an empty ``TORCHINDUCTOR_CACHE_DIR``) and warm (the same
cache directory again, in a new process); memory as the child's peak RSS over the whole run and as the
peak during steady-state steps (``VmHWM`` reset after warm-up) above the RSS before the model existed,
with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the RSS. functrain's states are built
with ``TrainState.create(..., copy=False)``: they share the model's weights instead of copying them.

Usage:
    python benchmarks/steps.py                       # all workloads, writes benchmarks/results/steps.md
    python benchmarks/steps.py --workloads mlp --repeats 10 --no-children
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

VARIANTS = ("eager-foreach", "eager-fused", "compile-fused", "ft-jit", "ft-donate")
BASELINES = ("eager-foreach", "eager-fused", "compile-fused")
COMPILED = ("compile-fused", "ft-jit", "ft-donate", "ft-jit-in-graph", "ft-donate-in-graph")


def make_variant(name: str, workload: common.Workload, jit_kwargs: dict | None = None) -> Callable[[], None]:
    """A zero-argument callable running one training step of ``name`` on ``workload``'s fixed batch."""
    model = common.build_model(workload)
    x, y = common.build_batch(workload)
    model.train()
    if name in BASELINES:
        fused = name != "eager-foreach"
        opt = torch.optim.AdamW(
            model.parameters(), lr=common.LR, weight_decay=common.WEIGHT_DECAY,
            foreach=not fused, fused=fused,
        )  # fmt: skip
        forward = torch.compile(model) if name == "compile-fused" else model

        def torch_step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(forward(x), y)
            loss.backward()
            opt.step()

        return torch_step

    import functrain as ft

    tx = ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY, fused=not name.endswith("-in-graph"))
    return common.ft_step_fn(
        model, F.cross_entropy, (x, y), donate=name.startswith("ft-donate"), jit_kwargs=jit_kwargs, tx=tx
    )


# ------------------------------------------------------------------------------------------ timing


def time_workload(
    workload: common.Workload, variants: list[str], repeats: int, steps: int, jit_kwargs: dict | None
) -> dict[str, list[float]]:
    fns = {}
    for v in variants:
        fns[v] = make_variant(v, workload, jit_kwargs)
        for _ in range(3):  # compile and warm up
            fns[v]()
    times = common.interleaved(fns, repeats, steps)
    for v, fn in fns.items():
        compiled = getattr(fn, "compiled", None)
        if compiled is not None and compiled.num_compiles != 1:
            print(f"warning: {workload.name}/{v} compiled {compiled.num_compiles} times", file=sys.stderr)
    return times


# ------------------------------------------------------------------------------------------ children


def child(workload_name: str, variant: str, steps: int, jit_kwargs: dict | None) -> dict:
    """Run in a fresh process: first-step (compile) time and memory of one variant."""
    import torch._inductor.compile_fx  # noqa: F401  (every variant pays the import before the baseline)

    workload = common.WORKLOADS[workload_name]
    base_rss = common.rss_mb()
    fn = make_variant(variant, workload, jit_kwargs)
    t0 = time.perf_counter()
    fn()
    first_s = time.perf_counter() - t0
    for _ in range(2):
        fn()
    # VmHWM, not getrusage's ru_maxrss: that one survives fork+exec and reports the parent's peak.
    startup_peak = common.peak_rss_mb()
    resettable = common.reset_peak_rss()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    step_s = (time.perf_counter() - t0) / steps
    steady_peak = common.peak_rss_mb() if resettable else float("nan")

    return {
        "compile_s": first_s - step_s,
        "max_rss_mb": max(startup_peak, common.peak_rss_mb()),
        "steady_peak_mb": steady_peak - base_rss,
    }


def run_child(workload: str, variant: str, cache_dir: str, steps: int, jit_kwargs: dict | None) -> dict:
    # Every allocation of 64 KiB or more gets its own mapping, returned to the system when freed: the
    # RSS then follows the live tensors (glibc's default keeps freed blocks, so a peak would partly be
    # its heap). The same for every variant.
    cmd = ["--child", workload, variant, "--steps", str(steps), "--threads", str(torch.get_num_threads())]
    if jit_kwargs:
        cmd += ["--jit-kwargs", json.dumps(jit_kwargs)]
    return common.run_child(
        __file__,
        cmd,
        f"child {workload}/{variant}",
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        MALLOC_MMAP_THRESHOLD_="65536",
    )


def measure_children(
    workload: str, variants: list[str], steps: int, jit_kwargs: dict | None
) -> dict[str, dict]:
    results = {}
    for v in variants:
        with tempfile.TemporaryDirectory(prefix="functrain-inductor-") as cache:
            cold = run_child(workload, v, cache, steps, jit_kwargs)
            warm = run_child(workload, v, cache, steps, jit_kwargs)
        results[v] = {"cold": cold, "warm": warm}
        print(
            f"  {workload}/{v}: compile cold {cold['compile_s']:.1f}s warm {warm['compile_s']:.1f}s, "
            f"max RSS {warm['max_rss_mb']:.0f} MB, steady peak {warm['steady_peak_mb']:.0f} MB",
            flush=True,
        )
    return results


# ------------------------------------------------------------------------------------------ report


def timing_table(workload: common.Workload, times: dict[str, list[float]], children: dict | None) -> str:
    spreads = {v: common.median_spread(ts) for v, ts in times.items()}
    best_baseline = min((spreads[v][0] for v in BASELINES if v in spreads), default=None)
    header = "| variant | ms/step (median) | IQR | vs best of (a)-(c) |"
    sep = "|---|---:|---:|---:|"
    if children:
        header += " compile cold s | compile warm s | max RSS MB | steady peak MB |"
        sep += "---:|---:|---:|---:|"
    rows = [f"**{workload.name}** — {workload.description}", "", header, sep]
    for v, (med, lo, hi) in spreads.items():
        ratio = f"{med / best_baseline:.2f}x" if best_baseline else "-"
        row = f"| {v} | {med:.2f} | {lo:.2f}–{hi:.2f} | {ratio} |"
        if children and v in children:
            c = children[v]
            comp = v in COMPILED
            row += (f" {c['cold']['compile_s']:.1f} |" if comp else " - |") + (
                f" {c['warm']['compile_s']:.1f} |" if comp else " - |"
            )
            row += f" {c['warm']['max_rss_mb']:.0f} | {c['warm']['steady_peak_mb']:.0f} |"
        rows.append(row)
    return "\n".join(rows)


def memory_table(workload: str, children: dict) -> str:
    ref = children.get("eager-fused", {}).get("warm")
    rows = [
        f"**{workload}** — {common.WORKLOADS[workload].description} (memory only)", "",
        "| variant | max RSS MB | vs eager-fused | steady peak MB | vs eager-fused |",
        "|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for v, c in children.items():
        w = c["warm"]
        r1 = f"{w['max_rss_mb'] / ref['max_rss_mb']:.2f}x" if ref else "-"
        r2 = f"{w['steady_peak_mb'] / ref['steady_peak_mb']:.2f}x" if ref else "-"
        rows.append(f"| {v} | {w['max_rss_mb']:.0f} | {r1} | {w['steady_peak_mb']:.0f} | {r2} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "transformer"])
    p.add_argument("--memory-workloads", nargs="*", default=["mlp-25m"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--steps", type=int, default=10, help="steps per timed repeat (and per child)")
    p.add_argument("--no-children", action="store_true", help="skip compile-time and memory children")
    p.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: on a shared 2-core machine two OpenMP threads thrash, 5-20x slower)",
    )  # fmt: skip
    p.add_argument("--jit-kwargs", default=None, help="JSON dict passed to functrain.jit (experiments)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "steps.md"))
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    jit_kwargs = json.loads(args.jit_kwargs) if args.jit_kwargs else None
    torch.set_num_threads(args.threads)

    if args.child:
        print(json.dumps(child(*args.child, args.steps, jit_kwargs)))
        return

    started = time.strftime("%Y-%m-%d %H:%M")
    sections = []
    for name in args.workloads:
        workload = common.WORKLOADS[name]
        print(
            f"{name}: timing {args.repeats} x {args.steps} steps per variant (load {common.load_average()})",
            flush=True,
        )
        times = time_workload(workload, args.variants, args.repeats, args.steps, jit_kwargs)
        children = None if args.no_children else measure_children(name, args.variants, args.steps, jit_kwargs)
        table = timing_table(workload, times, children)
        print(table + "\n", flush=True)
        sections.append(table)
    if not args.no_children:
        for name in args.memory_workloads:
            print(f"{name}: memory children", flush=True)
            table = memory_table(name, measure_children(name, args.variants, args.steps, jit_kwargs))
            print(table + "\n", flush=True)
            sections.append(table)
    text = "\n\n".join(
        [
            f"Run {started}, load average at the end {common.load_average()}; {common.machine()}",
            f"Command: python benchmarks/steps.py {' '.join(sys.argv[1:])}".rstrip(),
            *sections,
        ]
    )
    common.write_report(text, args.out, echo=False)


if __name__ == "__main__":
    main()
