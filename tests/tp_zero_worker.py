"""Tensor parallelism with ZeRO over the dp axis of a 2-D mesh (dp 2 x tp 2, 4 ranks, gloo), the jobs the
tests launch; each rank computes the one-process reference itself (``tp_worker``'s model and batches).

    python -m torch.distributed.run --nproc_per_node=4 tests/tp_zero_worker.py MODE OUT_DIR

Modes: ``eager`` (8 AdamW steps with clipping at ZeRO levels none/optimizer/grads/params against one
process on the global batches; bytes at rest; gather -> place round trips; the eval forward; the
refusals; bf16 compute with float32 masters against float32), ``compile`` (levels none/optimizer/params
compiled in one process, 8 AdamW steps with clipping each, against one process). Each rank writes
``OUT_DIR/<mode>_rank<r>.pt`` (a test artefact read back by the test, not a checkpoint).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchrun_exit import save_results_and_exit
from tp_worker import adamw, batches, lm_loss, max_diff, model, reference

import functrain as ft
from functrain import distributed
from functrain.distributed.tp_forward import tensor_parallel_forward

LEVELS = (None, "optimizer", "grads", "params")
COMPILED = (None, "optimizer", "params")


def local_bytes(tree: Any) -> int:
    """Bytes this rank holds of a tree's tensors (a DTensor's local part)."""
    total = 0
    for x in ft.tree.leaves(tree):
        if isinstance(x, torch.Tensor):
            x = x.to_local() if isinstance(x, DTensor) else x
            total += x.numel() * x.element_size()
    return total


def make(mesh: Any, level: str | None, dtype: torch.dtype = torch.float64, clip: float = 0.4) -> tuple:
    net = model(seed=dist.get_rank()).to(dtype)  # each rank another model: place gives all rank 0's
    sharding = distributed.fully_shard(mesh["dp"], level=level) if level else None
    tp = distributed.tensor_parallel(net, distributed.GPT_PLAN, mesh, sharding=sharding)
    return net, tp, tp.place(ft.TrainState.create(net, adamw(clip)))


def run(mesh: Any, level: str | None, compile: bool = False, clip: float = 0.4) -> dict[str, Any]:
    """8 steps at ZeRO ``level``, each dp rank its half of a global batch of 8 rows, against one process."""
    net, tp, state = make(mesh, level, clip=clip)
    step = ft.make_train_step(net, lm_loss, strategy=tp)
    step = ft.jit(step) if compile else step
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    metrics = []
    for batch in batches(4 * dp):
        state, m = step(state, tuple(t.tensor_split(dp)[dp_rank] for t in batch))
        metrics.append(m)
    ref, ref_metrics = reference(clip, 4 * dp)
    whole = tp.gather(state)
    out = {
        "params": max_diff(whole.params, ref.params),
        "opt_state": max_diff(whole.opt_state, ref.opt_state),
        "loss": max(abs(m["loss"] - r["loss"]).item() for m, r in zip(metrics, ref_metrics)),
        "grad_norm": max(abs(m["grad_norm"] - r["grad_norm"]).item() for m, r in zip(metrics, ref_metrics)),
        "state_dict": max_diff(state.state_dict(), ref.state_dict()),
        "num_compiles": step.num_compiles if compile else None,
        "clipped": all(float(r["grad_norm"]) > clip for r in ref_metrics),
        "clip": clip,
        # per rank at rest, against one process's whole params + optimizer state
        "bytes_ratio": local_bytes((state.params, state.opt_state))
        / local_bytes((ref.params, ref.opt_state)),
        "params_ratio": local_bytes(state.params) / local_bytes(ref.params),
        "num_params": state.num_params == ref.num_params,
    }
    if not compile:
        # gather -> place gives this rank's layout back, bitwise
        again = tp.place(whole)
        out["replace"] = max(
            max_diff(ft.tree.map(_local, again.params), ft.tree.map(_local, state.params)),
            max_diff(ft.tree.map(_local, again.opt_state), ft.tree.map(_local, state.opt_state)),
        )
        # the eval step's forward on the state as it is (ZeRO-3: gathered)
        x, y = batches(4)[0]
        with tensor_parallel_forward(net):  # what ft.jit enters around a placed model's steps
            got = _local(ft.make_eval_step(net, lm_loss)(state, (x, y))["loss"])
        want = ft.make_eval_step(net, lm_loss)(ref, (x, y))["loss"]
        out["eval"] = abs(float(got) - float(want))
    return out


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def bf16(mesh: Any) -> dict[str, Any]:
    """ZeRO-3 x tp with bf16 compute and float32 masters (make_train_step(precision='bf16')) against the
    float32 one-process run, and one process's own bf16 run against the same float32 run (the error bf16
    makes without any parallelism)."""
    net, tp, state = make(mesh, "params", dtype=torch.float32)
    step = ft.make_train_step(net, lm_loss, strategy=tp, precision="bf16")
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    losses = []
    for batch in batches(4 * dp):
        state, m = step(state, tuple(t.tensor_split(dp)[dp_rank] for t in batch))
        losses.append(m["loss"])
    runs = {}
    for name, precision in (("f32", None), ("bf16", "bf16")):
        one = model().float()
        s, one_step, one_losses = ft.TrainState.create(one, adamw()), None, []
        one_step = ft.make_train_step(one, lm_loss, precision=precision)
        for batch in batches(4 * dp):
            s, m = one_step(s, batch)
            one_losses.append(m["loss"])
        runs[name] = (s, one_losses)
    (f32, f32_losses), (one_bf16, bf16_losses) = runs["f32"], runs["bf16"]
    whole = tp.gather(state)
    return {
        "masters": sorted({str(x.dtype) for x in ft.tree.leaves((state.params, state.opt_state)) if x.ndim}),
        "params": max_diff(whole.params, f32.params),
        "one_process_params": max_diff(one_bf16.params, f32.params),
        "loss": max(abs(a - b).item() / abs(b).item() for a, b in zip(losses, f32_losses)),
        "one_process_loss": max(abs(a - b).item() / abs(b).item() for a, b in zip(bf16_losses, f32_losses)),
    }


def refusals(mesh: Any) -> dict[str, str]:
    cases = {
        "blocks": lambda: distributed.fully_shard(mesh["dp"], level="params", blocks="auto"),
        "param_dtype": lambda: distributed.fully_shard(
            mesh["dp"], level="params", param_dtype=torch.bfloat16
        ),
        "world": lambda: distributed.fully_shard(level="params"),  # all 4 ranks, not the dp axis
    }
    out = {}
    for name, request in cases.items():
        try:
            distributed.tensor_parallel(model(), distributed.GPT_PLAN, mesh, sharding=request())
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    try:
        one_d = init_device_mesh("cpu", (dist.get_world_size(),))
        sharding = distributed.fully_shard(mesh["dp"], level="optimizer")
        distributed.tensor_parallel(model(), distributed.GPT_PLAN, one_d, sharding=sharding)
        out["one_d"] = "accepted"
    except ValueError as e:
        out["one_d"] = str(e)
    # a factored moment (as Adafactor keeps): named after its param, not of its shape
    factored = ft.optim.GradientTransformation(
        init=lambda params: {k: p.sum(0) for k, p in params.items()},
        update=lambda updates, state, params=None: (updates, state),
    )
    net = model()
    tp = distributed.tensor_parallel(
        net, distributed.GPT_PLAN, mesh, sharding=distributed.fully_shard(mesh["dp"], level="optimizer")
    )
    try:
        tp.place(ft.TrainState.create(net, factored))
        out["factored"] = "placed"
    except ValueError as e:
        out["factored"] = str(e)
    return out


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {"world_size": world}
    if mode == "eager":
        for level in LEVELS:
            out[str(level)] = run(mesh, level)
        out["refusals"] = refusals(mesh)
        out["bf16"] = bf16(mesh)
    elif mode == "compile":
        # one process, one step object per level, each compiled once: a later level's trace meets the
        # DTensor caches an earlier level's ops filled (the second compile used to fail in inductor)
        for level in COMPILED:
            started = time.perf_counter()
            out[str(level)] = run(mesh, level, compile=True)
            out[str(level)]["wall_s"] = time.perf_counter() - started
    else:
        raise SystemExit(f"unknown mode {mode}")
    save_results_and_exit(out, out_dir, mode)


if __name__ == "__main__":
    main()
