"""The eager tensor-parallel step on plain autograd against the same step through ``torch.func`` (4 gloo
ranks, float64), the job ``test_tensor_parallel_plain.py`` launches.

    python -m torch.distributed.run --nproc_per_node=4 tests/tp_plain_worker.py plain OUT_DIR

Every layout of ``functrain.distributed.tensor_parallel``: ``tp_worker``'s GPT (colwise q, k, v, fc;
rowwise projections) on the tp axis alone and on dp 2 x tp 2 at every ZeRO level (2 micro-batches), and a
model whose embedding is split colwise or rowwise and tied to its head, reading a buffer; and bf16 compute
with float32 params at ZeRO-3. Each case runs 3
AdamW steps twice from the same placed state: as the step runs eagerly (plain autograd, counted), and with
``plain_autograd_applies`` patched to refuse (``torch.func.grad_and_value`` at every call, as on main);
plus one gradient of the placed params by ``loss_and_grad`` on both paths, and the plain run against one
process on the global batches. Each rank writes ``OUT_DIR/plain_rank<r>.pt`` (a test artefact read back by
the test, not a checkpoint).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torchrun_exit import save_results_and_exit
from tp_worker import GPT, SEQ, Block, adamw, batches, lm_loss, max_diff

import functrain as ft
from functrain import distributed
from functrain.step import grad as grad_module
from functrain.step.bind import model_call

# every gradient through torch.func.grad_and_value, as before DTensor params took plain autograd
torch_func_only = mock.patch.object(grad_module, "plain_autograd_applies", lambda params: False)

D, VOCAB, STEPS = 8, 14, 3  # an even vocabulary: the rowwise embedding splits it


class TiedLM(nn.Module):
    """An embedding tied to the head (one param used twice), a positional buffer, one GPT block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.register_buffer("pos", torch.randn(SEQ, D))
        self.block, self.ln = Block(), nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.ln(self.block(x)))


def tied_loss(call: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = call(batch[0])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))


def tied_batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))
        for _ in range(STEPS)
    ]


# name -> (model maker, plan, loss, batches)
MODELS: dict[str, tuple[Callable[[], nn.Module], dict, Any, Callable[[int], list]]] = {
    "gpt": (GPT, distributed.GPT_PLAN, lm_loss, lambda rows: batches(rows)[:STEPS]),
    "tied_colwise": (TiedLM, {**distributed.GPT_PLAN, "embed": "colwise"}, tied_loss, tied_batches),
    "tied_rowwise": (TiedLM, {**distributed.GPT_PLAN, "embed": "rowwise"}, tied_loss, tied_batches),
}


