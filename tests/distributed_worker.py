"""The training job the distributed tests launch with torchrun (and run in one process as the reference).

    python -m torch.distributed.run --nproc_per_node=2 tests/distributed_worker.py MODE OUT_DIR

Modes: ``train`` (20 uninterrupted steps + evaluation, a run stopped at step 10, checks of replication,
per-rank randomness and BatchNorm buffers), ``resume`` (continue the stopped run to step 20), ``compile``
(a few compiled steps against eager ones), ``padded`` (an epoch with pad_last, rank 1's last batch
empty, against one without), ``streams`` (each rank's own stream resumed: a stateful one and one that
replays itself). Each rank writes ``OUT_DIR/<mode>_rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torchrun_exit import exit_skipping_teardown

import functrain as ft
from functrain import distributed

PER_RANK_BATCH = 4
N_TRAIN = 41  # 8 examples a global step: the epoch's last step holds 1, so rank 1's batch is empty
N_EVAL = 13  # eval steps of 8 and 5 examples: 3 + 2 on the last one
STEPS = 20
STOP_AT = 10


def dataset(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return [(x[i], y[i]) for i in range(n)]


def model_and_state(init_seed: int) -> tuple[nn.Module, ft.TrainState]:
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, ft.TrainState.create(model, ft.optim.adam(3e-2), seed=7)


def loss_fn() -> ft.step.LossFn:
    return ft.supervised_loss(nn.functional.cross_entropy)


def eval_step(model: nn.Module) -> ft.CompiledStep:
    metrics = ft.metrics.Collection({"acc": ft.metrics.Accuracy(), "loss_avg": ft.metrics.Average("loss")})
    return ft.jit(ft.make_eval_step(model, loss_fn(), metrics=metrics), compile=False)


def train(
    model: nn.Module,
    state: ft.TrainState,
    batch_size: int,
    max_steps: int,
    checkpoints: str | None = None,
    resume: bool = False,
) -> ft.FitResult:
    reducer = distributed.gradient_reducer(model=model)
    step = ft.jit(ft.make_train_step(model, loss_fn(), gradient_reducer=reducer), compile=False)
    return ft.fit(
        state,
        step,
        dataset(N_TRAIN, 1),
        batch_size=batch_size,
        max_steps=max_steps,
        eval_every=None,
        log_steps=5,
        progress_bar=False,
        checkpoints=checkpoints,
        save_every=5 if checkpoints else None,
        resume_from_checkpoint=resume,
    )


class Feed(torch.utils.data.IterableDataset):
    """A rank's own endless stream that says where it stands (state_dict); a new one starts at ``start``
    (with ``replays``, every pass starts there: a stream that repeats itself)."""

    def __init__(self, start: int, replays: bool = False) -> None:
        self.start, self.position, self.replays = start, start, replays

    def __iter__(self):
        if self.replays:
            self.position = self.start
        while True:
            x, y = dataset(1, self.position)[0]
            self.position += 1
            yield x, y

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Replaying(torch.utils.data.IterableDataset):
    """A rank's own stream without a state, the same 24 examples on every pass."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        return iter(dataset(24, 100 + self.rank))


def streams(model: nn.Module, state: ft.TrainState, directory: str, out: dict) -> None:
    """Each rank's stream resumed in fit: a stateful feed that moved on since (its state, per rank, brings
    it back) and a stream that replays itself (checked, per rank: no warning), against straight runs."""
    import warnings

    rank = distributed.rank()
    reducer = distributed.gradient_reducer(model=model)
    step = ft.jit(ft.make_train_step(model, loss_fn(), gradient_reducer=reducer), compile=False)

    def run(data: object, max_steps: int, folder: str | None = None) -> ft.TrainState:
        result = ft.fit(
            state, step, data, batch_size=PER_RANK_BATCH, max_steps=max_steps, progress_bar=False,
            checkpoints=folder, save_every=3 if folder else None, resume_from_checkpoint=folder is not None,
        )  # fmt: skip
        distributed.barrier()  # rank 0's last checkpoint is written before any rank looks for it
        return result.state

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, make, moved in (
            ("stateful", lambda: Feed(1000 * rank), lambda: Feed(1000 * rank + 500)),
            ("replaying", lambda: Replaying(rank), lambda: Replaying(rank)),
        ):
            folder = os.path.join(directory, name)
            straight = run(make(), 11)  # 6 batches a pass of the replaying stream: into the second
            run(make(), 8, folder)
            resumed = run(moved(), 11, folder)
            out[name] = (straight.params, resumed.params)
    out["resume_warnings"] = [str(w.message) for w in caught if issubclass(w.category, ft.data.ResumeWarning)]


def evaluation(model: nn.Module, state: ft.TrainState, batch_size: int) -> dict[str, float]:
    return ft.evaluate(state, eval_step(model), dataset(N_EVAL, 2), batch_size=batch_size)


