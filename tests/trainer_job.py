"""A Trainer run for the kill-and-resume test: python tests/trainer_job.py OUTPUT_DIR [--resume] [--sleep S]."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainer_fixtures import SmallNet, make_dataset

import functrain as ft


class Slow(ft.callbacks.Callback):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def on_step_end(self, state, ctx):
        time.sleep(self.sleep)
        return state


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    config = ft.TrainerConfig(
        output_dir=args.output_dir,
        epochs=6,
        batch_size=8,
        gradient_accumulation_steps=2,
        seed=3,
        optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        scheduler={"name": "cosine", "warmup_steps": 5},
        metrics=["accuracy"],
        eval_strategy="steps",
        eval_steps=7,
        save_strategy="steps",
        save_steps=3,
        early_stopping={"monitor": "loss", "patience": 20},
        max_grad_norm=1.0,
        log_steps=4,
        progress_bar=False,
        compile=False,
        device="cpu",
        resume_from_checkpoint=args.resume,
    )
    torch.manual_seed(0)
    trainer = ft.Trainer(
        SmallNet(), config, make_dataset(120), make_dataset(40, seed=1), callbacks=[Slow(args.sleep)]
    )
    result = trainer.train()
    trainer.save(Path(args.output_dir) / "final.ckpt")
    print(f"DONE {int(result.state.step)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
