"""Layer 1 — compose the pieces by hand: a state, an optimizer, a compiled step and a plain `for` loop.

python examples/01_compose_steps.py            (FUNCTRAIN_SMALL=1: a few steps, no compile)

Takes about 1 minute on a laptop CPU (most of it compiling the train and eval steps once), seconds on a GPU.
Prints the state, one line per epoch (train loss, learning rate, validation loss and accuracy) and the
number of compilations (1). Writes nothing.
"""

import os
import tempfile

import torch
import torch.nn.functional as F

import functrain as ft
from functrain.trainer.demo import DigitsCNN, digits_splits

SMALL = os.environ.get("FUNCTRAIN_SMALL") == "1"
EPOCHS = 1 if SMALL else 8

print(f"01: a CNN on scikit-learn's digits, {EPOCHS} epochs, a hand-written loop around a compiled step")
print("    (~1 min on a CPU; the first step compiles for 30-60 s before anything is printed)", flush=True)
torch.manual_seed(0)
train, val, _ = digits_splits()
model = DigitsCNN()
loader = ft.data.Loader(train, batch_size=64, key=ft.random.key(0), drop_last=True)
schedule = ft.optim.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=5, decay_steps=EPOCHS * len(loader))
tx = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(schedule, weight_decay=1e-4))
state = ft.TrainState.create(model, tx, seed=0)
print(state)

loss_fn = ft.supervised_loss(F.cross_entropy)
accuracy = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
train_step = ft.jit(ft.make_train_step(model, loss_fn), compile=not SMALL)
eval_step = ft.jit(ft.make_eval_step(model, loss_fn, metrics=accuracy), compile=not SMALL, dynamic=None)

for epoch in range(EPOCHS):
    for batch in loader.epoch(epoch):
        state, metrics = train_step(state, batch)  # metrics are tensors: no host sync here
    results = ft.evaluate(state, eval_step, val, batch_size=90)
    lr = ft.optim.hyperparams(state.opt_state)["learning_rate"]
    print(f"epoch {epoch}  train loss {float(metrics['loss']):.4f}  lr {float(lr):.2e}  {results}")

model.load_state_dict(state.state_dict())  # back into a plain nn.Module
print("compilations:", train_step.num_compiles)

# Save and restore (msgpack, atomic, no pickle). The optimizer is code, not data: it is not in the file,
# so the state comes back onto one built as before; restore(path) alone gives plain dicts to inspect.
with tempfile.TemporaryDirectory() as folder:
    ft.checkpoint.save(os.path.join(folder, "state.ckpt"), state, step=int(state.step))
    restored = ft.checkpoint.restore(
        os.path.join(folder, "state.ckpt"), target=ft.TrainState.create(model, tx)
    )
state, metrics = train_step(restored, batch)  # the run goes on from the restored state
print(f"restored at step {int(restored.step)}, one more step: loss {float(metrics['loss']):.4f}")
