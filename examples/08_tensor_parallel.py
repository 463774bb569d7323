"""Tensor parallelism: a GPT's attention heads and MLP units split over the ranks, in one pure step.

A small character-level GPT learns to continue this repository's README. Each rank keeps its half of the
q, k, v and MLP ``fc`` weights (colwise) and of the output projections (rowwise); embeddings, norms and the
head are replicated. Every rank of a tp group takes the *same* batch: the ranks split one layer's matmuls,
not the data. More ranks than ``--tp`` (2) form a ``(dp, tp)`` mesh: each tp group reads its own slice of
the global batch, and ``--sharding`` adds ZeRO over the dp axis (``fully_shard(mesh["dp"], level=...)``:
``optimizer`` keeps 1/world of the AdamW moments per rank, ``params`` the params too). On CPU the ranks
talk over gloo, on GPUs over NCCL:

    torchrun --nproc_per_node=2 examples/08_tensor_parallel.py
    torchrun --nproc_per_node=2 examples/08_tensor_parallel.py --compile    # one compiled graph per step
    torchrun --nproc_per_node=4 examples/08_tensor_parallel.py              # dp 2 x tp 2
    torchrun --nproc_per_node=4 examples/08_tensor_parallel.py --sharding params   # and ZeRO-3 over dp
    python examples/08_tensor_parallel.py                                   # one rank: nothing split

What changes against a one-process script is three lines: ``tensor_parallel(model, plan, mesh)`` (the
plan names which linears are split how; no hooks: the model's own forward runs on DTensor params),
``tp.place(state)`` (params and AdamW moments become DTensors, each rank holding its part) and
``strategy=tp`` for ``make_train_step``. ``tp.gather(state)`` gives whole plain tensors back: the
checkpoint below is written from them and loads into a plain ``nn.Module`` (or into ``tp.place`` on
another number of ranks).

Prints (rank 0 speaks for all): what it trains, the loss every 25 steps, each rank's share of the params
and optimizer state, and the gathered model's loss in a plain nn.Module, which equals the TP model's.
Expected with the defaults (150 steps; torch 2.13 on a CPU): the loss falls from 4.7 to about 2.65, the
same on 1, 2 and 4 ranks, with or without ``--sharding``, to float32 rounding (the gathered model's: 2.654
on each); each of 2 ranks holds 0.57 of the replicated bytes, each of 4 ranks (dp 2 x tp 2) 0.57, 0.36
with ``--sharding optimizer`` and 0.25 with ``--sharding params``. About 20 s on 2 quiet CPU cores eager
(4 ranks: about twice that), plus about 2 minutes compiling with --compile (with ``--sharding`` too).
Writes ``--out`` (default runs/08_tensor_parallel/final.ckpt).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import functrain as ft
from functrain import distributed

SEQ = 32


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.proj = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        # written out: DTensor has no sharding rule for the CPU kernel of F.scaled_dot_product_attention
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT's shape, small: the module names are the ones ``distributed.GPT_PLAN`` splits."""

    def __init__(self, vocab: int, width: int = 64, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(SEQ, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(blocks)])
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(model: object, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])  # type: ignore[operator]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def corpus() -> tuple[torch.Tensor, int]:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text]), len(chars)


def batch_at(data: torch.Tensor, step: int, rows: int = 16, dp: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The step's global batch, from the step number alone, and of it the slice of dp group ``dp[0]`` of
    ``dp[1]``: the same on every rank of a tp group."""
    starts = torch.randint(0, len(data) - SEQ - 1, (rows,), generator=torch.Generator().manual_seed(step))
    return torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()]).chunk(dp[1])[dp[0]]


def say(*values: object) -> None:
    if distributed.is_main_process():
        print(*values, flush=True)


def one_process_group() -> None:
    """``python examples/08_tensor_parallel.py``: a process group of one, so the same mesh code runs."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # FUNCTRAIN_SMALL=1 (the example tests): a few steps
    parser.add_argument("--steps", type=int, default=20 if os.environ.get("FUNCTRAIN_SMALL") == "1" else 150)
    parser.add_argument("--compile", action="store_true", help="compile the step (one graph)")
    parser.add_argument("--tp", type=int, default=2, help="ranks per tp group (at most the world size)")
    parser.add_argument(
        "--sharding", choices=["none", "optimizer", "grads", "params"], default="none",
        help="ZeRO over the dp axis of the (dp, tp) mesh",
    )  # fmt: skip
    parser.add_argument("--out", default="runs/08_tensor_parallel/final.ckpt")
    args = parser.parse_args()
    one_process_group()
    with distributed.initialize() as env:
        data, vocab = corpus()
        world = distributed.world_size()
        tp_size = min(args.tp, world)
        dp_size = world // tp_size
        if dp_size * tp_size != world:
            sys.exit(f"--tp {tp_size} must divide the {world} ranks")
        say(
            f"08: a character GPT on the README, {args.steps} steps, heads split over {tp_size} rank(s), "
            f"dp {dp_size}, sharding {args.sharding}, {'compiled' if args.compile else 'eager'}"
        )
        torch.manual_seed(0)  # the same initial model on every rank (place() keeps rank 0's anyway)
        model = GPT(vocab)
        sharding, dp = None, (0, 1)
        if dp_size == 1 and args.sharding == "none":  # one tp group: a 1-D mesh
            mesh = init_device_mesh(env.device.type, (world,))
        else:  # (dp, tp): each tp group its slice of the batch; ZeRO shards over the dp axis
            mesh = init_device_mesh(env.device.type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
            dp = (mesh["dp"].get_local_rank(), dp_size)
            if args.sharding != "none":
                sharding = distributed.fully_shard(mesh["dp"], level=args.sharding)
        tp = distributed.tensor_parallel(model, distributed.GPT_PLAN, mesh, sharding=sharding)
        tx = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(3e-3, weight_decay=0.01))
        state = tp.place(ft.TrainState.create(model, tx, device=env.device))
        step = ft.jit(ft.make_train_step(model, lm_loss, strategy=tp), compile=args.compile)

        for i in range(args.steps):
            state, metrics = step(state, batch_at(data, i, dp=dp).to(env.device))  # loss: the global batch's
            if i % 25 == 0 or i == args.steps - 1:
                say(
                    f"step {i:4d}: loss {float(metrics['loss']):.3f}, grad norm {float(metrics['grad_norm']):.2f}"
                )

        held = sum(
            getattr(x, "_local_tensor", x).nbytes for x in ft.tree.leaves((state.params, state.opt_state))
        )
        whole = 3 * ft.tree.num_bytes(model.state_dict())  # params + AdamW's two moments, replicated
        sys.stdout.write(  # one write per line: the ranks share the terminal
            f"rank {distributed.rank()}/{world}: holds {held / 1e3:.0f} kB of params and optimizer state "
            f"({held / whole:.2f} of the replicated {whole / 1e3:.0f} kB)\n"
        )
        whole_state = tp.gather(state)  # collective: plain, whole tensors on every rank
        last = batch_at(data, args.steps).to(env.device)
        if distributed.rank() == 0:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            ft.checkpoint.save(args.out, whole_state, step=args.steps)
            plain = whole_state.load_into(GPT(vocab).to(env.device))
            with torch.no_grad():
                loss = lm_loss(plain, last)
            print(f"the gathered weights in a plain nn.Module: loss {float(loss):.3f}; saved {args.out}")


if __name__ == "__main__":
    main()
