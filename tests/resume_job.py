"""A training job for the exact-resume tests, run in a fresh process.

    python tests/resume_job.py RUN_DIR [--stop-at N] [--resume] [--compile] [--sleep S]

Dropout, shuffling, BatchNorm, a schedule, early stopping and gradient accumulation are all active. The
final train state, the callbacks' states and the history are written to RUN_DIR/final.ckpt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

import functrain as ft
from functrain import checkpoint

EPOCHS = 4
BATCH = 12
EXAMPLES = 100  # 9 batches per epoch, the last one short


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(EXAMPLES, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return list(zip(x, y))


class StopAt(ft.callbacks.Callback):
    def __init__(self, step: int | None, sleep: float) -> None:
        self.step = step
        self.sleep = sleep

    def on_step_end(self, state, ctx):
        if self.sleep:
            time.sleep(self.sleep)
            print(f"STEP {ctx.step}", flush=True)
        if self.step is not None and ctx.step == self.step:
            ctx.control.stop("test interruption", final=False)  # resumable, as preemption
        return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Net()
    schedule = ft.optim.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=4, decay_steps=EPOCHS * 9)
    tx = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(schedule, weight_decay=0.01))
    state = ft.TrainState.create(model, tx, seed=1)
    loss_fn = ft.supervised_loss(nn.functional.cross_entropy)
    metrics = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
    train_step = ft.jit(ft.make_train_step(model, loss_fn, accumulate=2), compile=args.compile)
    eval_step = ft.jit(ft.make_eval_step(model, loss_fn, metrics=metrics), compile=args.compile)
    data = dataset()
    stopper = ft.callbacks.EarlyStopping("eval/loss", patience=50, min_delta=0.0, restore_best=True)
    ckpt_dir = os.path.join(args.run_dir, "checkpoints")
    result = ft.fit(
        state,
        train_step,
        data,
        batch_size=BATCH,
        eval_step=eval_step,
        eval_data=data[:40],
        eval_batch_size=16,
        epochs=EPOCHS,
        eval_every=5,
        log_steps=4,
        save_every=None,
        checkpoints=ckpt_dir,
        resume_from_checkpoint=args.resume,
        callbacks=[stopper, StopAt(args.stop_at, args.sleep), ft.callbacks.Preemption()],
        loggers=[ft.logging.JSONLWriter(args.run_dir)],
        progress_bar=False,
    )
    checkpoint.save(
        os.path.join(args.run_dir, "final.ckpt"),
        {
            "state": result.state,
            "early_stopping": stopper.state_dict(),
            "history": json.dumps(result.history.as_dict(), sort_keys=True),
        },
    )
    print(f"DONE {int(result.state.step)} {result.stop_reason}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
