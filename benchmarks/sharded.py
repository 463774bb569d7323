"""Sharded training: per-rank state bytes, the step's peak memory and throughput, against replicated data
parallelism and PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard`` + ``torch.optim.AdamW``).

    python benchmarks/sharded.py              # 2 ranks (torchrun, gloo on CPU), 8 x Linear(1024), AdamW
    python benchmarks/sharded.py --ranks 4 --steps 20
    python benchmarks/sharded.py --configs zero3_blocks fsdp2 --donate   # a subset; jit(donate=True)

Each configuration is its own torchrun launch (cores split evenly between the ranks). Per rank:

- ``state MB``: params and optimizer state this rank holds (local shards for the sharded runs);
- ``step peak MB``: the peak resident memory during the timed steps above the resident memory before them
  (``VmHWM`` reset through ``/proc/self/clear_refs`` on Linux; CUDA: ``torch.cuda.max_memory_allocated``);
- ``samples/s``: global examples per second, and its ratio to FSDP2 measured in the same run.

functrain's ZeRO-3 step gathers the params outside the backward (see functrain/distributed/DESIGN_FSDP.md):
its peak holds the full weights and gradients, where FSDP2 frees each block's gathered weights after use.
``ZeRO-3 + blocks`` (``fully_shard(level="params", blocks="auto")``) gathers each block's params inside
its forward and again in its recomputed backward, as FSDP2 does per ``fully_shard``ed block.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

HERE = os.path.abspath(__file__)
WIDTH, BLOCKS, BATCH = 1024, 8, 64  # per rank
CONFIGS = ("replicated", "zero1", "zero3", "zero3_blocks", "fsdp2")
LABELS = {
    "replicated": "replicated (`gradient_reducer`)",
    "zero1": "functrain ZeRO-1",
    "zero3": "functrain ZeRO-3",
    "zero3_blocks": "functrain ZeRO-3 + blocks",
    "fsdp2": "FSDP2 `fully_shard` + `torch.optim.AdamW`",
}


class _Block(nn.Sequential):
    """One repeated block: Linear + ReLU (FSDP2 and ZeRO-3 + blocks shard per block)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(WIDTH, WIDTH), nn.ReLU())


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")


def _peak_mb(before: float) -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20 - before
    return _rss_mb("VmHWM") - before


def _now_mb() -> float:
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else _rss_mb("VmRSS")


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    out = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        out += t.numel() * t.element_size()
    return out


def worker(args: argparse.Namespace) -> None:
    import functrain as ft
    from functrain import distributed

    with distributed.initialize() as env:
        torch.set_num_threads(max(1, args.threads))
        g = torch.Generator().manual_seed(env.rank)
        batch = (torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        batch = ft.data.to_device(batch, env.device)
        model = _model().to(env.device)
        if args.config == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

            def run() -> torch.Tensor:
                loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

            def held() -> int:
                moments = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                return _local_bytes(list(model.parameters()) + moments)
        else:
            tx = ft.optim.adamw(1e-3, weight_decay=0.1)
            loss_fn = ft.supervised_loss(nn.functional.cross_entropy)
            if args.config == "replicated":
                state = distributed.replicate(ft.TrainState.create(model, tx, seed=0), device=env.device)
                raw = ft.make_train_step(
                    model, loss_fn, gradient_reducer=distributed.gradient_reducer(model=model)
                )
            else:
                level = "optimizer" if args.config == "zero1" else "params"
                blocks = "auto" if args.config == "zero3_blocks" else None
                sharding = distributed.fully_shard(level=level, blocks=blocks)
                state = ft.TrainState.create(model, tx, seed=0, sharding=sharding, device=env.device)
                raw = ft.make_train_step(model, loss_fn, sharding=sharding)
            step = ft.jit(raw, compile=args.compile, donate=args.donate)
            box = [state]

            def run() -> torch.Tensor:
                box[0], metrics = step(box[0], batch)
                return metrics["loss"]

            def held() -> int:
                return _local_bytes(ft.tree.leaves((box[0].params, box[0].opt_state)))

            del model  # functrain keeps the weights in the state only
        seconds, peak = timed_steps(run, args.warmup, args.steps, distributed.barrier)
        row = {
            "config": args.config,
            "rank": env.rank,
            "world": env.world_size,
            "state_mb": held() / 2**20,
            "step_peak_mb": peak,
            "samples_per_s": args.steps * BATCH * env.world_size / seconds,
        }
        with open(os.path.join(args.out, f"{args.config}_rank{env.rank}.json"), "w") as f:
            json.dump(row, f)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_steps(
    run: Callable[[], torch.Tensor], warmup: int, steps: int, barrier: Callable[[], object]
) -> tuple[float, float]:
    """``(seconds, peak MB)`` of ``steps`` calls of ``run`` (each returning the loss) after ``warmup``
    calls and a ``barrier``: the host waits for the last loss; the peak is the resident memory's above
    what was live before the timed steps."""
    for _ in range(warmup):
        float(run())
    barrier()
    before = _now_mb()
    _reset_peak()
    start = time.perf_counter()
    for _ in range(steps):
        loss = run()
    float(loss)
    return time.perf_counter() - start, _peak_mb(before)


def launch_ranks(
    script: str, config: str, ranks: int, out: str, extra: list[str], threads: int = 1
) -> list[dict]:
    """Run ``script --worker --config CONFIG --out OUT *extra`` on ``ranks`` torchrun ranks (``threads``
    each); the JSON row each rank wrote to ``OUT/CONFIG_rankR.json`` (``[]`` if the launch failed)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={_free_port()}",
        script, "--worker", "--config", config, "--out", out, *extra,
    ]  # fmt: skip
    # large blocks mmapped and unmapped when freed (a fixed glibc threshold: no growing free-list cache),
    # so the resident memory follows the live tensors and its peak is the step's
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{config} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return []
    rows = []
    for r in range(ranks):
        with open(os.path.join(out, f"{config}_rank{r}.json")) as f:
            rows.append(json.load(f))
    return rows


def _launch(config: str, args: argparse.Namespace, out: str) -> list[dict]:
    threads = max(1, (os.cpu_count() or 2) // args.ranks)
    extra = [
        "--threads", str(threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
        *(["--compile"] if args.compile else []), *(["--donate"] if args.donate else []),
    ]  # fmt: skip
    return launch_ranks(HERE, config, args.ranks, out, extra, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, default="zero3")
    parser.add_argument("--out", default="")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--donate", action="store_true", help="functrain steps: jit(..., donate=True)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as out:
        for config in args.configs:
            rows = _launch(config, args, out)
            if rows:  # the worst rank
                results[config] = {
                    "state_mb": max(r["state_mb"] for r in rows),
                    "step_peak_mb": max(r["step_peak_mb"] for r in rows),
                    "samples_per_s": rows[0]["samples_per_s"],
                }
    fsdp = results.get("fsdp2")
    mode = ("compiled" if args.compile else "eager") + (", functrain donating" if args.donate else "")
    print(
        f"\n{args.ranks} ranks, {BLOCKS} x (Linear({WIDTH}) + ReLU) + head, AdamW, batch {BATCH}/rank, {mode}:\n"
    )
    print("| config | state MB/rank | step peak MB/rank | samples/s | vs FSDP2 |")
    print("|---|---:|---:|---:|---:|")
    for config, r in results.items():
        ratio = f"{r['samples_per_s'] / fsdp['samples_per_s']:.2f}x" if fsdp else "-"
        print(
            f"| {LABELS[config]} | {r['state_mb']:.1f} | {r['step_peak_mb']:.1f} | {r['samples_per_s']:.0f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
