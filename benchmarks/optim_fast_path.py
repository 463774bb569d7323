"""The optimizers' fast path where nothing differentiates through them: this checkout against a baseline.

Differentiable training (tests/test_differentiable_training.py) made every ``functrain.core.foreach`` op
and Adam's fused ``apply`` first check whether an argument requires a gradient, and run leaf by leaf
only then. This measures what the checks cost where nothing does, as ratios baseline / this (> 1: this
checkout is faster), each row's two sides in fresh processes, interleaved round by round:

    eager     make_train_step(...) called directly: ms per step (median of the child's repeats)
    compiled  functrain.jit(make_train_step(...)) with inductor: ms per step, and the first call's cold
              compile (an empty TORCHINDUCTOR_CACHE_DIR), in seconds
    update    optim.apply_gradients alone, eagerly, on 200 leaves of 64 floats (where the per-op checks
              weigh most): ms per update
    trace     dynamo's trace of that update on 300 leaves (``backend="eager"``: tracing only, where the
              checks are interpreted once per leaf and op): CPU seconds of the first call

Workload: benchmarks/_common.py's MLP 512-512-512-10, batch 256; AdamW (lr 1e-3, wd 0.01; torch's
fused kernel by default) and SGD with momentum 0.9 (foreach ops). One thread per process.

Usage:
    git archive main | tar -x -C /tmp/base     # the baseline: any checkout of functrain
    python benchmarks/optim_fast_path.py --baseline /tmp/base [--rounds 3] [--no-compile]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("adamw", "sgd-momentum")


def _tx(name: str):  # type: ignore[no-untyped-def]
    from functrain import optim

    if name == "adamw":
        return optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY)
    return optim.sgd(common.LR, momentum=0.9)


def _repeats(fn, repeats: int, calls: int) -> float:  # type: ignore[no-untyped-def]
    return statistics.median(common.timed(fn, calls) for _ in range(repeats))


def child(mode: str, optimizer: str, root: str, repeats: int, calls: int) -> dict:
    """In a fresh process whose functrain is ``root``'s: one row's timings."""
    import functrain as ft

    if not Path(ft.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise RuntimeError(f"functrain came from {ft.__file__}, not from {root}: set PYTHONPATH")
    torch.set_num_threads(1)
    if mode == "trace":
        g = torch.Generator().manual_seed(0)
        params = {f"p{i}": torch.randn(64, generator=g) for i in range(300)}
        grads = {k: torch.randn(64, generator=g) for k in params}
        tx = _tx(optimizer)
        update = torch.compile(
            lambda p, g, s: ft.optim.apply_gradients(tx, g, s, p), backend="eager", fullgraph=True
        )
        t0 = time.process_time()
        update(params, grads, tx.init(params))
        return {"ms": (time.process_time() - t0) * 1e3}
    if mode == "update":
        g = torch.Generator().manual_seed(0)
        params = {f"p{i}": torch.randn(64, generator=g) for i in range(200)}
        grads = {k: torch.randn(64, generator=g) for k in params}
        tx = _tx(optimizer)
        box = [params, tx.init(params)]

        def update() -> None:
            box[0], box[1] = ft.optim.apply_gradients(tx, grads, box[1], box[0])

        for _ in range(3):
            update()
        return {"ms": _repeats(update, repeats, calls * 10)}
    workload = common.WORKLOADS["mlp"]
    model = common.build_model(workload)
    batch = common.build_batch(workload)
    tx = _tx(optimizer)
    if mode == "eager":
        step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))
    else:
        step = ft.jit(ft.make_train_step(model, ft.supervised_loss(F.cross_entropy)))
    box = [ft.TrainState.create(model, tx, copy=False)]

    def one() -> None:
        box[0], _ = step(box[0], batch)

    t0 = time.perf_counter()
    one()
    first_s = time.perf_counter() - t0
    for _ in range(2):
        one()
    ms = _repeats(one, repeats, calls)
    return {"ms": ms, "compile_s": first_s - ms / 1e3} if mode == "compiled" else {"ms": ms}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="the functrain checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per child")
    parser.add_argument("--calls", type=int, default=10, help="steps per repeat")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows (slow on CPU)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/optim_fast_path.md"))
    parser.add_argument("--child", nargs=3, metavar=("MODE", "OPTIMIZER", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.repeats, args.calls)))
        return
    if args.baseline is None:
        parser.error("--baseline DIR is required (e.g. git archive main | tar -x -C DIR)")
    roots = {"baseline": str(args.baseline.resolve()), "this": str(ROOT)}
    modes = ("eager", "update", "trace") + (() if args.no_compile else ("compiled",))
    rows = [(m, o) for m in modes for o in OPTIMIZERS]
    results: dict[tuple[str, str, str], list[dict]] = {}
    for r in range(args.rounds):
        for mode, optimizer in rows:
            for side in list(roots)[r % 2 :] + list(roots)[: r % 2]:  # alternate who goes first
                with tempfile.TemporaryDirectory(prefix="functrain-inductor-") as cache:
                    out = common.run_child(
                        __file__,
                        ["--child", mode, optimizer, roots[side], "--repeats", str(args.repeats),
                         "--calls", str(args.calls)],
                        f"{side} {mode}/{optimizer}",
                        PYTHONPATH=roots[side],
                        OMP_NUM_THREADS="1",
                        TORCHINDUCTOR_CACHE_DIR=cache,
                    )  # fmt: skip
                results.setdefault((mode, optimizer, side), []).append(out)
                print(f"round {r} {side:8} {mode:8} {optimizer:12} {out}", flush=True)
    lines = [
        "# Optimizer fast path: baseline / this checkout",
        "",
        f"{common.machine()}; load {common.load_average()}; {args.rounds} rounds, fresh process per cell, "
        f"median of {args.repeats} repeats of {args.calls} steps (update: x10) per process; baseline "
        f"`{args.baseline}`. Ratio = baseline / this (> 1: this is faster); median over rounds.",
        "",
        "| row | optimizer | baseline ms | this ms | ratio | compile s baseline / this |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, optimizer in rows:
        old, new = results[(mode, optimizer, "baseline")], results[(mode, optimizer, "this")]
        old_ms = statistics.median(x["ms"] for x in old)
        new_ms = statistics.median(x["ms"] for x in new)
        ratio = statistics.median(a["ms"] / b["ms"] for a, b in zip(old, new))
        compile_cell = "-"
        if mode == "compiled":
            old_c = statistics.median(x["compile_s"] for x in old)
            new_c = statistics.median(x["compile_s"] for x in new)
            compile_cell = f"{old_c:.1f} / {new_c:.1f}"
        lines.append(f"| {mode} | {optimizer} | {old_ms:.3f} | {new_ms:.3f} | {ratio:.3f} | {compile_cell} |")
    common.write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
