"""Checkpoints of a tensor-parallel state, written on tp 2 x dp 2 and resumed on other layouts (4 ranks).

    python -m torch.distributed.run --nproc_per_node=4 tests/tp_checkpoint_worker.py layouts OUT_DIR

``layouts``: ``ft.fit`` trains tp_worker's GPT-style model (float64, AdamW with clipping) for 8 steps on a
dp 2 x tp 2 mesh, its CheckpointManager saving at steps 4 and 8 (``OUT_DIR/run``); a callback keeps the
gathered state at both steps. Then, in the same processes, the step-4 file is resumed by ``fit`` on
tp 2 x dp 2 again, on tp 1 x dp 4 and on tp 4 (each in its own copy of the folder), the restored state and
the final one gathered. Also: ``ft.checkpoint.save`` of the placed state on every rank, its metadata,
``to_state_dict`` of it. Each rank writes ``OUT_DIR/layouts_rank<r>.pt`` (a test artefact read back by the
test, not a checkpoint).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
import tp_worker as base
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchrun_exit import save_results_and_exit

import functrain as ft
from functrain import distributed
from functrain.callbacks import Callback
from functrain.checkpoint import sharded
from functrain.data import Loader

STEPS, GLOBAL_BATCH, SAVED = 8, 8, 4
HEADS = 4  # split over tp 4 too
# (name, dp, tp): the layout the run is written on first, then those it is resumed on
LAYOUTS = {"tp2xdp2": (2, 2), "tp1xdp4": (4, 1), "tp4": (1, 4)}


def examples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of 8 global batches of 8 rows, as examples (a Loader slices each global batch by dp rank)."""
    return [(x[i], y[i]) for x, y in base.batches(GLOBAL_BATCH)[:STEPS] for i in range(GLOBAL_BATCH)]


