"""Learn the learning rate by hypergradient descent (Baydin et al. 2018, "Online Learning Rate Adaptation
with Hypergradient Descent"): differentiate through the train step.

python examples/09_hypergradient.py            (FUNCTRAIN_SMALL=1: a few steps)

Each step, ``torch.func.grad`` takes the derivative of the next batch's loss, after one train step, with
respect to the learning rate kept in the optimizer state (a 0-d tensor), and the rate moves against it:
``lr -= beta * d loss / d lr``. The step itself is functrain's ordinary ``make_train_step``: the optimizers
notice that something differentiates through them and take their differentiable path.

The paper's qualitative result, on scikit-learn's digits with an MLP, from a deliberately small initial
rate: SGD-HD and Adam-HD raise their rate by themselves and end at a lower training loss than SGD and
Adam kept at that rate. Takes about a minute on a laptop CPU (eager, no compile). Writes nothing.
"""

import os

import torch
import torch.nn.functional as F

import functrain as ft
from functrain.trainer.demo import digits_splits

SMALL = os.environ.get("FUNCTRAIN_SMALL") == "1"
EPOCHS = 1 if SMALL else 6
BATCH = 64
RUNS = {  # name: (optimizer, initial rate, hypergradient step beta; 0: the rate stays as it is)
    "SGD": (ft.optim.sgd, 0.01, 0.0),
    "SGD-HD": (ft.optim.sgd, 0.01, 0.02),
    "Adam": (ft.optim.adam, 1e-4, 0.0),
    "Adam-HD": (ft.optim.adam, 1e-4, 1e-5),
}


def model_fn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10)
    )


def loss_fn(model, batch):  # type: ignore[no-untyped-def]
    x, y = batch
    return F.cross_entropy(model(x), y)


def train(make_tx, lr: float, beta: float) -> tuple[float, float, list[float]]:  # type: ignore[no-untyped-def]
    """Train for EPOCHS; returns the last epoch's mean training loss, the final rate and the rate per epoch."""
    model = model_fn()
    state = ft.TrainState.create(model, make_tx(lr))
    step = ft.make_train_step(model, loss_fn)

    structure = {}  # the new state's tree structure, read back after the call

    def next_loss(rate, state, batch, next_batch):  # type: ignore[no-untyped-def]
        """The loss on the next batch after one step at ``rate``; that step's new state and metrics (as
        leaves: torch.func hands back tensors, unwrapped)."""
        state = state.replace(opt_state=ft.optim.set_hyperparams(state.opt_state, learning_rate=rate))
        state, metrics = step(state, batch)
        params = {**state.params, **state.buffers}
        leaves, structure["spec"] = ft.tree.flatten((state, metrics))
        return loss_fn(lambda x: torch.func.functional_call(model, params, (x,)), next_batch), leaves

    def hypergrad(rate, state, batch, next_batch):  # type: ignore[no-untyped-def]
        h, leaves = torch.func.grad(next_loss, has_aux=True)(rate, state, batch, next_batch)
        return h, ft.tree.unflatten(structure["spec"], leaves)

    rate = torch.tensor(lr)
    loader = ft.data.Loader(train_set, batch_size=BATCH, key=ft.random.key(0), drop_last=True)
    rates = []
    for epoch in range(EPOCHS):
        batches = list(loader.epoch(epoch))
        losses = []
        for i, batch in enumerate(batches[:4] if SMALL else batches):
            if beta:
                h, (state, metrics) = hypergrad(rate, state, batch, batches[(i + 1) % len(batches)])
                rate = (rate - beta * h).clamp(min=0.0)  # the paper's update; a rate never below zero
            else:
                state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        rates.append(float(rate))
    return sum(losses) / len(losses), float(rate), rates


train_set, _, _ = digits_splits()
print(f"09: hypergradient descent on the learning rate, an MLP on digits, {EPOCHS} epochs (eager)")
results = {}
for name, (make_tx, lr, beta) in RUNS.items():
    loss, final, rates = train(make_tx, lr, beta)
    results[name] = loss
    trace = " ".join(f"{r:.3g}" for r in rates)
    print(
        f"{name:8} initial lr {lr:.0e} -> final lr {final:.4g}  last-epoch train loss {loss:.4f}  lr per epoch: {trace}"
    )

if not SMALL:  # the paper's result, checked
    for base in ("SGD", "Adam"):
        better = results[f"{base}-HD"] < results[base]
        print(f"{base}-HD {'beats' if better else 'DOES NOT beat'} {base} at the same initial rate")
        assert better, results
