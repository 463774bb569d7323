"""Ready-made optimizers, each one ``chain(...)`` of transformations, matching ``torch.optim`` where named alike.

Every alias keeps ``learning_rate`` (and ``weight_decay`` where it has one) as a 0-d tensor in its state:
read them with :func:`functrain.optim.hyperparams`, change them with :func:`functrain.optim.set_hyperparams`.
``learning_rate`` may be a float or a schedule ``count -> lr``.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> tx = optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000), weight_decay=0.05)
    >>> state = tx.init({"w": torch.zeros(3)})
    >>> sorted(optim.hyperparams(state))
    ['learning_rate', 'learning_rate_scale', 'weight_decay']
"""

from __future__ import annotations

import torch

from functrain.optim._leaves import check_nonnegative, check_real
from functrain.optim.base import GradientTransformation, ScalarOrSchedule, chain
from functrain.optim.fused import adam_with_fused_apply
from functrain.optim.schedules import takes_dtype
from functrain.optim.transforms import (
    add_decayed_weights,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_trust_ratio,
    trace,
)
from functrain.tree import PyTree

__all__ = ["adagrad", "adam", "adamw", "lamb", "lion", "rmsprop", "sgd"]


def _coupled_decay(weight_decay: float) -> list[GradientTransformation]:
    """L2 regularisation added to the gradient, present only when asked for (it costs a kernel per step)."""
    return [add_decayed_weights(weight_decay)] if weight_decay else []


def sgd(
    learning_rate: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """``torch.optim.SGD(lr, momentum, nesterov=..., weight_decay=...)`` (``dampening=0``; L2 decay coupled).

    Example:
        >>> import torch
        >>> tx = sgd(0.1, momentum=0.9)
        >>> tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-0.1000])}
    """
    momentum = check_nonnegative("sgd", "momentum", momentum)
    if nesterov and momentum == 0:
        raise ValueError("sgd: nesterov=True needs momentum > 0 (as in torch.optim.SGD)")
    return chain(
        *_coupled_decay(check_nonnegative("sgd", "weight_decay", weight_decay)),
        *([trace(momentum, nesterov)] if momentum else []),
        scale_by_learning_rate(learning_rate),
    )


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    fused: bool = True,
    betas_in_state: bool = False,
) -> GradientTransformation:
    """``torch.optim.Adam(lr, betas=(b1, b2), eps, weight_decay, amsgrad)``: weight decay is L2, added to the gradient.

    ``fused``: train steps run the update as torch's fused kernel, one opaque op in the compiled graph
    (:mod:`functrain.optim.fused`: a much shorter cold compile); ``False`` leaves it to inductor, which
    fuses it into the backward's kernels (steps ~2-3% faster on CPU, compiles longer).
    ``betas_in_state``: ``b1``, ``b2`` are settable, differentiable hyperparameters in the state
    (:mod:`functrain.optim.state_betas`); the update is then the in-graph one (as ``fused=False``).

    Example:
        >>> import torch
        >>> tx = adam(0.1)
        >>> tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-0.1000])}
    """
    tx = adam_with_fused_apply(
        b1, b2, eps, amsgrad, scale_by_learning_rate(learning_rate),
        coupled=_coupled_decay(check_nonnegative("adam", "weight_decay", weight_decay)),
        betas_in_state=betas_in_state,
    )  # fmt: skip
    return tx if fused else tx._replace(apply=None)


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: PyTree | None = None,
    amsgrad: bool = False,
    fused: bool = True,
    betas_in_state: bool = False,
) -> GradientTransformation:
    """``torch.optim.AdamW``: decoupled weight decay ``p -= lr * weight_decay * p`` beside the Adam step.

    ``mask`` (bools like the params, or a function ``params -> bools``) limits the decay to leaves where it
    is True, e.g. ``mask=lambda p: optim.mask_by_name(p, ["*.weight"])``; the others are not decayed.
    ``fused`` and ``betas_in_state`` as in :func:`adam`.

    Example:
        >>> import torch
        >>> tx = adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(1)}
        >>> tx.update({"w": torch.ones(1)}, tx.init(params), params)[0]
        {'w': tensor([-0.1500])}
    """
    tx = adam_with_fused_apply(
        b1, b2, eps, amsgrad, scale_by_learning_rate(learning_rate),
        weight_decay=check_nonnegative("adamw", "weight_decay", weight_decay),
        mask=mask,
        betas_in_state=betas_in_state,
    )  # fmt: skip
    return tx if fused else tx._replace(apply=None)