def _net(name: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().to(dtype)


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _bitwise(a: Any, b: Any) -> bool:
    """The same tree of tensors, bitwise: local parts, placements and dtypes."""
    la, lb = ft.tree.leaves(a), ft.tree.leaves(b)
    return len(la) == len(lb) and all(
        getattr(x, "placements", None) == getattr(y, "placements", None)
        and torch.equal(_local(x), _local(y))
        and x.dtype == y.dtype
        for x, y in zip(la, lb)
        if isinstance(x, torch.Tensor)
    )


class Paths:
    """Counts what ``functrain.step.grad`` runs: plain autograd's calls, and the loss's calls under a
    ``torch.func`` transform (the first call's check, or every call with the plain path refused)."""

    def __init__(self) -> None:
        self.plain = 0
        self.transformed = 0
        inner = grad_module._plain_grad_and_value

        def plain(*args: Any) -> Any:
            self.plain += 1
            return inner(*args)

        grad_module._plain_grad_and_value = plain

    def loss(self, loss_fn: Any) -> Any:
        def counted(call: Any, batch: Any) -> Any:
            self.transformed += torch._C._functorch.peek_interpreter_stack() is not None
            return loss_fn(call, batch)

        return counted

    def reset(self) -> dict[str, int]:
        out = {"plain": self.plain, "transformed": self.transformed}
        self.plain = self.transformed = 0
        return out


def train(paths: Paths, name: str, mesh: Any, level: Any, accumulate: int, precision: Any) -> dict[str, Any]:
    """3 steps from the placed state; the state, the metrics and which paths ran. bf16: float32 params."""
    _, plan, loss_fn, data = MODELS[name]
    net = _net(name, torch.float32 if precision else torch.float64)
    paths.reset()  # what ran before (another case's one-process reference) is not this run's
    two_d = mesh.ndim == 2
    sharding = distributed.fully_shard(mesh["dp"], level=level) if level else None
    tp = distributed.tensor_parallel(net, plan, mesh, sharding=sharding)
    state = tp.place(ft.TrainState.create(net, adamw()))
    step = ft.make_train_step(
        net, paths.loss(loss_fn), strategy=tp, accumulate=accumulate, precision=precision
    )
    dp, dp_rank = (mesh["dp"].size(), mesh["dp"].get_local_rank()) if two_d else (1, 0)
    metrics = []
    for batch in data(4 * dp):
        state, m = step(state, tuple(t.tensor_split(dp)[dp_rank] for t in batch))
        metrics.append(m)
    return {"state": state, "metrics": metrics, "whole": tp.gather(state), "paths": paths.reset()}


def _one_process_diff(whole: ft.TrainState, ref: ft.TrainState) -> float:
    return max(max_diff(whole.params, ref.params), max_diff(whole.opt_state, ref.opt_state))


def one_process(name: str, rows: int) -> ft.TrainState:
    _, _, loss_fn, data = MODELS[name]
    net = _net(name)
    state, step = ft.TrainState.create(net, adamw()), ft.make_train_step(net, loss_fn)
    for batch in data(rows):
        state, _ = step(state, batch)
    return state


def gradient(name: str, mesh: Any) -> tuple[dict, tuple]:
    """``loss_and_grad``'s gradient of the placed params (the step's differentiated function, as the
    step calls it) and the loss."""
    _, plan, loss_fn, data = MODELS[name]
    net = _net(name)
    tp = distributed.tensor_parallel(net, plan, mesh)
    state = tp.place(ft.TrainState.create(net, adamw()))
    bind = model_call(net)
    fn = grad_module.loss_and_grad(lambda p, batch: (loss_fn(bind(p, state.buffers), batch), ()))
    with implicit_replication():
        fn(state.params, data(4)[0])  # the first call's check
        return fn(state.params, data(4)[1])


class Marked(torch.Tensor):
    """A tensor subclass functrain knows nothing of."""


def applies(mesh: Any) -> dict[str, bool]:
    """``plain_autograd_applies`` on DTensor params: a DTensor of a plain tensor takes plain autograd; one
    of another subclass, one that requires grad, or another subclass keeps ``torch.func``."""
    local = torch.ones(2, dtype=torch.float64)
    cases = {
        "dtensor": DTensor.from_local(local, mesh, [Replicate()]),
        "dtensor_requires_grad": DTensor.from_local(local, mesh, [Replicate()]).requires_grad_(),
        "dtensor_of_subclass": DTensor.from_local(local.as_subclass(Marked), mesh, [Replicate()]),
        "subclass": local.as_subclass(Marked),
    }
    return {k: grad_module.plain_autograd_applies({"w": v}) for k, v in cases.items()}


def run(mesh2d: Any) -> dict[str, Any]:
    paths = Paths()
    tp_only = mesh2d["tp"]  # a 1-D tp mesh (both dp groups run the same job)
    cases = {
        **{f"tp/{name}": (name, tp_only, None, 1, None) for name in MODELS},
        **{
            f"dp2xtp2/{level}": ("gpt", mesh2d, level, 2, None)
            for level in (None, "optimizer", "grads", "params")
        },
        "dp2xtp2/params/tied_rowwise": ("tied_rowwise", mesh2d, "params", 2, None),
        "dp2xtp2/params/bf16": ("gpt", mesh2d, "params", 2, "bf16"),  # float32 masters, bf16 compute
    }
    out: dict[str, Any] = {}
    for key, (name, mesh, level, accumulate, precision) in cases.items():
        plain = train(paths, name, mesh, level, accumulate, precision)
        with torch_func_only:
            func = train(paths, name, mesh, level, accumulate, precision)
        dp = mesh.size(0) if mesh.ndim == 2 else 1
        ref = one_process(name, 4 * dp) if precision is None else None  # bf16: rounding, not parity
        out[key] = {
            "paths": plain["paths"],
            "func_paths": func["paths"],
            "calls": STEPS * accumulate,
            "state": _bitwise(
                (plain["state"].params, plain["state"].opt_state, plain["state"].buffers),
                (func["state"].params, func["state"].opt_state, func["state"].buffers),
            ),
            "metrics": _bitwise(plain["metrics"], func["metrics"]),
            "one_process": None if ref is None else _one_process_diff(plain["whole"], ref),
        }
    out["applies"] = applies(tp_only)
    for name in MODELS:
        plain_grads, (plain_value, _) = gradient(name, tp_only)
        with torch_func_only:
            func_grads, (func_value, _) = gradient(name, tp_only)
        out[f"grad/{name}"] = {
            "bitwise": _bitwise(plain_grads, func_grads) and _bitwise(plain_value, func_value),
            "dtensors": all(isinstance(g, DTensor) for g in plain_grads.values()),
            "names": sorted(plain_grads) == sorted(func_grads),
        }
    return out


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if mode != "plain":
        raise SystemExit(f"unknown mode {mode}")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    out = run(mesh)
    save_results_and_exit(out, out_dir, mode)


if __name__ == "__main__":
    main()
