"""Data-parallel throughput: samples/s of functrain train steps with 1 and 2 torchrun processes (CPU, gloo).

    python benchmarks/distributed.py            # runs every configuration, prints a markdown table
    python benchmarks/distributed.py --quick    # fewer steps, eager only

Each configuration is its own ``torchrun`` launch; the machine's cores are split evenly between the
processes (``torch.set_num_threads``), so "1 process" and "2 processes" use the same CPU. The step is
``make_train_step(..., gradient_reducer=...)`` on a 512-512-512-10 MLP with AdamW; with 2 processes
every step all-reduces the gradients (one flat functional all-reduce inside the step).

On a CUDA machine the table also gets the single-GPU step time with and without the all-reduce path
(a one-process group whose reducer is forced on). Without CUDA those rows say so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.abspath(__file__)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def worker(args: argparse.Namespace) -> None:
    import functrain as ft
    from functrain import distributed

    with distributed.initialize() as env:
        torch.set_num_threads(max(1, args.threads))
        model = _model()
        state = distributed.replicate(
            ft.TrainState.create(model, ft.optim.adamw(1e-3), seed=0), device=env.device
        )
        # --force-reduce: the all-reduce path on one process (GPU comparison), through an explicit group
        group = torch.distributed.group.WORLD if args.force_reduce else None
        reducer = distributed.gradient_reducer(model=model, group=group)
        loss_fn = ft.supervised_loss(nn.functional.cross_entropy)
        step = ft.jit(ft.make_train_step(model, loss_fn, gradient_reducer=reducer), compile=args.compile)
        g = torch.Generator().manual_seed(env.rank)
        batch = (torch.randn(args.batch, 512, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
        batch = ft.data.to_device(batch, env.device)
        for _ in range(args.warmup):
            state, metrics = step(state, batch)
        if args.warmup:
            float(metrics["loss"])  # wait for the device
        distributed.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = step(state, batch)
        float(metrics["loss"])  # wait for the device
        elapsed = torch.tensor(time.perf_counter() - start)
        if env.is_distributed:
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if env.is_main_process:
            global_batch = args.batch * env.world_size
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "step_ms": 1000 * float(elapsed) / args.steps,
                        "samples_per_s": global_batch * args.steps / float(elapsed),
                        "global_batch": global_batch,
                    },
                    f,
                )


def _launch(
    nproc: int, batch: int, threads: int, compile: bool, steps: int, warmup: int, force: bool = False
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            HERE, "--worker", f"--batch={batch}", f"--threads={threads}", f"--steps={steps}",
            f"--warmup={warmup}", f"--out={out}",
        ] + (["--compile"] if compile else []) + (["--force-reduce"] if force else [])  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark launch failed:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=128, help="per-process batch (worker)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--force-reduce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    parser.add_argument("--quick", action="store_true", help="fewer steps, eager only")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    steps, warmup = (10, 3) if args.quick else (args.steps, args.warmup)
    modes = [False] if args.quick else [False, True]
    rows = []
    for compiled in modes:
        name = "compiled" if compiled else "eager"
        # 1 x 1 thread is the per-core baseline; 1 x all threads and N x 1 thread use the same cores.
        for nproc, batch, threads in ((1, 2 * args.batch, 1), (1, 2 * args.batch, cores), (2, args.batch, 1)):
            r = _launch(nproc, batch, threads, compiled, steps, warmup)
            rows.append(
                f"| CPU {name} | {nproc} x {threads} thread(s) | {batch} x {nproc} = {r['global_batch']} | "
                f"{r['step_ms']:.1f} | {r['samples_per_s']:.0f} |"
            )
    if torch.cuda.is_available():
        for force in (False, True):
            r = _launch(1, 2 * args.batch, cores, True, steps, warmup, force=force)
            what = "with all-reduce path (1-rank group)" if force else "without reducer"
            rows.append(
                f"| 1 GPU compiled, {what} | 1 | {r['global_batch']} | {r['step_ms']:.2f} | {r['samples_per_s']:.0f} |"
            )
    else:
        rows.append("| 1 GPU, with / without the all-reduce path | - | - | no GPU on this machine | - |")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{datetime.date.today()} | {platform.processor() or platform.machine()} | {cores} cores | "
        f"torch {torch.__version__} | 1-min load average at the end: {load:.1f}"
    )
    print("| configuration | processes x threads | global batch | step (ms) | samples/s |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