def loader(dp: int, dp_rank: int) -> Loader:
    return Loader(examples(), GLOBAL_BATCH // dp, shuffle=False, rank=dp_rank, world_size=dp)


def setup(dp: int, tp: int) -> tuple[Any, Any, Any, Loader]:
    """A tp strategy on a dp x tp mesh, a placed fresh state (each rank another init: ``place`` or a
    restore decides), its eager step, and this rank's loader."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if dp > 1 else None
    mesh = mesh or init_device_mesh("cpu", (tp,))
    net = base.model(seed=dist.get_rank(), heads=HEADS)
    strategy = distributed.tensor_parallel(net, distributed.GPT_PLAN, mesh)
    state = strategy.place(ft.TrainState.create(net, base.adamw()))
    dp_rank = mesh["dp"].get_local_rank() if dp > 1 else 0
    return strategy, state, ft.make_train_step(net, base.lm_loss, strategy=strategy), loader(dp, dp_rank)


def train(state: Any, step: Any, data: Loader, start: int, manager: Any, strategy: Any = None) -> Any:
    """Steps ``start + 1 .. STEPS``, saving ``{"state", "loop"}`` (the tree ``fit`` saves) at every
    multiple of ``SAVED`` through ``manager``; with ``strategy``, the gathered state after each save."""
    kept = {}
    for index, batch in enumerate(data.epoch(0, start), start=start + 1):
        state, _ = step(state, batch)
        if index % SAVED == 0:
            manager.save(index, {"state": state, "loop": {"position": index}})
            if strategy is not None:
                kept[index] = strategy.gather(state)
    return state, kept


def read(path: str, loop: bool = True) -> Any:
    """The state in ``path``, restored onto a plain one-process state (whole tensors)."""
    plain = ft.TrainState.create(base.model(heads=HEADS), base.adamw())
    if not loop:
        return ft.checkpoint.restore(path, target=plain)
    return ft.checkpoint.restore(path, target={"state": plain, "loop": {"position": 0}})["state"]


def split_as_planned(strategy: Any, state: Any) -> bool:
    """Every param a DTensor of the strategy's placement, its local part 1/tp of a split dim."""
    for name, p in state.params.items():
        want = strategy.placements[name]
        if not isinstance(p, DTensor) or tuple(p.placements) != want:
            return False
        shard = want[0].dim if want[0].is_shard() else None
        if shard is not None and p.to_local().shape[shard] * strategy.mesh.size() != p.shape[shard]:
            return False
    return True


def layouts(out_dir: str) -> dict[str, Any]:
    """Written on tp 2 x dp 2 (the manager, as ``fit`` saves), resumed on each layout of LAYOUTS."""
    rank = dist.get_rank()
    run = os.path.join(out_dir, "run")
    strategy, state, step, data = setup(*LAYOUTS["tp2xdp2"])
    final, kept = train(
        state, step, data, 0, ft.checkpoint.CheckpointManager(run, max_to_keep=None), strategy
    )
    saved = ft.checkpoint.CheckpointManager(run).path(SAVED)
    out: dict[str, Any] = {
        "uninterrupted": {s: {"params": g.params, "opt_state": g.opt_state} for s, g in kept.items()},
        "saved_path": saved,
        "metadata": ft.checkpoint.read_header(saved).metadata,
        "file_vs_gathered": base.max_diff(read(saved), kept[SAVED]),
    }
    # the plain API on every rank (each its own path), and the state_dict export: whole tensors
    path = os.path.join(out_dir, f"save_rank{rank}.ckpt")
    ft.checkpoint.save(path, final, step=STEPS)
    out["save_vs_gathered"] = base.max_diff(read(path, loop=False), kept[STEPS])
    out["save_metadata"] = ft.checkpoint.read_header(path).metadata
    whole = ft.checkpoint.to_state_dict(final)
    out["state_dict_vs_gathered"] = max(
        (whole[k] - kept[STEPS].params[k]).abs().max().item() for k in kept[STEPS].params
    )
    out["state_dict_plain"] = all(type(t) is torch.Tensor for t in whole.values())
    for name, (dp, tp) in LAYOUTS.items():
        directory = os.path.join(out_dir, f"resume_{name}")
        if rank == 0:
            os.makedirs(directory)
            shutil.copy(saved, directory)
        dist.barrier()
        strategy, fresh, step, data = setup(dp, tp)
        manager = ft.checkpoint.CheckpointManager(directory, max_to_keep=None)
        # the loop's resume (functrain.loop.run): the file read plain, put onto the run's state
        loaded = ft.checkpoint.restore_onto(fresh, manager.restore(SAVED)["state"])
        # and a restore given the target
        targeted = manager.restore(SAVED, target={"state": fresh, "loop": {"position": 0}})["state"]
        resumed, _ = train(loaded, step, data, SAVED, manager)
        whole = strategy.gather(resumed)
        # the weights alone (fine-tuning): filled whole, placed again; the fresh moments kept
        weights, report = ft.checkpoint.init_weights_from(saved, fresh, strict=True)
        out[name] = {
            "init_weights_placed": split_as_planned(strategy, weights) and report.complete,
            "init_weights_vs_file": base.max_diff(strategy.gather(weights).params, kept[SAVED].params),
            "init_weights_moments_kept": base.max_diff(
                strategy.gather(weights).opt_state, strategy.gather(fresh).opt_state
            ),
            "loaded_placed": split_as_planned(strategy, loaded) and split_as_planned(strategy, targeted),
            "loaded_vs_uninterrupted": base.max_diff(strategy.gather(loaded), kept[SAVED]),
            "targeted_vs_uninterrupted": base.max_diff(strategy.gather(targeted), kept[SAVED]),
            "resumed_placed": split_as_planned(strategy, resumed),
            "resumed_step": int(resumed.step),
            "resumed_vs_uninterrupted": base.max_diff(whole, kept[STEPS]),
            "params_vs_uninterrupted": base.max_diff(whole.params, kept[STEPS].params),
            "its_file_vs_uninterrupted": base.max_diff(read(manager.path(STEPS)), kept[STEPS]),
        }
    return out


class Keep(Callback):
    """The gathered state after every ``SAVED`` steps (collective: every rank runs the callbacks)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy, self.kept = strategy, {}

    def on_step_end(self, state: Any, ctx: Any) -> Any:
        if ctx.step % SAVED == 0:
            self.kept[ctx.step] = self.strategy.gather(state)
        return state


def fit(state: Any, step: Any, data: Loader, directory: str, **kwargs: Any) -> Any:
    manager = ft.checkpoint.CheckpointManager(directory, max_to_keep=None)
    return ft.fit(
        state,
        step,
        data,
        max_steps=STEPS,
        checkpoints=manager,
        save_every=SAVED,
        progress_bar=False,
        **kwargs,
    ).state


def fit_mode(out_dir: str) -> dict[str, Any]:
    """One rank, a tp mesh of 1 (``fit`` refuses a tp step on more ranks until it gives a tp group one
    batch): ``fit`` saves the placed state at steps 4 and 8, and resumes step 4 onto a placed state and
    onto a plain one."""
    strategy, state, step, data = setup(1, 1)
    keep = Keep(strategy)
    fit(state, step, data, os.path.join(out_dir, "fit"), callbacks=(keep,))
    saved = os.path.join(out_dir, "fit", os.path.basename(ft.checkpoint.CheckpointManager(".").path(SAVED)))
    out: dict[str, Any] = {"metadata": ft.checkpoint.read_header(saved).metadata}
    try:  # a DTensor outside a placed state: no strategy to gather it, refused
        ft.checkpoint.save(os.path.join(out_dir, "stray.ckpt"), {"w": state.params["blocks.0.attn.q.weight"]})
        out["stray"] = "written"
    except ft.checkpoint.CheckpointError as e:
        out["stray"] = str(e)
    out["sharded"] = {}
    for name, call in (
        ("save", lambda: sharded.save_sharded(os.path.join(out_dir, "sharded"), SAVED, state)),
        ("restore", lambda: sharded.restore_sharded(os.path.join(out_dir, "sharded"), target=state)),
    ):
        try:  # a placed state is saved whole by its strategy: a sharded checkpoint of it is refused
            call()
            out["sharded"][name] = "accepted"
        except ft.checkpoint.CheckpointError as e:
            out["sharded"][name] = str(e)
    for name in ("placed", "plain"):
        directory = os.path.join(out_dir, f"fit_{name}")
        os.makedirs(directory)
        shutil.copy(saved, directory)
        strategy, fresh, step, data = setup(1, 1)
        if name == "plain":
            net = base.model(heads=HEADS)
            fresh, step = ft.TrainState.create(net, base.adamw()), ft.make_train_step(net, base.lm_loss)
        resumed = fit(fresh, step, data, directory, resume_from_checkpoint=True)
        whole = strategy.gather(resumed) if name == "placed" else resumed
        out[name] = {
            "placed": split_as_planned(strategy, resumed),
            "step": int(resumed.step),
            "vs_uninterrupted": base.max_diff(whole, keep.kept[STEPS]),
        }
    return out


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if mode not in ("layouts", "fit"):
        raise SystemExit(f"unknown mode {mode}")
    out = layouts(out_dir) if mode == "layouts" else fit_mode(out_dir)
    save_results_and_exit(out, out_dir, mode)


if __name__ == "__main__":
    main()
