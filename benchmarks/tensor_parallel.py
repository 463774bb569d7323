"""Tensor parallelism on a 2-D mesh (dp x tp): per-rank state bytes at rest and the step's peak memory,
functrain's TP with ZeRO over dp against torch's own TP (``parallelize_module``) + FSDP2 (``fully_shard`` on
the dp axis) with ``torch.optim.AdamW``, on the same GPT-style model.

    python benchmarks/tensor_parallel.py                 # 4 ranks: dp 2 x tp 2 (torchrun, gloo on CPU)
    python benchmarks/tensor_parallel.py --configs zero3 torch --steps 5
    python benchmarks/tensor_parallel.py --activations  # activations saved for the backward, tp 1, 2, 4

Each configuration is its own torchrun launch. Per rank (the worst rank shown):

- ``state MB``: params and AdamW moments this rank holds (local parts of DTensors / shards);
- ``of whole``: that against one process's whole params and moments (the ideal is 1 / (dp * tp));
- ``step peak MB``: the resident memory's peak during the timed steps above the resident memory before
  them (``VmHWM`` reset through ``/proc/self/clear_refs``; CUDA: ``torch.cuda.max_memory_allocated``), as
  ``benchmarks/sharded.py`` measures it;
- ``torch.func step peak``: the same of functrain's step with its gradient through ``torch.func`` at every
  call (``plain_autograd_applies`` patched to refuse), as a DTensor state's eager step ran before it took
  plain autograd;
- ``samples/s``: global examples per second (eager; a loaded 2-core machine: compare within a run).

functrain's ZeRO-3 under TP gathers the params outside the gradient (its peak holds every layer's tp part
whole); FSDP2 gathers one block at a time.

``--activations``: the bytes autograd saves for the backward per rank (:func:`saved_activations`), by the
kind of layer that saved them, at tp 1, 2 and 4 on the same per-rank batch (dp = ranks / tp), for
functrain's TP x dp and TP x ZeRO-3 and torch's ``parallelize_module`` + FSDP2, with the collectives
and the peaks of the forward + backward (plain autograd; functrain's ``torch.func.grad``) and of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from fnmatch import fnmatch
from unittest import mock

import torch
import torch.nn.functional as F
from sharded import _local_bytes, _now_mb, _peak_mb, _reset_peak, launch_ranks, timed_steps
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

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


# what a saved tensor's layer is, by the GPT_PLAN style of the module that saved it, else its class;
# True where TP splits it (heads, the MLP's hidden units), False where it is whole on every tp rank
KINDS = {
    "Embedding": ("embedding (token ids)", False),
    "LayerNorm": ("layer norms (input, mean, rstd)", False),
    "colwise": ("colwise q, k, v, fc (their input)", False),
    "Attention": ("attention core (q, k, v, softmax)", True),
    "rowwise": ("rowwise attn/mlp proj (their input)", True),
    "Block": ("GELU (its input)", True),
    "Linear": ("head (its input)", False),
    "loss": ("cross-entropy (log-softmax)", False),
}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    with torch.no_grad():
        t = t.to_local() if hasattr(t, "to_local") else t
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def saved_activations(model: nn.Module, loss: Callable[[], torch.Tensor], plan: dict) -> dict[str, int]:
    """Bytes this rank holds in the tensors autograd saves for the backward of ``loss()`` (then run), by
    ``KINDS`` (``plan``'s style of the module that saved it, else its class): each storage once (q, k and v
    save one input), a DTensor by its local part, the params (the saving module's own) left out. Exact, not
    sampled; torch.func refuses saved-tensor hooks, so the caller runs the step's forward under plain
    autograd (the same ops save the same tensors). Also the number of each collective the forward and
    backward issue (torch's ``CommDebugMode``)."""
    names = {m: n for n, m in model.named_modules()}
    stack, saved = [("loss", set())], {}  # (kind, its params' storages) of the modules running

    def enter(module: nn.Module, _: object) -> None:
        style = [s for p, s in plan.items() if fnmatch(names[module], p)]  # else the class (FSDP2 subclasses)
        kind = (style or [c.__name__ for c in type(module).__mro__ if c.__name__ in KINDS])[0]
        stack.append((kind, {_storage(p)[0] for p in module.parameters(recurse=False)}))

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr not in stack[-1][1]:  # FSDP2 frees its gathered params: only the live ones' addresses hold
            saved.setdefault(ptr, (stack[-1][0], nbytes))
        return t

    def leave(*_: object) -> None:
        stack.pop()

    hooks = [m.register_forward_pre_hook(enter, prepend=True) for m in names if m is not model]
    hooks += [m.register_forward_hook(leave) for m in names if m is not model]
    with CommDebugMode() as comm:  # and the collectives of the forward and backward
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = loss()
        for h in hooks:
            h.remove()
        out.backward()
    by_kind = dict.fromkeys(KINDS, 0)
    for kind, nbytes in saved.values():
        by_kind[kind] += nbytes
    return by_kind | {"comm " + str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


def _peak_of(run: Callable[[], object]) -> float:
    """The resident memory's peak during ``run()`` above what was live before it, MB."""
    before = _now_mb()
    _reset_peak()
    run()
    return _peak_mb(before)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import functrain as ft
    from functrain import distributed
    from functrain.distributed import GPT_PLAN
    from functrain.distributed.tp_forward import tensor_parallel_forward
    from functrain.step.bind import model_call

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

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {
            n: styles[s]() for n, _ in model.named_modules() for p, s in GPT_PLAN.items() if fnmatch(n, p)
        }
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

        def forward() -> torch.Tensor:
            return lm_loss(model, batch)
    else:
        level = {"tp": None, "zero1": "optimizer", "zero3": "params"}[args.config]
        sharding = distributed.fully_shard(mesh["dp"], level=level) if level else None
        tp = distributed.tensor_parallel(model, GPT_PLAN, mesh, sharding=sharding)
        state = tp.place(ft.TrainState.create(model, ft.optim.adamw(1e-3, weight_decay=0.1)))
        step = ft.jit(ft.make_train_step(model, lm_loss, strategy=tp), compile=False)
        box = [state]

        def run() -> torch.Tensor:
            box[0], metrics = step(box[0], batch)
            return metrics["loss"]

        def held() -> int:
            leaves = ft.tree.leaves((box[0].params, box[0].opt_state))
            return _local_bytes([x for x in leaves if isinstance(x, torch.Tensor) and x.ndim > 0])

        def loss_of(params: dict) -> torch.Tensor:  # the step's loss, of the params it differentiates
            return lm_loss(model_call(model)(params, box[0].buffers), batch)

        def forward() -> torch.Tensor:  # under plain autograd
            return loss_of({k: v.detach().requires_grad_() for k, v in tp.params_for_grad(box[0]).items()})

        def func_backward() -> None:  # the step's torch.func.grad alone, without the update
            torch.func.grad(loss_of)(tp.params_for_grad(box[0]))

    seconds, peak = timed_steps(run, args.warmup, args.steps, dist.barrier)
    row = {
        "state_mb": held() / 2**20,
        "of_whole": held() / whole,
        "step_peak_mb": peak,
        "samples_per_s": args.steps * BATCH * mesh["dp"].size() / seconds,
    }
    if args.config != "torch":  # the same step with every gradient through torch.func (before 2026-11-27)
        from functrain.step import grad as grad_module

        with mock.patch.object(grad_module, "plain_autograd_applies", lambda params: False):
            row["func_step_peak_mb"] = timed_steps(run, 1, args.steps, dist.barrier)[1]
    if args.activations:
        with tensor_parallel_forward(model):  # as the step (nothing for torch's model)
            row["backward_peak_mb"] = _peak_of(
                lambda: row.update(saved_activations(model, forward, GPT_PLAN))
            )
            if args.config != "torch":
                row["func_backward_peak_mb"] = _peak_of(func_backward)
    with open(os.path.join(args.out, f"{args.config}_rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def _launch(config: str, args: argparse.Namespace, out: str) -> list[dict]:
    extra = ["--tp", str(args.tp), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return launch_ranks(HERE, config, args.ranks, out, extra + ["--activations"] * args.activations)


def _activations(args: argparse.Namespace) -> None:
    """Print the activations table: MB per rank by kind at tp 1, then each tp's share of tp 1's; and the
    step's peak at each tp."""
    tps = [tp for tp in (1, 2, 4) if args.ranks % tp == 0]
    cols = {}  # (config, tp) -> {kind: bytes}, the worst rank
    for config in args.configs or ("tp", "zero3", "torch"):
        for args.tp in tps:
            with tempfile.TemporaryDirectory() as out:
                rows = _launch(config, args, out)
            if rows:
                cols[config, args.tp] = {k: max(r.get(k, 0) for r in rows) for k in rows[0]}
    print(
        f"\nActivations saved for the backward, MB per rank (tp 1) and share of tp 1's (tp > 1), {args.ranks} "
        f"ranks, dp = {args.ranks}/tp, GPT d={D} x {LAYERS} layers, {D // HEAD_DIM} heads, vocab {VOCAB}, seq "
        f"{SEQ}, batch {BATCH}/rank, float32:\n"
    )
    names = {"tp": "ft", "zero1": "ft ZeRO-1", "zero3": "ft ZeRO-3", "torch": "torch"}
    print("| layer kind | split by TP | " + " | ".join(f"{names[c]} tp={tp}" for c, tp in cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    groups = {k: [k] for k in KINDS} | {"split": [k for k in KINDS if KINDS[k][1]], "total": list(KINDS)}
    for name, kinds in groups.items():
        label, split = KINDS.get(name, (f"**{name}**", ""))
        cells = []
        for (config, tp), col in cols.items():
            mb, base = sum(col[k] for k in kinds), sum(cols.get((config, 1), col)[k] for k in kinds)
            cells.append(f"{mb / 2**20:.2f}" if tp == 1 else f"{mb / base:.3f}" if base else "-")
        print(
            f"| {label} | {'yes' if split is True else 'no' if split is False else ''} | {' | '.join(cells)} |"
        )
    comms = [", ".join(f"{n} {k[5:]}" for k, n in c.items() if k.startswith("comm ")) for c in cols.values()]
    print("| collectives, forward + backward | | " + " | ".join(comms) + " |")
    peaks = {
        "backward_peak_mb": "forward + backward (autograd)",
        "func_backward_peak_mb": "torch.func.grad",
        "step_peak_mb": "step (as above)",
        "func_step_peak_mb": "step, its gradient by torch.func",
    }
    for key, label in peaks.items():
        print(
            f"| {label} peak MB | | "
            + " | ".join(f"{c[key]:.1f}" if key in c else "-" for c in cols.values())
            + " |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, default="zero3")
    parser.add_argument("--out", default="")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS)
    parser.add_argument("--activations", action="store_true", help="the saved activations by layer, tp 1/2/4")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.activations:
        _activations(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for config in args.configs or CONFIGS:
            rows = _launch(config, args, out)
            if rows:  # the worst rank
                keys = ("state_mb", "of_whole", "step_peak_mb", "func_step_peak_mb")
                results[config] = {k: max(r[k] for r in rows) for k in keys if k in rows[0]}
                results[config]["samples_per_s"] = rows[0]["samples_per_s"]
    dp = args.ranks // args.tp
    print(
        f"\ndp {dp} x tp {args.tp}, GPT d={D} x {LAYERS} layers, vocab {VOCAB}, seq {SEQ}, batch {BATCH}/dp rank, "
        f"float32, AdamW, eager (ideal state: 1/{args.ranks} = {1 / args.ranks:.3f} of whole):\n"
    )
    print("| config | state MB/rank | of whole | step peak MB/rank | torch.func step peak | samples/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for config, r in results.items():
        func = f"{r['func_step_peak_mb']:.1f}" if "func_step_peak_mb" in r else "-"
        print(
            f"| {LABELS[config]} | {r['state_mb']:.2f} | {r['of_whole']:.3f} | {r['step_peak_mb']:.1f} | "
            f"{func} | {r['samples_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
