"""Combinations a user would try with tensor parallelism, each against one process on the same batches
(float64, gloo, eager); run by ``tests/test_tensor_parallel_review.py``.

    python -m torch.distributed.run --nproc_per_node=2 tests/tp_review_worker.py review OUT_DIR

Each check gives the largest difference to one process (a float) or the error it raised (a string).
Rank r writes ``OUT_DIR/review_rank<r>.pt`` (a test artefact read back by the test, not a checkpoint).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchrun_exit import save_results_and_exit
from tp_worker import GPT, VOCAB, batches, lm_loss, max_diff

import functrain as ft
from functrain import distributed

STEPS = 3


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT().double()


class Tied(GPT):
    """The GPT with its head tied to the embedding (GPT-2's wte / lm_head), a vocabulary of 14 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB + 1, 8), nn.Linear(8, VOCAB + 1, bias=False)
        self.head.weight = self.embed.weight


def tied_loss(call: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = call(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def remat_gpt() -> nn.Module:
    net = gpt()
    for block in net.blocks:
        ft.remat(block)
    return net


def tied() -> nn.Module:
    torch.manual_seed(0)
    return Tied().double()


class Twice(nn.Module):
    """An MLP whose ``sq`` is called twice, with an int buffer and a BatchNorm (its input split where the plan
    splits ``sq`` colwise)."""

    def __init__(self, norm: bool = True, stats: bool = True) -> None:
        super().__init__()
        self.fc, self.sq, self.proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.norm = nn.BatchNorm1d(8, track_running_stats=stats) if norm else nn.Identity()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sq(torch.tanh(self.fc(x)))
        h = self.sq(torch.tanh(h))  # the same weight used twice
        return self.proj(self.norm(torch.tanh(h)))


def twice(norm: bool = True, stats: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return Twice(norm, stats).double()


def mse(call: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(call(x), y)


def regression() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(8, 8, generator=g, dtype=torch.float64),
            torch.randn(8, 1, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def adamw() -> ft.optim.GradientTransformation:
    return ft.optim.chain(ft.optim.clip_by_global_norm(0.4), ft.optim.adamw(1e-2, weight_decay=0.1))


def versus_one_process(
    mesh: Any,
    make: Callable[[], nn.Module],
    plan: dict[str, str],
    tx: Callable[[nn.Module], ft.optim.GradientTransformation],
    data: list[Any] | None = None,
    loss: Any = lm_loss,
    **step_kwargs: Any,
) -> float:
    """``STEPS`` steps under tp against one process: the largest difference of params, optimizer state,
    buffers and metrics."""
    data = data or batches()[:STEPS]
    net, ref_net = make(), make()
    tp = distributed.tensor_parallel(net, plan, mesh)
    state = tp.place(ft.TrainState.create(net, tx(net)))
    ref = ft.TrainState.create(ref_net, tx(ref_net))
    step = ft.make_train_step(net, loss, strategy=tp, **step_kwargs)
    ref_step = ft.make_train_step(ref_net, loss, **step_kwargs)
    worst = 0.0
    for batch in data:
        state, m = step(state, batch)
        ref, r = ref_step(ref, batch)
        worst = max(worst, max(abs(float(m[k]) - float(r[k])) for k in r if k in ("loss", "grad_norm")))
    whole = tp.gather(state)
    parts = [(whole.params, ref.params), (whole.opt_state, ref.opt_state), (whole.buffers, ref.buffers)]
    return max([worst] + [max_diff(a, b) for a, b in parts if ft.tree.leaves(a)])


def tied_placement(mesh: Any, plan: dict[str, str]) -> str:
    """The placement of the tied embedding and head weight (one param, named ``embed.weight``)."""
    return str(distributed.tensor_parallel(tied(), plan, mesh).placements["embed.weight"])


def evaluated(mesh: Any) -> float:
    """The hand-written (not jitted) eval and predict steps on a placed state against one process: the
    largest difference of loss, num_examples and predictions, which must come back plain tensors."""
    net, ref_net = gpt(), gpt()
    tp = distributed.tensor_parallel(net, distributed.GPT_PLAN, mesh)
    state = tp.place(ft.TrainState.create(net, adamw()))
    ref = ft.TrainState.create(ref_net, adamw())
    worst = 0.0
    for batch in batches()[:2]:
        out = ft.make_eval_step(net, lm_loss)(state, batch)
        want = ft.make_eval_step(ref_net, lm_loss)(ref, batch)
        preds = ft.make_predict_step(net)(state, batch)
        assert all(type(x) is torch.Tensor for x in (out["loss"], preds)), (type(out["loss"]), type(preds))
        worst = max(worst, max_diff(preds, ft.make_predict_step(ref_net)(ref, batch)))
        worst = max(
            worst, max_diff(out["loss"], want["loss"]), abs(out["num_examples"] - want["num_examples"])
        )
    return worst


def run_all(mesh: Any) -> dict[str, Any]:
    plan = distributed.GPT_PLAN
    twice_plan = {"fc": "colwise", "sq": "colwise"}
    checks: dict[str, Callable[[], Any]] = {
        "accumulate": lambda: versus_one_process(mesh, gpt, plan, lambda n: adamw(), accumulate=2),
        "masked_decay": lambda: versus_one_process(
            mesh,
            gpt,
            plan,
            lambda n: ft.optim.masked(
                ft.optim.adamw(1e-2, weight_decay=0.1),
                ft.optim.mask_by_name(dict(n.named_parameters()), ["*.weight"]),
            ),
        ),
        "freeze": lambda: versus_one_process(
            mesh,
            gpt,
            plan,
            lambda n: ft.optim.freeze(
                adamw(), ft.optim.mask_by_name(dict(n.named_parameters()), ["*attn.q.*"])
            ),
        ),
        "ema": lambda: versus_one_process(
            mesh, gpt, plan, lambda n: ft.optim.chain(adamw(), ft.optim.averaging.ema(0.9))
        ),
        "remat": lambda: versus_one_process(mesh, remat_gpt, plan, lambda n: adamw()),
        "per_example": lambda: versus_one_process(mesh, gpt, plan, lambda n: adamw(), per_example=True),
        "dpsgd": lambda: versus_one_process(
            mesh, gpt, plan, lambda n: ft.optim.dpsgd(0.1, 0.5, 0.0, seed=0), per_example=True
        ),
        "sam": lambda: versus_one_process(mesh, gpt, plan, lambda n: adamw(), sam_rho=0.05),
        "tied_head_colwise": lambda: versus_one_process(
            mesh, tied, {**plan, "head": "colwise"}, lambda n: adamw(), loss=tied_loss
        ),
        "tied_embed_colwise": lambda: versus_one_process(
            mesh, tied, {**plan, "embed": "colwise"}, lambda n: adamw(), loss=tied_loss
        ),
        "twice_no_norm": lambda: versus_one_process(
            mesh, lambda: twice(False), twice_plan, lambda n: adamw(), regression(), mse
        ),
        "norm_replicated_input": lambda: versus_one_process(
            mesh, twice, {"fc": "colwise", "sq": "rowwise"}, lambda n: adamw(), regression(), mse
        ),
        "norm_split_input": lambda: versus_one_process(
            mesh, twice, twice_plan, lambda n: adamw(), regression(), mse
        ),
        "norm_split_input_frozen": lambda: versus_one_process(
            mesh, twice, twice_plan, lambda n: adamw(), regression(), mse, freeze_batchnorm=True
        ),
        "norm_split_input_no_stats": lambda: versus_one_process(
            mesh, lambda: twice(stats=False), twice_plan, lambda n: adamw(), regression(), mse
        ),
        "tied_head_replicate": lambda: tied_placement(mesh, {**plan, "head": "replicate"}),
        "tied_conflict": lambda: tied_placement(mesh, {**plan, "head": "colwise", "embed": "colwise"}),
        "evaluate": lambda: evaluated(mesh),
        "padded": lambda: versus_one_process(  # 6 real rows of 8 (pad_train_batches' MaskedBatch)
            mesh,
            lambda: twice(False),
            {"fc": "colwise", "sq": "rowwise"},
            lambda n: adamw(),
            [ft.data.pad_batch(tuple(t[:6] for t in b), 8) for b in regression()],
            mse,
        ),
        "weight_twice_rowwise": lambda: versus_one_process(
            mesh,
            lambda: twice(False),
            {"fc": "colwise", "sq": "rowwise"},
            lambda n: adamw(),
            regression(),
            mse,
        ),
    }
    out: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            out[name] = check()
        except Exception as e:  # the review records what each combination does
            out[name] = f"{type(e).__name__}: {e}"
            if os.environ.get("TP_REVIEW_TRACE"):
                traceback.print_exc()
    return out


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode != "review":
        raise SystemExit(f"unknown mode {mode}")
    out = run_all(mesh)
    save_results_and_exit(out, out_dir, mode)


if __name__ == "__main__":
    main()
