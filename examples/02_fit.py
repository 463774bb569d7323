"""Layer 2 — `fit`: callbacks, evaluation, logs, checkpoints and exact resume around the same step.

python examples/02_fit.py [RUN_DIR]            (run it twice: the second run finds it finished)

Takes about 1-2 minutes on a laptop CPU (compiling the steps takes most of it). The run is resumable:
Ctrl-C saves and stops, the next run continues; a run that ended (10 epochs, or early stopping)
returns at once and says so; `additional_epochs=N` in `ft.fit` would train N more.
Prints a progress bar with each epoch's evaluation, why it stopped, the test accuracy and where the curves
are. Writes RUN_DIR (default runs/fit_example under the folder you run it from): checkpoints/, logs/
(JSONL and TensorBoard) and curves.png.
"""

import os
import sys

import torch
import torch.nn.functional as F

import functrain as ft
from functrain.trainer.demo import DigitsCNN, digits_splits

SMALL = os.environ.get("FUNCTRAIN_SMALL") == "1"
run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/fit_example"

print(f"02: ft.fit with evaluation, early stopping, checkpoints and logs in {run_dir}")
print("    (~1-2 min on a CPU; the first step compiles for 30-60 s)", flush=True)
torch.manual_seed(0)
train, val, test = digits_splits()
model = DigitsCNN()
tx = ft.optim.adamw(ft.optim.cosine_decay_schedule(3e-3, decay_steps=400), weight_decay=1e-4)
state = ft.TrainState.create(model, tx, seed=0)
loss_fn = ft.supervised_loss(F.cross_entropy)
metrics = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})

result = ft.fit(
    state,
    ft.jit(ft.make_train_step(model, loss_fn), compile=not SMALL),
    ft.data.Loader(train, batch_size=64, key=ft.random.key(0), drop_last=True),
    eval_step=ft.jit(ft.make_eval_step(model, loss_fn, metrics=metrics), compile=not SMALL, dynamic=None),
    eval_data=val,
    eval_batch_size=90,
    epochs=1 if SMALL else 10,
    log_steps=10,
    callbacks=[
        ft.callbacks.EarlyStopping("eval/accuracy", mode="max", patience=3, restore_best=True),
        ft.callbacks.ModelCheckpoint(
            f"{run_dir}/checkpoints", every_n_epochs=1, monitor="eval/accuracy", mode="max"
        ),
        ft.callbacks.LearningRateMonitor(),
        ft.callbacks.Timer(),
        ft.callbacks.Preemption(),  # Ctrl-C or SIGTERM: save, stop; the next run resumes
    ],
    loggers=[ft.logging.JSONLWriter(f"{run_dir}/logs"), ft.logging.TensorBoardWriter(f"{run_dir}/logs/tb")],
    resume_from_checkpoint=True,
    progress_bar=not SMALL,
)
print("stopped:", result.stop_reason or "finished", "| last evaluation:", result.eval_metrics)
print(
    "test:",
    ft.evaluate(result.state, ft.make_eval_step(model, loss_fn, metrics=metrics), test, batch_size=120),
)
try:
    print("curves:", ft.logging.plot_run(run_dir, f"{run_dir}/curves.png"))
except ImportError as err:  # matplotlib is optional (the `examples` extra installs it)
    print(f"no curves: {err}")
