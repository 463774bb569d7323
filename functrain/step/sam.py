"""Sharpness-aware minimization (Foret et al. 2021) as a stage of the train step.

``make_train_step(..., sam_rho=0.05)``: the gradient stage takes the gradient ``g`` at the params ``w``,
then the gradient at the perturbed params ``w + rho * g / ||g||``, and that second gradient is what the
optimizer applies to ``w``: optax's ``contrib.sam`` in its opaque mode with the paper's adversary
(``sam(optimizer, chain(normalize(), sgd(rho)), sync_period=2, opaque_mode=True)``), both gradients in
the same graph. The loss and metrics reported are those at ``w``; the buffers (BatchNorm statistics) are
those of the first forward, as the authors' code keeps them (the perturbed forward is a probe).

With ``accumulate > 1`` and with data parallelism each micro-batch and each process perturbs the params
with its own gradient, the paper's m-sharpness (``m`` = the micro-batch), as the authors' own
implementation does per accelerator; the second gradients are then summed and reduced as usual. A zero
gradient (``||g|| = 0``) leaves the params unperturbed (optax's ``normalize`` would give NaN).

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(3, 2)
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy), sam_rho=0.05)
    >>> state, metrics = step(state, (torch.randn(8, 3), torch.randint(0, 2, (8,))))
    >>> int(state.step)
    1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functrain import tree

__all__ = ["check_sam_rho", "sam_loss_and_grad"]


def check_sam_rho(sam_rho: float | None) -> float | None:
    """``sam_rho`` checked: ``None`` (no SAM) or a positive finite float."""
    if sam_rho is None:
        return None
    if isinstance(sam_rho, bool) or not isinstance(sam_rho, (int, float)) or not 0 < sam_rho < float("inf"):
        raise ValueError(f"sam_rho must be a positive float (the perturbation's radius), got {sam_rho!r}")
    return float(sam_rho)


def sam_loss_and_grad(grad_fn: Callable[..., Any], rho: float) -> Callable[..., Any]:
    """The step's gradient function ``grad_fn(params, buffers, batch, factor, *masking)`` made SAM's: its
    gradient at ``params + rho * g / ||g||``, its loss, aux and buffers at ``params``."""

    def sam_grad_fn(params: dict, buffers: dict, batch: Any, factor: Any, *masking: Any) -> Any:
        grads, out = grad_fn(params, buffers, batch, factor, *masking)
        leaves = [g for g in tree.leaves(grads) if isinstance(g, torch.Tensor)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in leaves))  # type: ignore[arg-type]
        scale = torch.where(norm > 0, rho / norm, torch.zeros_like(norm))
        perturbed = {k: p + (scale * grads[k]).to(p.dtype) for k, p in params.items()}
        adversarial, _ = grad_fn(perturbed, buffers, batch, factor, *masking)
        return adversarial, out

    return sam_grad_fn
