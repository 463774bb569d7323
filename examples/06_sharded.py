"""Sharded training (ZeRO-1/2/3): each rank keeps 1/world of every param and optimizer moment.

A small transformer classifies scikit-learn's digits (each 8x8 image read as 8 tokens of 8 pixels).
The same script runs in one process (nothing to shard: one rank holds everything) and under torchrun;
on CPU the ranks talk over gloo, on GPUs over NCCL:

    python examples/06_sharded.py
    torchrun --nproc_per_node=2 examples/06_sharded.py                    # ZeRO-3 (params sharded)
    torchrun --nproc_per_node=2 examples/06_sharded.py --level optimizer  # ZeRO-1
    torchrun --nproc_per_node=2 examples/06_sharded.py --compile          # one compiled graph per step

What changes against a replicated script is two arguments: ``sharding=`` to ``TrainState.create`` (the
optimizer state is built on the shards: the full optimizer state never exists) and to
``make_train_step``, and a ``ShardedCheckpointManager`` (one msgpack file per rank plus a manifest, restored
on any number of ranks). Ranks other than 0 build the model on the meta device: the weights come from
rank 0, one leaf at a time.

Prints (rank 0 speaks for all): what it trains, one line per epoch (train loss, evaluation), each rank's
share of the params and optimizer state, the stop reason and the accuracy of the gathered weights in a
plain nn.Module. Expected with the defaults (5 epochs, eager; torch 2.13 on a CPU): accuracy 0.700 on
the 297 held-out digits on 2 ranks (global batch 128: 60 steps), 0.768 in one process (global batch 64:
120 steps); a tiny model trained briefly, more --epochs go higher. About 15 s on 2 CPU cores, plus
compiling with --compile. Writes its checkpoints to --out (default runs/06_sharded under the folder you
run it from): a rerun resumes from them and, once finished, only reports; delete the folder to train again.
"""

from __future__ import annotations

import argparse
import sys

import torch
from sklearn.datasets import load_digits
from torch import nn

import functrain as ft
from functrain import distributed
from functrain.checkpoint.sharded import ShardedCheckpointManager


class DigitTransformer(nn.Module):
    """Rows of the image as tokens; two identical encoder blocks; a linear head on the mean token."""

    def __init__(self, width: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(torch.zeros(8, width))
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(images.reshape(-1, 8, 8)) + self.position
        return self.head(self.encoder(tokens).mean(1))


def digits() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    split = 1500
    return (
        torch.utils.data.TensorDataset(x[:split], y[:split]),
        torch.utils.data.TensorDataset(x[split:], y[split:]),
    )


def say(*values: object) -> None:
    """Print on rank 0 only, at once: one rank speaks for all."""
    if distributed.is_main_process():
        print(*values, flush=True)


class EpochReport(ft.callbacks.Callback):
    """One line per epoch: the last train step's loss and the epoch's evaluation (every rank agrees)."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_eval_end(self, state: ft.TrainState, ctx: ft.callbacks.Context) -> ft.TrainState:
        evaluation = ctx.eval_metrics or {}
        say(
            f"epoch {ctx.epoch + 1}/{self.epochs}: train loss {float(ctx.metrics['loss']):.3f} | "
            f"eval loss {evaluation['eval/loss']:.3f}, accuracy {evaluation['eval/accuracy']:.3f}"
        )
        return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", choices=("optimizer", "grads", "params"), default="params")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="compile the steps (one graph each)")
    parser.add_argument("--out", default="runs/06_sharded", help="checkpoints; a rerun resumes from them")
    args = parser.parse_args()

    with distributed.initialize():
        say(
            f"06: a small transformer on digits, {args.epochs} epochs on {distributed.world_size()} rank(s), "
            f"sharding {args.level}, {'compiled' if args.compile else 'eager'}; checkpoints in {args.out}"
        )
        train_set, val_set = digits()
        if distributed.rank() == 0:
            torch.manual_seed(0)
            model = DigitTransformer()
        else:  # shapes only: rank 0's weights are sent to every rank by TrainState.create
            with torch.device("meta"):
                model = DigitTransformer()
        sharding = distributed.fully_shard(level=args.level)
        tx = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(3e-3, weight_decay=0.01))
        state = ft.TrainState.create(model, tx, seed=0, sharding=sharding)

        loss_fn = ft.supervised_loss(nn.functional.cross_entropy)
        metrics = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
        train_step = ft.jit(ft.make_train_step(model, loss_fn, sharding=sharding), compile=args.compile)
        eval_step = ft.jit(ft.make_eval_step(model, loss_fn, metrics=metrics), compile=args.compile)
        result = ft.fit(
            state,
            train_step,
            train_set,
            batch_size=64,  # per rank
            epochs=args.epochs,
            eval_step=eval_step,
            eval_data=val_set,
            checkpoints=ShardedCheckpointManager(args.out, sharding, max_to_keep=2),
            resume_from_checkpoint=True,
            progress_bar=False,
            callbacks=[EpochReport(args.epochs)],
        )

        held = ft.tree.num_bytes((result.state.params, result.state.opt_state))
        whole = result.state.num_params * 4 * 3  # fp32 params + AdamW's two moments
        sys.stdout.write(  # one write per line: the ranks share the terminal
            f"rank {distributed.rank()}/{distributed.world_size()} ({args.level}): holds {held / 1e3:.0f} kB "
            f"of params and optimizer state; replicated, each rank would hold {whole / 1e3:.0f} kB\n"
        )
        weights = result.state.state_dict()  # collective: every rank gathers the whole params
        if distributed.rank() == 0:
            print("stopped:", result.stop_reason or "finished", "| last evaluation:", result.eval_metrics)
            plain = DigitTransformer().eval()
            plain.load_state_dict(weights)  # an ordinary nn.Module again
            x, y = val_set.tensors
            with torch.no_grad():
                accuracy = (plain(x).argmax(1) == y).float().mean()
            print(
                f"the gathered weights in a plain nn.Module: accuracy {float(accuracy):.3f} (expected with the "
                "defaults: 0.700 on 2 ranks, 0.768 in one process, whose global batch is half as large)"
            )


if __name__ == "__main__":
    main()
