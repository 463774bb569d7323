"""Ensembles and sweeps: N models trained in one compiled step by vmapping the pure step over a stacked
train state.

- :mod:`~functrain.ensemble.stacked`: ``create``, ``member``/``members``, ``stack``, ``initialise``;
- :mod:`~functrain.ensemble.steps`: ``step``, ``eval_step``, ``predict_step`` (vmapped over the members);
- :mod:`~functrain.ensemble.grid`: grids of hyperparameters as one ensemble (what
  ``TrainerConfig(sweep=...)`` trains; its state, results and plots: :mod:`functrain.trainer.sweep`).

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> state = ft.ensemble.create(model, ft.optim.adam(1e-3), seeds=[0, 1, 2, 3],
    ...                            hyperparams={"learning_rate": [1e-3, 1e-3, 3e-3, 3e-3]})
    >>> loss = ft.supervised_loss(torch.nn.functional.cross_entropy)
    >>> train_step = ft.jit(ft.ensemble.step(ft.make_train_step(model, loss)), compile=False)
    >>> state, metrics = train_step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    >>> metrics["loss"].shape
    torch.Size([4])
    >>> ft.ensemble.member(state, 2).params["0.weight"].shape
    torch.Size([16, 4])
"""

from functrain.core.member_axis import is_ensemble, size
from functrain.ensemble.stacked import (
    create,
    initialise,
    member,
    members,
    run_key,
    run_step,
    stack,
)
from functrain.ensemble.steps import MemberMetrics, eval_step, predict_step, step, vmap_members

__all__ = [
    "MemberMetrics",
    "create",
    "eval_step",
    "initialise",
    "is_ensemble",
    "member",
    "members",
    "predict_step",
    "run_key",
    "run_step",
    "size",
    "stack",
    "step",
    "vmap_members",
]
