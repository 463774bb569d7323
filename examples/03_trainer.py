"""Layer 3 — the Trainer facade, configured like Hugging Face's / Hezar's / Towhee's trainers.

python examples/03_trainer.py

Takes about 2 minutes on a laptop CPU. On a GPU it trains in bf16 mixed precision; on a CPU in float32,
because compiling the bf16 step for a CPU takes minutes (and CPUs gain little from bf16).
Prints the model summary, a progress bar with each epoch's evaluation (accuracy, macro F1) and the test
metrics of the best checkpoint. Writes runs/trainer_example under the folder you run it from (replaced
on each run: overwrite_output_dir): checkpoints, the resolved config, TensorBoard and CSV logs.
"""

import os

import torch

import functrain as ft
from functrain.trainer.demo import DigitsCNN, digits_splits

SMALL = os.environ.get("FUNCTRAIN_SMALL") == "1"
GPU = torch.cuda.is_available()
EPOCHS = 1 if SMALL else 8
print(
    f"03: the Trainer, {EPOCHS} epochs on the {'GPU, bf16' if GPU else 'CPU, float32'}, from a config like HF's"
)
print(f"    (~{'30 s' if GPU else '2 min'}; compiling the train and eval steps comes first)", flush=True)
train, val, test = digits_splits()
config = ft.TrainerConfig(
    output_dir=os.environ.get("FUNCTRAIN_OUT", "runs/trainer_example"),
    overwrite_output_dir=True,
    epochs=EPOCHS,
    batch_size=32,
    # the short last batch of each epoch would compile the train step a second time; with BatchNorm in the
    # model, padding it (pad_train_batches) cannot stand in for it: drop it (each epoch reshuffles)
    drop_last=True,
    gradient_accumulation_steps=2,  # 64 examples per optimizer step, in two micro-batches
    optimizer={"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4},
    scheduler={"name": "warmup_cosine", "warmup_ratio": 0.1},
    criterion={"name": "CrossEntropyLoss", "args": {"label_smoothing": 0.05}},
    metrics={"accuracy": {}, "F1Score": {"task": "multiclass", "num_classes": 10, "average": "macro"}},
    metric_for_best_model="accuracy",
    load_best_model_at_end=True,
    early_stopping={"monitor": "accuracy", "patience": 4},
    max_grad_norm=1.0,
    mixed_precision="bf16" if GPU else "no",
    tensorboard=True,
    csv=True,
    compile=not SMALL,
    progress_bar=not SMALL,
    device="auto",  # CUDA when there is one
)
torch.manual_seed(0)
trainer = ft.Trainer(DigitsCNN(), config, train_dataset=train, eval_dataset=val)
trainer.train()
print("test:", trainer.evaluate(test))