def _gathered_rand(state: ft.TrainState) -> list[torch.Tensor]:
    # A step that only draws from the global RNG, seeded by jit from (rng, step, rank).
    draw = ft.jit(lambda s: torch.rand(4), compile=False)
    local = draw(state)
    out = [torch.empty(4) for _ in range(distributed.world_size())]
    torch.distributed.all_gather(out, local)
    return out


def _batchnorm_check(out: dict) -> None:
    # BatchNorm statistics averaged over ranks ("mean"): the ranks agree, and an empty batch on rank 1
    # leaves no NaN behind. (BatchNorm cannot train on one example, so the empty batch is made by hand
    # here rather than by N_TRAIN's 1-example last step.)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    state = distributed.replicate(ft.TrainState.create(model, ft.optim.sgd(0.1), seed=3))
    reducer = distributed.gradient_reducer(model=model)
    step = ft.jit(ft.make_train_step(model, loss_fn(), gradient_reducer=reducer), compile=False)
    result = ft.fit(state, step, dataset(48, 1), batch_size=PER_RANK_BATCH, max_steps=5, progress_bar=False)
    x, y = ft.data.collate(dataset(4, 5))
    n = 4 if distributed.rank() == 0 else 0
    after, metrics = step(result.state, (x[:n], y[:n]))
    out["bn_buffers"] = {k: v.clone() for k, v in after.buffers.items()}
    out["bn_loss_finite"] = bool(torch.isfinite(metrics["loss"]))
    distributed.assert_replicated(after.buffers, what="BatchNorm buffers")
    out["bn_replicated"] = True


def main(mode: str, out_dir: str) -> None:
    with distributed.initialize() as env:
        out: dict = {"rank": env.rank, "world_size": env.world_size}
        ckpt = os.path.join(out_dir, "ckpt")
        # Different initial weights on each rank: replicate() must make them rank 0's.
        model, state = model_and_state(init_seed=env.rank)
        if mode == "train":
            out["init_before"] = {k: v.clone() for k, v in state.params.items()}
        state = distributed.replicate(state, device=env.device)
        distributed.assert_replicated(state, what="initial state")

        if mode == "train":
            out["init"] = {k: v.clone() for k, v in state.params.items()}
            out["rand"] = _gathered_rand(state)
            full = train(model, state, PER_RANK_BATCH, STEPS)
            out["params"] = full.state.params
            out["train_loss"] = full.history.series("train/loss")
            out["eval"] = evaluation(model, full.state, PER_RANK_BATCH)
            stopped = train(model, state, PER_RANK_BATCH, STOP_AT, checkpoints=ckpt)
            out["stopped_step"] = int(stopped.state.step)
            _batchnorm_check(out)
        elif mode == "resume":
            resumed = train(model, state, PER_RANK_BATCH, STEPS, checkpoints=ckpt, resume=True)
            out["params"] = resumed.state.params
            out["step"] = int(resumed.state.step)
        elif mode == "compile":
            reducer = distributed.gradient_reducer(model=model)
            make = ft.make_train_step(model, loss_fn(), gradient_reducer=reducer)
            compiled, eager = ft.jit(make), ft.jit(make, compile=False)
            batches = list(
                ft.data.Loader(
                    dataset(16, 1),
                    PER_RANK_BATCH,
                    shuffle=False,
                    prefetch=0,
                    rank=env.rank,
                    world_size=env.world_size,
                ).epoch(0)
            )
            s_c, s_e = state, state
            for batch in batches:
                s_c, m_c = compiled(s_c, batch)
                s_e, m_e = eager(s_e, batch)
            out["compiled"], out["eager"] = s_c.params, s_e.params
            out["loss"] = (m_c["loss"], m_e["loss"])
            out["num_compiles"] = compiled.num_compiles
            distributed.assert_replicated(s_c.params, what="compiled params")
        elif mode == "padded":  # one epoch, eager, short batches as they are and padded (pad_last)
            reducer = distributed.gradient_reducer(model=model)
            step = ft.make_train_step(model, loss_fn(), gradient_reducer=reducer)
            shard = {"rank": env.rank, "world_size": env.world_size, "shuffle": False, "prefetch": 0}
            for pad_last in (False, True):
                s = state
                data = ft.data.Loader(dataset(N_TRAIN, 1), PER_RANK_BATCH, pad_last=pad_last, **shard)
                for batch in data.epoch(0):
                    s, metrics = step(s, batch)
                out["padded" if pad_last else "unpadded"] = (s.params, metrics["loss"])
        elif mode == "streams":
            streams(model, state, ckpt, out)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        torch.save(out, os.path.join(out_dir, f"{mode}_rank{env.rank}.pt"))
        distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # every result saved, the process group destroyed
    exit_skipping_teardown()
