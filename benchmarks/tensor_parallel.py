"""Tensor parallelism on a 2-D mesh (dp x tp): per-rank state bytes at rest and the step's peak memory,
functrain's TP with ZeRO over dp against torch's own TP (``parallelize_module``) + FSDP2 (``fully_shard`` on
the dp axis) with ``torch.optim.AdamW``, on the same GPT-style model.

    python benchmarks/tensor_parallel.py                 # 4 ranks: dp 2 x tp 2 (torchrun, gloo on CPU)
    python benchmarks/tensor_parallel.py --configs zero3 torch --steps 5

Each configuration is its own torchrun launch. Per rank (the worst rank shown):

- ``state MB``: params and AdamW moments this rank holds (local parts of DTensors / shards);
- ``of whole``: that against one process's whole params and moments (the ideal is 1 / (dp * tp));
- ``step peak MB``: the resident memory's peak during the timed steps above the resident memory before
  them (``VmHWM`` reset through ``/proc/self/clear_refs``; CUDA: ``torch.cuda.max_memory_allocated``), as
  ``benchmarks/sharded.py`` measures it;
- ``samples/s``: global examples per second (eager; a loaded 2-core machine: compare within a run).

functrain's ZeRO-3 under TP gathers the params outside the gradient (its peak holds every layer's tp part
whole); FSDP2 gathers one block at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from sharded import _local_bytes, launch_ranks, timed_steps
from torch import nn

HERE = os.path.abspath(__file__)
VOCAB, SEQ, D, HEAD_DIM, LAYERS, BATCH = 512, 64, 256, 32, 4, 8  # BATCH per dp rank
CONFIGS = ("tp", "zero1", "zero3", "torch")
LABELS = {
    "tp": "functrain TP x dp (no ZeRO)",
    "zero1": "functrain TP x ZeRO-1",
    "zero3": "functrain TP x ZeRO-3",
    "torch": "torch `parallelize_module` + FSDP2 `fully_shard`",
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # heads from the width the projection gives: all of them on DTensors, this rank's under torch's TP
        q, k, v = (f(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for f in (self.q, self.k, self.v))
        # written out: DTensor has no sharding rule for CPU's fused attention kernel
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = (q @ k.transpose(-2, -1)) * HEAD_DIM**-0.5
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(D, 4 * D), "proj": nn.Linear(4 * D, D)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp["proj"](F.gelu(self.mlp["fc"](self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(call: object, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = call(batch[0])  # type: ignore[operator]
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import functrain as ft
    from functrain import distributed

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # the same batch on a tp group
    batch = (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    )
    torch.manual_seed(0)
    model = GPT()
    whole = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + AdamW's 2 moments
    if args.config == "torch":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {}
        for i in range(LAYERS):
            for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.proj", "mlp.proj"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

        def run() -> torch.Tensor:
            loss = lm_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        def held() -> int:
            moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
            return _local_bytes(list(model.parameters()) + moments)
    else:
        level = {"tp": None, "zero1": "optimizer", "zero3": "params"}[args.config]
        sharding = distributed.fully_shard(mesh["dp"], level=level) if level else None
        tp = distributed.tensor_parallel(model, distributed.GPT_PLAN, mesh, sharding=sharding)
        state = tp.place(ft.TrainState.create(model, ft.optim.adamw(1e-3, weight_decay=0.1)))
        step = ft.jit(ft.make_train_step(model, lm_loss, strategy=tp), compile=False)
        box = [state]

        def run() -> torch.Tensor:
            box[0], metrics = step(box[0], batch)
            return metrics["loss"]

        def held() -> int:
            leaves = ft.tree.leaves((box[0].params, box[0].opt_state))
            return _local_bytes([x for x in leaves if isinstance(x, torch.Tensor) and x.ndim > 0])

        del model  # functrain keeps the weights in the state only
    seconds, peak = timed_steps(run, args.warmup, args.steps, dist.barrier)
    row = {
        "state_mb": held() / 2**20,
        "of_whole": held() / whole,
        "step_peak_mb": peak,
        "samples_per_s": args.steps * BATCH * mesh["dp"].size() / seconds,
    }
    with open(os.path.join(args.out, f"{args.config}_rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def _launch(config: str, args: argparse.Namespace, out: str) -> list[dict]:
    extra = ["--tp", str(args.tp), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return launch_ranks(HERE, config, args.ranks, out, extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, default="zero3")
    parser.add_argument("--out", default="")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for config in args.configs:
            rows = _launch(config, args, out)
            if rows:  # the worst rank
                results[config] = {
                    k: max(r[k] for r in rows) for k in ("state_mb", "of_whole", "step_peak_mb")
                }
                results[config]["samples_per_s"] = rows[0]["samples_per_s"]
    dp = args.ranks // args.tp
    print(
        f"\ndp {dp} x tp {args.tp}, GPT d={D} x {LAYERS} layers, vocab {VOCAB}, seq {SEQ}, batch {BATCH}/dp rank, "
        f"float32, AdamW, eager (ideal state: 1/{args.ranks} = {1 / args.ranks:.3f} of whole):\n"
    )
    print("| config | state MB/rank | of whole | step peak MB/rank | samples/s |")
    print("|---|---:|---:|---:|---:|")
    for config, r in results.items():
        print(
            f"| {LABELS[config]} | {r['state_mb']:.2f} | {r['of_whole']:.3f} | {r['step_peak_mb']:.1f} | "
            f"{r['samples_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
