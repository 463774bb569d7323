"""The tensor-parallel Trainer jobs ``test_tensor_parallel_trainer.py`` launches with torchrun.

    python -m torch.distributed.run --nproc_per_node=N tests/tp_trainer_worker.py trainer OUT_DIR

``trainer``: the Trainer with ``tensor_parallel: 2`` on every rank (2 ranks: tp 2; 4 ranks: dp 2 x tp 2,
batch_size 4 per dp group, the reference's 8 in all), float64, eager: its final state gathered, evaluation,
prediction, each rank's param shapes, ``Trainer.save``/``load``, ``apply_gradients``, ``init_weights_from``
and the best checkpoint's weights loaded; then ``fit`` given a DataLoader whose
batches differ by rank (refused by the batch check). ``zero`` (4 ranks): the same with ``sharding:
optimizer`` and ``params`` (ZeRO over dp), and its stop and resume. Each rank writes ``OUT_DIR/trainer_rank<r>.pt`` (a
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
from functrain.trainer.core import _losses, _with_best


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
    out["applied"] = _applied(config)
    out["initialized"] = _initialized(config, out_dir, t)
    out["resumed"] = _resumed(config, out_dir)
    out["train_seen"] = _train_seen(t)
    out["mismatched"] = _mismatched_batches(t)
    out["second_batch"] = {when: _second_batch_differs(t, when) for when in ("first", "every")}


def zero(out: dict[str, Any], out_dir: str) -> None:
    """On 4 ranks: the Trainer with ``tensor_parallel: 2`` and ``sharding: optimizer`` / ``params`` (ZeRO-1
    and ZeRO-3 over dp 2), as :func:`trainer` runs it, and its bytes at rest, ``apply_gradients`` and
    ``init_weights_from`` on that state."""
    for level in ("optimizer", "params"):
        out[level] = _zero_level(level, os.path.join(out_dir, level))


def _zero_level(level: str, out_dir: str) -> dict[str, Any]:
    config = fixtures.config(os.path.join(out_dir, "run"), tensor_parallel=2, sharding=level, batch_size=4)
    t = ft.Trainer(
        fixtures.gpt(seed=dist.get_rank()), config, fixtures.tokens(48), fixtures.tokens(20, seed=1)
    )
    t.train()
    whole = t.tensor_parallel.gather(t.state)
    local = _bytes(t.state.params, t.state.opt_state)
    return {
        "params": whole.params,
        "opt_state": ft.tree.leaves(whole.opt_state),
        "step": int(t.state.step),
        "eval": t.evaluate(),
        "predict": t.predict(fixtures.tokens(6, seed=2)),
        "at_rest": local / _bytes(whole.params, whole.opt_state),
        "train_seen": _train_seen(t),
        "resumed": _resumed(config, out_dir),
        "applied": _applied(config),
        "initialized": _initialized(config, out_dir, t),
    }


def _bytes(*trees: Any) -> int:
    """The bytes this rank holds of ``trees``' tensors (a DTensor: its local part)."""
    xs = [x.to_local() if isinstance(x, DTensor) else x for x in ft.tree.leaves(trees)]
    return sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))


def _applied(config: ft.TrainerConfig) -> dict[str, Any]:
    """``TrainState.apply_gradients`` twice on the run's first state: whole plain gradients (the same on
    every rank), then the same as replicated DTensors of the tp mesh (:func:`fixtures.gradients`)."""
    t = ft.Trainer(fixtures.gpt(), config, fixtures.tokens(48))
    from torch.distributed.tensor import Replicate, distribute_tensor

    shapes = t.tensor_parallel.shapes  # the params' whole shapes (ZeRO-3 keeps row pieces)
    first, second = fixtures.gradients(shapes, 0), fixtures.gradients(shapes, 1)
    mesh = t.tensor_parallel.mesh
    second = {k: distribute_tensor(g, mesh, [Replicate()], src_data_rank=None) for k, g in second.items()}
    state = t.state.apply_gradients(first).apply_gradients(second)
    whole = t.tensor_parallel.gather(state)
    return {"params": whole.params, "opt_state": ft.tree.leaves(whole.opt_state), "step": int(state.step)}


def _initialized(config: ft.TrainerConfig, out_dir: str, trained: ft.Trainer) -> dict[str, Any]:
    """``fixtures.gpt(seed=11)``'s weights, from a file: the first state of a run with
    ``init_weights_from``, and ``trained``'s state given them as ``load_best_model_at_end`` gives the best
    checkpoint's (gathered; whether its params stayed DTensors)."""
    path = os.path.join(out_dir, "init.ckpt")
    if dist.get_rank() == 0:
        ft.checkpoint.save(path, ft.TrainState.create(fixtures.gpt(seed=11), ft.optim.sgd(0.1)))
    dist.barrier()
    t = ft.Trainer(
        fixtures.gpt(seed=dist.get_rank()), config.replace(init_weights_from=path), fixtures.tokens(48)
    )
    best = _with_best(config, trained.state, ft.checkpoint.restore(path))
    return {
        "init_weights_from": t.tensor_parallel.gather(t.state).params,
        "best": trained.tensor_parallel.gather(best).params,
        "best_placed": all(isinstance(v, DTensor) for v in best.params.values()),
    }


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
        {"trainer": trainer, "zero": zero}[mode](out, out_dir)
        torch.save(out, os.path.join(out_dir, f"{mode}_rank{env.rank}.pt"))
        distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_skipping_teardown()
