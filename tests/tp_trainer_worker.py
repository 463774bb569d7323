"""The tensor-parallel Trainer jobs ``test_tensor_parallel_trainer.py`` launches with torchrun.

    python -m torch.distributed.run --nproc_per_node=N tests/tp_trainer_worker.py trainer OUT_DIR

``trainer``: the Trainer with ``tensor_parallel: 2`` on every rank (2 ranks: tp 2; 4 ranks: dp 2 x tp 2,
batch_size 4 per dp group, the reference's 8 in all), float64, eager: its final state gathered, evaluation,
prediction, each rank's param shapes, ``Trainer.save``/``load``; then ``fit`` given a DataLoader whose
batches differ by rank (refused by the batch check). Each rank writes ``OUT_DIR/trainer_rank<r>.pt`` (a
test artefact read back by the test, not a checkpoint).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import tp_trainer_fixtures as fixtures
from torch.distributed.tensor import DTensor
from torchrun_exit import exit_skipping_teardown

import functrain as ft
from functrain import distributed
from functrain.trainer.core import _losses


def trainer(out: dict[str, Any], out_dir: str) -> None:
    world = dist.get_world_size()
    config = fixtures.config(os.path.join(out_dir, "run"), tensor_parallel=2, batch_size=8 * 2 // world)
    # each rank starts from other weights: the state placed gets global rank 0's
    t = ft.Trainer(
        fixtures.gpt(seed=dist.get_rank()), config, fixtures.tokens(48), fixtures.tokens(20, seed=1)
    )
    t.train()
    whole = t.tensor_parallel.gather(t.state)
    out["params"] = whole.params
    out["opt_state"] = ft.tree.leaves(whole.opt_state)
    out["step"] = int(t.state.step)
    out["local_shapes"] = {k: tuple(v.to_local().shape) for k, v in t.state.params.items()}
    out["dtensor_params"] = all(isinstance(v, DTensor) for v in t.state.params.values())
    out["eval"] = t.evaluate()
    out["history_eval"] = t.result.history.series("eval/loss") if t.result is not None else None
    out["predict"] = t.predict(fixtures.tokens(6, seed=2))
    path = os.path.join(out_dir, "final.ckpt")
    t.save(path)  # gathered, rank 0 writes
    fresh = ft.Trainer(
        fixtures.gpt(seed=7), config.replace(output_dir=os.path.join(out_dir, "fresh")), fixtures.tokens(8)
    )
    loaded = fresh.load(path)
    out["loaded"] = fresh.tensor_parallel.gather(loaded).params
    out["resumed"] = _resumed(config, out_dir)
    out["train_seen"] = _train_seen(t)
    out["mismatched"] = _mismatched_batches(t)
    out["second_batch"] = {when: _second_batch_differs(t, when) for when in ("first", "every")}


def _resumed(config: ft.TrainerConfig, out_dir: str) -> dict[str, Any]:
    """The same run stopped after its first epoch (checkpoint saved at each epoch end), then resumed by a
    second Trainer with ``resume_from_checkpoint``: its gathered params at the end, and the checkpoint."""
    config = config.replace(output_dir=os.path.join(out_dir, "resumed"), save_strategy="epoch")
    first = ft.Trainer(
        fixtures.gpt(), config.replace(epochs=1), fixtures.tokens(48), fixtures.tokens(20, seed=1)
    )
    first.train()
    again = ft.Trainer(
        fixtures.gpt(seed=3), config.replace(resume_from_checkpoint=True), fixtures.tokens(48),
        fixtures.tokens(20, seed=1),
    )  # fmt: skip
    again.train()
    whole = again.tensor_parallel.gather(again.state)
    files = [os.path.join(d, f) for d, _, fs in os.walk(config.output_dir) for f in fs if f.endswith(".ckpt")]
    return {
        "params": whole.params,
        "opt_state": ft.tree.leaves(whole.opt_state),
        "step": int(again.state.step),
        "checkpoints": {ft.checkpoint.read_header(f).step: f for f in files},
    }


def _train_seen(t: ft.Trainer) -> list[float]:
    """``fit`` with a sum-type train metric (examples seen), logged every 2 steps of 4 examples per dp
    group: each tp group counts its examples once, so each log says ``2 * 4 * dp``."""
    seen = ft.metrics.Collection({"seen": fixtures.Seen()})
    step = ft.make_train_step(t.model, _losses(t).train, metrics=seen, strategy=t.tensor_parallel)
    data = fixtures.tokens(16 * dist.get_world_size() // 2)  # 4 steps of 4 examples per dp group
    result = ft.fit(
        t.state.replace(metrics=seen.empty()), step, data, batch_size=4, additional_steps=4, log_steps=2,
        progress_bar=False,
    )  # fmt: skip
    return result.history.series("train/seen")


def _mismatched_batches(t: ft.Trainer) -> str:
    """``fit`` given a DataLoader that gives each rank other examples (as a DistributedSampler over every
    rank would): the batch check must refuse it before the step trains on them."""
    rank = dist.get_rank()
    data = torch.utils.data.DataLoader(fixtures.tokens(8, seed=10 + rank), batch_size=4)
    try:
        ft.fit(t.state, t._jit("train"), data, additional_steps=1, progress_bar=False)
    except ValueError as error:
        return str(error)
    return ""


def _second_batch_differs(t: ft.Trainer, check_batches: str) -> str:
    """2 steps whose first batch is the same on every rank and whose second is not: ``check_batches="every"``
    refuses the second, ``"first"`` (the default) checks the first only."""
    x, y = fixtures.tokens(8, seed=10).tensors
    x = x.clone()
    x[4:] = (x[4:] + dist.get_rank()) % 13  # rows of the second batch differ by rank
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    try:
        ft.fit(
            t.state,
            t._jit("train"),
            data,
            additional_steps=2,
            progress_bar=False,
            check_batches=check_batches,
        )
    except ValueError as error:
        return str(error)
    return ""


def main(mode: str, out_dir: str) -> None:
    import datetime

    with distributed.initialize(timeout=datetime.timedelta(seconds=120)) as env:
        out: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size}
        {"trainer": trainer}[mode](out, out_dir)
        torch.save(out, os.path.join(out_dir, f"{mode}_rank{env.rank}.pt"))
        distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_skipping_teardown()
