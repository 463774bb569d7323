"""The sharded-training jobs the tests launch with torchrun; each rank also computes the one-process reference.

    python -m torch.distributed.run --nproc_per_node=N tests/sharding_worker.py MODE OUT_DIR

Modes: ``parity`` (ZeRO-1/2/3 on a transformer and LAMB against one process on the union batch, a
BatchNorm CNN against replicated data parallelism, and the guards: broken variants must be caught),
``compile`` (one compiled ZeRO-3 config), ``save`` (a sharded checkpoint and the run continued),
``resume`` (restore it on this world size), ``kill`` (rank 1 dies in the middle of a save), ``trainer``
(the Trainer with ``config.sharding``: each level against ``sharding: none``, resumed, saved, loaded). Each rank
writes ``OUT_DIR/<mode>_rank<r>.pt`` (a test artefact read back by the test, not a checkpoint).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrun_exit import exit_skipping_teardown

import functrain as ft
from functrain import distributed
from functrain.checkpoint import sharded as ckpt
from functrain.core.tree_walk import leaves_with_paths

SIZES = (8, 7, 5, 3, 8, 6)  # global batch per step: uneven splits; with 4 ranks a batch of 3 leaves one empty
VOCAB, SEQ, CLASSES = 11, 5, 3


class Transformer(nn.Module):
    """Repeated blocks (2 encoder layers); odd row counts so shards get padding on 2 and 4 ranks. No biases
    in the blocks: the attention key bias has a gradient that is exactly 0 in exact arithmetic, so Adam
    turns its rounding noise (1e-17) into lr-sized steps that no two summation orders agree on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 12)
        layer = nn.TransformerEncoderLayer(12, 2, 10, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(12, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
        self.head = nn.Linear(3 * 4 * 4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def batches(kind: str, sizes: tuple[int, ...] = SIZES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for n in sizes:
        if kind == "cnn":
            x = torch.randn(n, 1, 4, 4, generator=g, dtype=torch.float64)
        else:
            x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        out.append((x, torch.randint(0, CLASSES, (n,), generator=g)))
    return out


def my_part(batch: Any, rank: int, world: int) -> Any:
    return tuple(t.tensor_split(world)[rank] for t in batch)


def adamw() -> ft.optim.GradientTransformation:
    return ft.optim.chain(ft.optim.clip_by_global_norm(0.05), ft.optim.adamw(3e-2, weight_decay=0.1))


def lamb() -> ft.optim.GradientTransformation:
    return ft.optim.lamb(3e-2, weight_decay=0.1)


LOSS = ft.supervised_loss(nn.functional.cross_entropy)


def build(cls: type[nn.Module], on_meta: bool) -> nn.Module:
    """Rank 0 builds the real model (seeded); the others on the meta device (shapes only)."""
    if on_meta:
        with torch.device("meta"):
            return cls().double()
    torch.manual_seed(0)
    return cls().double()


def reference(
    cls: type[nn.Module], tx: Callable[[], Any], data: list, accumulate: int = 1
) -> tuple[Any, list]:
    model = build(cls, on_meta=False)
    state = ft.TrainState.create(model, tx(), seed=0)
    step = ft.make_train_step(model, LOSS)
    metrics = []
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def sharded_run(
    cls: type[nn.Module],
    tx: Callable[[], Any],
    data: list,
    level: str,
    *,
    accumulate: int = 1,
    compile: bool = False,
    break_with: Callable[[Any], None] | None = None,
    blocks: Any = None,
    donate: bool = False,
    pad_to: int | None = None,
) -> tuple[Any, list, Any]:
    """``pad_to``: each rank's part padded to that many rows (``ft.data.pad_batch``: masked rows)."""
    rank, world = distributed.rank(), distributed.world_size()
    model = build(cls, on_meta=rank != 0)
    sharding = distributed.fully_shard(level=level, blocks=blocks)
    state = ft.TrainState.create(model, tx(), seed=0, sharding=sharding)
    raw = ft.make_train_step(model, LOSS, sharding=sharding, accumulate=accumulate)
    step = ft.jit(raw, compile=compile, donate=donate)
    if break_with is not None:
        break_with(raw)
    metrics = []
    for batch in data:
        part = my_part(batch, rank, world)
        state, m = step(state, part if pad_to is None else ft.data.pad_batch(part, pad_to))
        metrics.append(m)
    return state, metrics, step


def diff(a: Any, b: Any) -> float:
    """Max abs difference over matching tensor leaves of two trees (inf when structures differ)."""
    la, lb = ft.tree.leaves(a), ft.tree.leaves(b)
    if len(la) != len(lb):
        return float("inf")
    worst = 0.0
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape:
                return float("inf")
            if x.is_floating_point():
                worst = max(worst, float((x.double() - y.double()).abs().max()) if x.numel() else 0.0)
            elif not torch.equal(x, y):
                return float("inf")
    return worst


def compare(state: Any, metrics: list, ref: Any, ref_metrics: list) -> dict[str, float]:
    full = state.layout.full_state(state)
    worst = max(full.params, key=lambda k: diff(full.params[k], ref.params[k]))
    return {
        "worst_param": worst,
        "params": diff(full.params, ref.params),
        "opt_state": diff(full.opt_state, ref.opt_state),
        "buffers": diff(full.buffers, ref.buffers),
        "loss": max(abs(float(m["loss"] - r["loss"])) for m, r in zip(metrics, ref_metrics)),
        "grad_norm": max(abs(float(m["grad_norm"] - r["grad_norm"])) for m, r in zip(metrics, ref_metrics)),
    }


def shard_sizes(state: Any) -> dict[str, Any]:
    """Per leaf: (local rows, expected ceil(rows / world)) for params (ZeRO-3) and Adam moments."""
    layout, s = state.layout, state.layout.request
    sharded = layout.sharded_leaves(state)
    out = {}
    for path, leaf in leaves_with_paths(state):
        if path in sharded:
            out[ft.tree.path_str(path)] = (tuple(leaf.shape), s.local_shape(sharded[path]))
    return out


def parity(out: dict) -> None:
    world = distributed.world_size()
    data = batches("transformer")
    ref, ref_m = reference(Transformer, adamw, data)
    for level in ("optimizer", "grads", "params"):
        state, m, _ = sharded_run(Transformer, adamw, data, level)
        out[f"transformer/{level}"] = compare(state, m, ref, ref_m)
        out[f"sizes/{level}"] = shard_sizes(state)
        out[f"state_bytes/{level}"] = ft.tree.num_bytes((state.params, state.opt_state))
        # jit(donate=True): the optimizer updates the shards in place, the new state lands in the old
        # one's tensors; the same arithmetic, so the same numbers as without donation
        kept = state.layout.full_state(state)
        donated, m_donated, _ = sharded_run(Transformer, adamw, data, level, donate=True)
        out[f"transformer/{level}/donate"] = compare(donated, m_donated, ref, ref_m)
        out[f"donate_vs_kept/{level}"] = diff(donated.layout.full_state(donated), kept)
    out["state_bytes/replicated"] = ft.tree.num_bytes((ref.params, ref.opt_state))
    out["forward/params"] = forward_parity(state, ref, data[0])
    # accumulation: the 3-example step cannot be split in 2 on 4 ranks
    acc_data = batches("transformer", (8, 7, 8, 6) if world == 2 else (8, 16, 12))
    ref_a, ref_am = reference(Transformer, adamw, acc_data)
    state, m, _ = sharded_run(Transformer, adamw, acc_data, "params", accumulate=2)
    out["transformer/params/accumulate2"] = compare(state, m, ref_a, ref_am)
    # padded batches (Loader(pad_last=True), pad_train_batches): each rank's part padded to 4 rows, the
    # masked rows weigh nothing (on 4 ranks the batch of 3 leaves one rank all padding)
    for level, blocks in (("optimizer", None), ("params", None), ("params", "auto")):
        state, m, _ = sharded_run(Transformer, adamw, data, level, blocks=blocks, pad_to=4)
        out[f"transformer/{level}{'/blocks' if blocks else ''}/padded"] = compare(state, m, ref, ref_m)
    ref_l, ref_lm = reference(Transformer, lamb, data)
    state, m, _ = sharded_run(Transformer, lamb, data, "params")
    out["lamb/params"] = compare(state, m, ref_l, ref_lm)
    guards(out, data, ref, ref_m)
    cnn(out)


def forward_parity(state: Any, ref: Any, batch: Any) -> dict[str, float]:
    """Evaluation and prediction on a ZeRO-3 state (params gathered inside the step) against the
    one-process state, eager and compiled, on the whole batch."""
    model = build(Transformer, on_meta=True)
    out = {}
    for compile in (False, True):
        eval_step = ft.jit(ft.make_eval_step(model, LOSS), compile=compile)
        predict_step = ft.jit(ft.make_predict_step(model), compile=compile)
        out[f"eval_loss/compile={compile}"] = abs(
            float(eval_step(state, batch)["loss"]) - float(eval_step(ref, batch)["loss"])
        )
        out[f"predict/compile={compile}"] = diff(predict_step(state, batch), predict_step(ref, batch))
    return out


def guards(out: dict, data: list, ref: Any, ref_m: list) -> None:
    """Each silent failure of SHARDING_FACTS.md, put back on purpose: the parity comparison must see it."""
    from functrain.distributed import sharding as sharding_mod

    real_scatter = sharding_mod.ShardLayout.reduce_scatter
    cases: dict[str, Callable[[], Any]] = {}

    def zeroed(self: Any, full: Any, dtypes: Any) -> Any:  # FSDP2 under torch.func: every gradient 0
        return real_scatter(self, {k: torch.zeros_like(v) for k, v in full.items()}, dtypes)

    def unreduced(self: Any, full: Any, dtypes: Any) -> Any:  # full_tensor()'s missing backward reduction
        s = self.request
        return {k: sharding_mod.local_rows(v.to(dtypes[k]), s) * s.world_size for k, v in full.items()}

    cases["zero_gradients"] = lambda: _patched(sharding_mod.ShardLayout, "reduce_scatter", zeroed)
    cases["unreduced_gradients"] = lambda: _patched(sharding_mod.ShardLayout, "reduce_scatter", unreduced)
    cases["local_norms"] = lambda: _patched(
        sharding_mod.ShardLayout, "global_norms", lambda self, norms: norms
    )
    for name, patch in cases.items():
        with patch():
            state, m, _ = sharded_run(Transformer, adamw, data, "params")
        out[f"guard/{name}"] = compare(state, m, ref, ref_m)


class _patched:
    def __init__(self, owner: Any, attr: str, value: Any) -> None:
        self.owner, self.attr, self.value = owner, attr, value

    def __enter__(self) -> None:
        self.saved = getattr(self.owner, self.attr)
        setattr(self.owner, self.attr, self.value)

    def __exit__(self, *exc: Any) -> None:
        setattr(self.owner, self.attr, self.saved)


def cnn(out: dict) -> None:
    """BatchNorm: statistics are per rank's batch (as DDP without SyncBatchNorm), so the reference is
    functrain's replicated data parallelism on the same ranks; buffers are averaged ("mean")."""
    rank, world = distributed.rank(), distributed.world_size()
    data = batches("cnn", (8, 7, 8, 6, 8))
    model = build(CNN, on_meta=False)
    state = distributed.replicate(ft.TrainState.create(model, adamw(), seed=0))
    step = ft.make_train_step(model, LOSS, gradient_reducer=distributed.gradient_reducer(model=model))
    ref_m = []
    for batch in data:
        state, m = step(state, my_part(batch, rank, world))
        ref_m.append(m)
    sharded, m, _ = sharded_run(CNN, adamw, data, "params")
    out["cnn/params_vs_ddp"] = compare(sharded, m, state, ref_m)


def compiled(out: dict) -> None:
    data = batches("transformer", (7, 7, 7, 7))
    ref, ref_m = reference(Transformer, adamw, data)
    state, m, step = sharded_run(Transformer, adamw, data, "params", compile=True)
    out["compiled/params"] = compare(state, m, ref, ref_m)
    out["num_compiles"] = step.num_compiles


def save(out: dict, directory: str) -> None:
    """3 steps, a sharded checkpoint, the gathered state as reference, then 2 more steps."""
    data = batches("transformer")
    rank, world = distributed.rank(), distributed.world_size()
    state, _, step = sharded_run(Transformer, adamw, data[:3], "params")
    ckpt.save_sharded(directory, 3, state)
    full = state.layout.full_state(state)
    if rank == 0:
        ft.checkpoint.save(os.path.join(directory, "reference.ckpt"), full, step=3)
    for batch in data[3:]:
        state, _ = step(state, my_part(batch, rank, world))
    _dump(out, "uninterrupted", state.layout.full_state(state), directory)
    fit_resume(out, directory)


def fit_resume(out: dict, directory: str) -> None:
    """fit with a ShardedCheckpointManager: 6 steps straight, and 4 steps (saved every 2) + a run resumed
    to 6 from a state made with another seed (the checkpoint's key orders the data); the old
    CheckpointManager refuses the sharded state instead of keeping rank 0's shards."""
    rank = distributed.rank()
    examples = [(x[i], y[i]) for x, y in batches("transformer", (29,)) for i in range(29)]

    def run(max_steps: int, folder: str | None, resume: bool, seed: int = 0) -> Any:
        model = build(Transformer, on_meta=rank != 0)
        sharding = distributed.fully_shard(level="params")
        state = ft.TrainState.create(model, adamw(), seed=seed, sharding=sharding)
        step = ft.jit(ft.make_train_step(model, LOSS, sharding=sharding), compile=False)
        manager = None if folder is None else ckpt.ShardedCheckpointManager(folder, sharding)
        return ft.fit(
            state, step, examples, batch_size=4, max_steps=max_steps, progress_bar=False, log_steps=2,
            checkpoints=manager, save_every=2 if manager else None, resume_from_checkpoint=resume,
        ).state  # fmt: skip

    straight = run(6, None, False)
    folder = os.path.join(directory, "fit")
    run(4, folder, False)
    resumed = run(6, folder, True, seed=7)  # another seed: the checkpoint's key orders the data
    _dump(out, "fit_straight", straight.layout.full_state(straight), directory)
    _dump(out, "fit_resumed", resumed.layout.full_state(resumed), directory)
    try:
        ft.checkpoint.CheckpointManager(os.path.join(directory, "plain")).save(1, {"state": resumed})
    except ft.checkpoint.CheckpointError as error:
        out["plain_manager_refused"] = str(error)
    mismatches(out, directory)


def mismatches(out: dict, directory: str) -> None:
    """The messages of a fit checkpoint of Linear(16, 12) resumed by a Linear(16, 14) run (shards [6, 16]
    and [7, 16] on 2 ranks) and restored onto a bare state; the hinted restore of the bare state."""

    def run(rows: int, resume: bool) -> Any:
        torch.manual_seed(0)
        model = nn.Linear(16, rows)
        sharding = distributed.fully_shard(level="params")
        state = ft.TrainState.create(model, adamw(), sharding=sharding)
        manager = ckpt.ShardedCheckpointManager(os.path.join(directory, "narrow"), sharding)
        step = ft.jit(ft.make_train_step(model, LOSS, sharding=sharding), compile=False)
        data = [(torch.randn(16), torch.tensor(i % 2)) for i in range(8)]
        ft.fit(state, step, data, batch_size=4, epochs=1, checkpoints=manager, resume_from_checkpoint=resume)
        return state

    bare = run(12, False)
    try:
        run(14, True)
    except ValueError as error:
        out["wider_resumed"] = str(error)
    try:
        ckpt.restore_sharded(os.path.join(directory, "narrow"), target=bare)
    except ft.checkpoint.CheckpointError as error:
        out["bare_restored"] = str(error)
    hinted = ckpt.restore_sharded(os.path.join(directory, "narrow"), target={"state": bare})["state"]
    out["hinted_step"] = (int(hinted.step), ckpt.latest_sharded(os.path.join(directory, "narrow")))


def _dump(out: dict, key: str, full: Any, directory: str) -> None:
    """A gathered state, as a functrain checkpoint file (states hold the optimizer: not for torch.save)."""
    path = os.path.join(directory, f"{key}_w{distributed.world_size()}_rank{distributed.rank()}.ckpt")
    ft.checkpoint.save(path, full)
    out[key] = path


def resume(out: dict, directory: str) -> None:
    data = batches("transformer")
    rank, world = distributed.rank(), distributed.world_size()
    model = build(Transformer, on_meta=rank != 0)
    sharding = distributed.fully_shard(level="params")
    template = ft.TrainState.create(model, adamw(), seed=1, sharding=sharding)
    state = ckpt.restore_sharded(directory, target=template)
    _dump(out, "restored", state.layout.full_state(state), directory)
    out["sizes"] = shard_sizes(state)
    step = ft.jit(ft.make_train_step(model, LOSS, sharding=sharding), compile=False)
    for batch in data[3:]:
        state, _ = step(state, my_part(batch, rank, world))
    _dump(out, "continued", state.layout.full_state(state), directory)


def kill(out: dict, directory: str) -> None:
    """Step 1 saved and committed; during step 2's save rank 1 is SIGKILLed with its file half written."""
    data = batches("transformer")
    rank, world = distributed.rank(), distributed.world_size()
    state, _, step = sharded_run(Transformer, adamw, data[:1], "params")
    ckpt.save_sharded(directory, 1, state)
    full = state.layout.full_state(state)
    if rank == 0:
        ft.checkpoint.save(os.path.join(directory, "reference.ckpt"), full, step=1)
    state, _ = step(state, my_part(data[1], rank, world))
    if rank == 1:
        from functrain.checkpoint import format as fmt

        real_write = fmt.write

        def dying_write(file: Any, **kwargs: Any) -> None:
            class Dies:
                written = 0

                def write(self, data: Any) -> int:
                    file.write(data)
                    Dies.written += len(data)
                    if Dies.written > 2000:
                        file.flush()
                        os.kill(os.getpid(), signal.SIGKILL)
                    return len(data)

            real_write(Dies(), **kwargs)

        fmt.write = dying_write
    ckpt.save_sharded(directory, 2, state)  # rank 1 dies in here; rank 0 fails in the collective


def trainer(out: dict, directory: str) -> None:
    """The Trainer (float64, eager) with each ``sharding`` level and with ``none`` on the same data (uneven
    last batch, clipping, weight decay, BatchNorm, dropout, ``init_weights_from``): the final params,
    evaluation, each rank's shard shapes, a run of 2 epochs resumed to 3 against 3 straight, and
    ``Trainer.save``/``load`` of a sharded state. ``directory/init.ckpt``: the weights every run starts from."""
    from trainer_fixtures import SmallNet

    def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 6, generator=g, dtype=torch.float64)
        return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())

    def run(level: str, folder: str, epochs: int, resume: bool = False, **fields: Any) -> ft.Trainer:
        config = ft.TrainerConfig(
            output_dir=os.path.join(directory, folder), epochs=epochs, batch_size=4, seed=5,
            optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}, max_grad_norm=0.5,
            metrics=["accuracy"], compile=False, device="cpu", progress_bar=False, print_summary=False,
            init_weights_from=os.path.join(directory, "init.ckpt"), sharding=level, resume_from_checkpoint=resume,
            **fields,
        )  # fmt: skip
        torch.manual_seed(distributed.rank())  # each rank's own initial weights: init_weights_from sets them
        trainer = ft.Trainer(SmallNet().double(), config, data(37, 0), data(13, 1))
        trainer.train()
        return trainer

    for level in ("none", "optimizer", "params"):
        t = run(level, level, 3)
        state = t.state if level == "none" else t.state.layout.full_state(t.state)
        out[level] = {
            "params": state.params,
            "opt_state": ft.tree.leaves(state.opt_state),
            "eval": t.evaluate(),
            "predict": t.predict(data(5, 2)),
            "local_params": {k: tuple(v.shape) for k, v in t.state.params.items()},
            "local_opt": [tuple(x.shape) for x in ft.tree.leaves(t.state.opt_state) if x.ndim > 0],
            "checkpoints": t.checkpoint_manager().all_steps(),
        }
        if level == "none":
            continue
        run(level, f"{level}_resumed", 2)
        resumed = run(level, f"{level}_resumed", 3, resume=True).state
        out[level]["resumed"] = resumed.layout.full_state(resumed).params
        t.save(os.path.join(directory, f"{level}_final.ckpt"))
        fresh = run(level, f"{level}_fresh", 1)
        loaded = fresh.load(os.path.join(directory, f"{level}_final.ckpt"))
        out[level]["loaded_whole"] = loaded.layout.full_state(loaded).params
        manager = t.checkpoint_manager()  # the run's last checkpoint, a step_N.shards manifest
        loaded = fresh.load(manager.path(manager.latest()))
        out[level]["loaded_shards"] = (int(loaded.step), loaded.layout.full_state(loaded).params)
    for level in ("none", "optimizer", "params"):  # an EMA of the weights, evaluated with
        t = run(level, f"{level}_ema", 2, ema={"decay": 0.8, "evaluate": True})
        state = t.state if level == "none" else t.state.layout.full_state(t.state)
        out[f"ema/{level}"] = {
            "average": ft.optim.averaging.averaged_params(state),
            "params": state.params,
            "eval": t.evaluate(),
        }


MODES = {"parity": parity, "compile": compiled}
DIR_MODES = {"save": save, "resume": resume, "kill": kill, "trainer": trainer}


def main(mode: str, out_dir: str, ckpt_dir: str | None = None) -> None:
    import datetime

    with distributed.initialize(timeout=datetime.timedelta(seconds=60)) as env:
        out: dict = {"rank": env.rank, "world_size": env.world_size}
        if mode in MODES:
            MODES[mode](out)
        else:
            DIR_MODES[mode](out, ckpt_dir or os.path.join(out_dir, "ckpt"))
        torch.save(out, os.path.join(out_dir, f"{mode}_rank{env.rank}.pt"))
        distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_skipping_teardown()
