"""Pure step functions: ``train_step(state, batch) -> (state, metrics)`` and ``eval_step(state, batch)``.

A step is built from a model (or an apply function) and a *loss function* that receives a callable
running the model with the state's weights, and the batch — the same shape as Hugging Face's and Towhee's
``compute_loss(model, inputs)``::

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y), {"preds": logits, "target": y}

A loss function returns the loss (a 0-d tensor, the *mean* over the batch's examples) or ``(loss, aux)``
with ``aux`` a dict. Recognised ``aux`` entries: ``"preds"`` and ``"target"`` (fed to metrics; ``"preds"``
is what ``predict`` returns), ``"metrics"`` (a dict of extra 0-d tensors reported with the loss). The
step never syncs the host: every metric leaves it as a tensor.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 3)
    >>> tx = ft.optim.sgd(0.1)
    >>> state = ft.TrainState.create(model, tx)
    >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.CrossEntropyLoss()))
    >>> state, metrics = step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    >>> sorted(metrics)
    ['grad_norm', 'loss']
"""

from __future__ import annotations

from functrain.step.base import Step, as_step, refuse_plain_state
from functrain.step.batch import Batch, LossFn, num_examples, split_batch, supervised_loss
from functrain.step.bind import ApplyFn
from functrain.step.evaluate import make_eval_step, make_predict_step
from functrain.step.train import make_train_step

__all__ = [
    "ApplyFn",
    "Batch",
    "LossFn",
    "Step",
    "as_step",
    "make_eval_step",
    "make_predict_step",
    "make_train_step",
    "num_examples",
    "refuse_plain_state",
    "split_batch",
    "supervised_loss",
]
