"""Fine-tuning: start from a trained run's weights (init_weights_from), new head, frozen feature layers.

python examples/04_finetune.py

Takes about 30 seconds on a laptop CPU (eager steps: no compilation).
Prints the pretraining's and the fine-tuning's summaries, which weights were loaded and frozen
(init_report) and the parity task's accuracy. Writes runs/finetune_example under the folder you run it
from (replaced on each run): pretrain/, pretrained.ckpt and parity/.
"""

import os

import torch
from torch import nn

import functrain as ft
from functrain.trainer.demo import DigitsCNN, digits_splits

SMALL = os.environ.get("FUNCTRAIN_SMALL") == "1"
out = os.environ.get("FUNCTRAIN_OUT", "runs/finetune_example")
print("04: pretrain on digits, then fine-tune a new head with frozen features (~30 s on a CPU)", flush=True)
train, val, _ = digits_splits()
common = dict(
    overwrite_output_dir=True,
    batch_size=64,
    compile=False,
    progress_bar=False,
    device="cpu",
    metrics=["accuracy"],
    epochs=1 if SMALL else 4,
)

# 1. pretrain on digits 0-9
torch.manual_seed(0)
pretrain = ft.Trainer(DigitsCNN(), ft.TrainerConfig(output_dir=f"{out}/pretrain", **common), train, val)
pretrain.train()
pretrain.save(f"{out}/pretrained.ckpt")


# 2. a new task (is the digit even?) with a new 2-class head; features loaded and frozen
def parity(ds):
    x, y = ds[:]
    return torch.utils.data.TensorDataset(x, y % 2)


model = DigitsCNN()
model.head[-1] = nn.Linear(model.head[-1].in_features, 2)
config = ft.TrainerConfig(
    output_dir=f"{out}/parity",
    init_weights_from=f"{out}/pretrained.ckpt",
    freeze={"module_indices": [0], "batchnorm": True},  # model.features: weights and BatchNorm statistics
    **common,
)
tuner = ft.Trainer(model, config, parity(train), parity(val))
print(tuner.init_report)
tuner.train()
print("parity accuracy:", tuner.evaluate()["eval/accuracy"])
