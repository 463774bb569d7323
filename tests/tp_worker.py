"""The tensor-parallel jobs the tests launch with torchrun; each rank also computes the one-process reference.

    python -m torch.distributed.run --nproc_per_node=N tests/tp_worker.py MODE OUT_DIR

Modes: ``eager`` (tp over every rank, 8 AdamW steps with clipping, eager, against one process on the
same batches; the plan's refusals; a gathered state saved after 4 steps and resumed; the Hugging Face
GPT-2 and Llama plans), ``compile`` (the same step compiled, then another optimizer and the first again
after ``torch._dynamo.reset()`` in the same process), ``grid`` (4 ranks: a 2-D mesh, dp 2 x tp 2) and
``grid_compile`` (the same, compiled). Each rank writes ``OUT_DIR/<mode>_rank<r>.pt`` (a test artefact
read back by the test, not a checkpoint).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchrun_exit import save_results_and_exit

import functrain as ft
from functrain import distributed

VOCAB, SEQ, D, HEADS, STEPS = 13, 6, 8, 2, 8


class Attention(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) * (D // self.heads) ** -0.5
        causal = torch.ones(
            t, t, dtype=torch.bool, device=x.device
        ).tril()  # a plain tensor the forward makes
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, D))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(heads), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Two GPT blocks, heads split over tp by ``GPT_PLAN``; embeddings, norms and head replicated."""

    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(heads), Block(heads)])
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(call: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = call(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batches(rows: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def adamw(clip: float = 0.4) -> ft.optim.GradientTransformation:
    # 0.4, below the gradients' norm: every step clips, so the norm over the split leaves counts
    return ft.optim.chain(ft.optim.clip_by_global_norm(clip), ft.optim.adamw(1e-2, weight_decay=0.1))


def model(seed: int = 0, heads: int = HEADS) -> GPT:
    torch.manual_seed(seed)
    return GPT(heads).double()


def reference(clip: float = 0.4, rows: int = 4) -> tuple[ft.TrainState, list[dict[str, torch.Tensor]]]:
    """One process on the whole batches."""
    net = model()
    state, step, metrics = ft.TrainState.create(net, adamw(clip)), ft.make_train_step(net, lm_loss), []
    for batch in batches(rows):
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def max_diff(a: Any, b: Any) -> float:
    la, lb = ft.tree.leaves(a), ft.tree.leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    return max(
        (x.double() - y.double()).abs().max().item() for x, y in zip(la, lb) if isinstance(x, torch.Tensor)
    )


def run_tp(mesh: Any, compile: bool, clip: float = 0.4) -> dict[str, Any]:
    """8 steps on ``mesh`` (1-D: tp; 2-D: dp x tp, each dp rank its part of a global batch of 4 * dp rows)
    against one process on the global batches. Each rank starts from another model: ``place`` gives all
    of them rank 0's."""
    net = model(seed=dist.get_rank())
    tp = distributed.tensor_parallel(net, distributed.GPT_PLAN, mesh)
    state = tp.place(ft.TrainState.create(net, adamw(clip)))
    step = ft.make_train_step(net, lm_loss, strategy=tp)
    step = ft.jit(step) if compile else step
    dp, dp_rank = (mesh["dp"].size(), mesh["dp"].get_local_rank()) if mesh.ndim == 2 else (1, 0)
    metrics = []
    for batch in batches(4 * dp):
        state, m = step(state, tuple(t.tensor_split(dp)[dp_rank] for t in batch))
        metrics.append(m)
    ref, ref_metrics = reference(clip, 4 * dp)
    whole = tp.gather(state)
    return {
        "params": max_diff(whole.params, ref.params),
        "opt_state": max_diff(whole.opt_state, ref.opt_state),
        "loss": max(abs(m["loss"] - r["loss"]).item() for m, r in zip(metrics, ref_metrics)),
        "grad_norm": max(abs(m["grad_norm"] - r["grad_norm"]).item() for m, r in zip(metrics, ref_metrics)),
        "split": sum(isinstance(p, DTensor) and p.to_local().shape != p.shape for p in state.params.values()),
        "moments_dtensor": all(isinstance(x, DTensor) for x in ft.tree.leaves(state.opt_state) if x.ndim > 0),
        "metrics_plain": all(type(v) is torch.Tensor for v in metrics[-1].values()),
        "state_dict": max_diff(state.state_dict(), ref.state_dict()),
        "num_compiles": step.num_compiles if compile else None,
        "clipped": all(float(r["grad_norm"]) > clip for r in ref_metrics),
        "clip": clip,
    }


def resume(mesh: Any, out_dir: str) -> dict[str, Any]:
    """4 steps, the placed state saved by every rank, the gathered state saved (rank 0) and restored onto
    a fresh state on every rank, placed again, 4 more steps: against the 8 steps uninterrupted. The file is left for the test to resume on
    one process."""
    net = model()
    tp = distributed.tensor_parallel(net, distributed.GPT_PLAN, mesh)
    step = ft.make_train_step(net, lm_loss, strategy=tp)
    state = tp.place(ft.TrainState.create(net, adamw()))
    data = batches()
    for batch in data[:4]:
        state, _ = step(state, batch)
    path = os.path.join(out_dir, "tp_step4.ckpt")
    out: dict[str, Any] = {"path": path}
    whole = tp.gather(state)
    # the placed state saved as it is (every rank, each its own file): gathered whole by save itself
    placed = os.path.join(out_dir, f"dtensors{dist.get_rank()}.ckpt")
    ft.checkpoint.save(placed, state, step=4)
    out["dtensor_save"] = max_diff(
        ft.checkpoint.restore(placed, target=ft.TrainState.create(model(), adamw())), whole
    )
    if dist.get_rank() == 0:
        ft.checkpoint.save(path, whole, step=4)
    dist.barrier()
    restored = ft.checkpoint.restore(path, target=ft.TrainState.create(model(), adamw()))
    out["roundtrip"] = max_diff(restored, whole)
    resumed = tp.place(restored)
    for batch in data[4:]:
        state, _ = step(state, batch)
        resumed, _ = step(resumed, batch)
    out["resumed_vs_uninterrupted"] = max_diff(tp.gather(resumed), tp.gather(state))
    out["final"] = {k: v.clone() for k, v in tp.gather(state).params.items()}
    return out


def refusals(mesh: Any) -> dict[str, str]:
    out = {}
    cases = {
        "not_splittable": {"blocks.*.ln1": "colwise"},
        "no_match": {"blocks.*.attn.query": "colwise"},
        "bad_style": {"blocks.*.attn.q": "columnwise"},
        "indivisible": {"head": "colwise"},  # 13 rows over 2 ranks
    }
    net = model()
    tp = distributed.tensor_parallel(net, distributed.GPT_PLAN, mesh)
    fp16 = ft.TrainState.create(net, adamw(), loss_scale=ft.precision.LossScale.create())
    try:
        ft.make_train_step(net, lm_loss, strategy=tp, precision="fp16")(tp.place(fp16), batches()[0])
        out["fp16"] = "trained"
    except ValueError as e:
        out["fp16"] = str(e)
    zero = ft.TrainState.create(net, adamw(), sharding=distributed.fully_shard(level="optimizer"))
    try:
        tp.place(zero)
        out["zero"] = "placed"
    except ValueError as e:
        out["zero"] = str(e)
    for name, plan in cases.items():
        try:
            distributed.tensor_parallel(model(), plan, mesh)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def hugging_face(mesh: Any) -> dict[str, Any] | None:
    """GPT2_PLAN and LLAMA_PLAN on tiny Hugging Face models (float64, dropout 0), 3 steps against one
    process; the default GPT-2 config (dropout 0.1) refused."""
    try:
        import transformers as tr
    except ImportError:
        return None

    def lm(call: Any, batch: torch.Tensor) -> torch.Tensor:
        return call(input_ids=batch, labels=batch, use_cache=False).loss

    small = {"vocab_size": 50, "num_hidden_layers": 2, "num_attention_heads": 2}
    gpt2 = tr.GPT2Config(
        **small, n_positions=16, n_embd=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    llama = tr.LlamaConfig(
        **small, hidden_size=16, intermediate_size=32, num_key_value_heads=2, max_position_embeddings=16,
        attn_implementation="eager",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 50, (4, 8), generator=g) for _ in range(3)]
    out: dict[str, Any] = {}
    cases = {
        "gpt2": (tr.GPT2LMHeadModel, gpt2, distributed.GPT2_PLAN, ft.optim.adamw(1e-2)),
        "llama": (tr.LlamaForCausalLM, llama, distributed.LLAMA_PLAN, ft.optim.sgd(0.1)),
    }
    for name, (cls, config, plan, tx) in cases.items():
        torch.manual_seed(0)
        net = cls(config).double()
        tp = distributed.tensor_parallel(net, plan, mesh)
        state, ref = tp.place(ft.TrainState.create(net, tx)), ft.TrainState.create(net, tx)
        step, ref_step = ft.make_train_step(net, lm, strategy=tp), ft.make_train_step(net, lm)
        for batch in data:
            state, _ = step(state, batch)
            ref, _ = ref_step(ref, batch)
        out[name] = max_diff(tp.gather(state).params, ref.params)
        out[f"{name}/split"] = sum(p.to_local().shape != p.shape for p in state.params.values())
    try:
        distributed.tensor_parallel(tr.GPT2LMHeadModel(tr.GPT2Config(**small)), distributed.GPT2_PLAN, mesh)
        out["dropout"] = "accepted"
    except ValueError as e:
        out["dropout"] = str(e)
    return out


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        if mode.startswith("grid")
        else None
    )
    mesh = mesh or init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"world_size": world}
    if mode == "eager":
        out["eager"] = run_tp(mesh, compile=False)
        out["refusals"] = refusals(mesh)
        out["resume"] = resume(mesh, out_dir)
        out["hf"] = hugging_face(mesh)
    elif mode == "compile":
        # clip 1e3: a factor of exactly 1. Clipping's factor is float32 (tree.global_norm): compiled, the
        # split leaves' norms round one float32 ulp away from one process's, which AdamW makes 2e-9
        out["compiled"] = run_tp(mesh, compile=True, clip=1e3)
        torch._dynamo.reset()  # another optimizer variant compiled in the same process, then the first again
        out["variant"] = run_tp(mesh, compile=True, clip=0.4)
        torch._dynamo.reset()
        out["recompiled"] = run_tp(mesh, compile=True, clip=1e3)
    elif mode == "grid":  # 4 ranks: dp 2 x tp 2
        out["grid"] = run_tp(mesh, compile=False)
        # a tp sub-mesh given by the user: one mesh object per group for every strategy (each mesh["tp"] is a
        # new, equal object, which made a process's second compile fail: see _own_mesh)
        tps = [distributed.tensor_parallel(GPT(), distributed.GPT_PLAN, mesh["tp"]) for _ in range(2)]
        out["own_mesh"] = tps[0].mesh is tps[1].mesh and tps[0].mesh.size() == mesh["tp"].size()
    elif mode == "grid_compile":
        out["grid"] = run_tp(mesh, compile=True, clip=1e3)  # clip 1e3: see "compile"
    else:
        raise SystemExit(f"unknown mode {mode}")
    save_results_and_exit(out, out_dir, mode)


if __name__ == "__main__":
    main()