def rmsprop(
    learning_rate: ScalarOrSchedule,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
) -> GradientTransformation:
    """``torch.optim.RMSprop(lr, alpha, eps, weight_decay, momentum, centered)``, same arithmetic.

    Example:
        >>> import torch
        >>> tx = rmsprop(0.01, alpha=0.75)
        >>> tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-0.0200])}
    """
    momentum = check_nonnegative("rmsprop", "momentum", momentum)
    return chain(
        *_coupled_decay(check_nonnegative("rmsprop", "weight_decay", weight_decay)),
        scale_by_rms(alpha, eps, centered),
        *([trace(momentum)] if momentum else []),
        scale_by_learning_rate(learning_rate),
    )


def adagrad(
    learning_rate: ScalarOrSchedule,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
) -> GradientTransformation:
    """``torch.optim.Adagrad(lr, lr_decay, weight_decay, initial_accumulator_value, eps)``.

    ``lr_decay`` turns a float ``learning_rate`` into the schedule ``lr / (1 + count * lr_decay)``, as torch.

    Example:
        >>> import torch
        >>> tx = adagrad(0.1)
        >>> tx.update({"w": torch.full((1,), 3.0)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-0.1000])}
    """
    lr_decay = check_nonnegative("adagrad", "lr_decay", lr_decay)
    if lr_decay:
        if callable(learning_rate):
            raise ValueError("adagrad: give either lr_decay or a learning-rate schedule, not both")
        base = check_real("adagrad", "learning_rate", learning_rate)

        @takes_dtype
        def learning_rate(count, dtype=torch.float32):  # type: ignore[no-untyped-def]
            return base / (1.0 + count.to(dtype) * lr_decay)

    return chain(
        *_coupled_decay(check_nonnegative("adagrad", "weight_decay", weight_decay)),
        scale_by_adagrad(initial_accumulator_value, eps),
        scale_by_learning_rate(learning_rate),
    )


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    mask: PyTree | None = None,
    betas_in_state: bool = False,
) -> GradientTransformation:
    """Lion (Chen et al. 2023): ``p -= lr * (sign(b1 * m + (1 - b1) * g) + weight_decay * p)``.

    Use a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger (the paper's advice).
    ``betas_in_state`` as in :func:`adam`.

    Example:
        >>> import torch
        >>> tx = lion(0.1, weight_decay=0.0)
        >>> tx.update({"w": torch.tensor([0.2, -3.0])}, tx.init({"w": torch.zeros(2)}), {"w": torch.zeros(2)})[0]
        {'w': tensor([-0.1000,  0.1000])}
    """
    return chain(
        scale_by_lion(b1, b2, betas_in_state),
        add_decayed_weights(check_nonnegative("lion", "weight_decay", weight_decay), mask),
        scale_by_learning_rate(learning_rate),
    )


def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask: PyTree | None = None,
    betas_in_state: bool = False,
) -> GradientTransformation:
    """LAMB (You et al. 2020), as optax: Adam direction plus decoupled decay, scaled per leaf by ``||p|| / ||u||``.

    ``betas_in_state`` as in :func:`adam`.

    Example:
        >>> import torch
        >>> tx = lamb(0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> tx.update({"w": torch.tensor([1.0, 0.0])}, tx.init(params), params)[0]
        {'w': tensor([-0.5000, -0.0000])}
    """
    return chain(
        scale_by_adam(b1, b2, eps, betas_in_state=betas_in_state),
        add_decayed_weights(check_nonnegative("lamb", "weight_decay", weight_decay), mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )
