"""Differentially private SGD (Abadi et al. 2016): optax's ``differentially_private_aggregate`` and ``dpsgd``.

Unlike the other transformations, these take **per-example gradients**: every leaf has a leading batch
axis, ``(B, *param.shape)``, as ``make_train_step(..., per_example=True)`` gives them (or a ``vmap`` of
your own). The aggregate clips each example's gradient to the L2 norm ``l2_norm_clip`` (over all leaves
together), sums them, adds Gaussian noise of standard deviation ``noise_multiplier * l2_norm_clip`` and
divides by ``B``: the private mean gradient, which the rest of the chain (momentum, the learning rate)
treats as any gradient. At ``noise_multiplier=0`` this is Opacus's ``DPOptimizer`` step but for its clip
factor's ``1e-6`` (Opacus divides by ``norm + 1e-6``; here, as in the paper and optax, by the norm).

The noise is a function of the state only: the state keeps a key (from ``seed``) and a count, and each
update draws from ``(key, count)`` (:mod:`functrain.core.hash_normal`), so a run is reproducible, a
resumed run draws what the uninterrupted one did, bitwise, every process of a data-parallel run would
draw the same, and an eager and a compiled step draw the same numbers (up to the last bit of ``log`` and
``cos``). The privacy guarantee assumes the seed is secret: without ``seed`` one is taken from the
operating system (and kept in the state, so a resume still continues the same sequence).

How much privacy a run spends (epsilon for a delta, from the noise multiplier, the sampling rate and the
number of steps) is a privacy accountant's job, not written here: :func:`epsilon` and
:func:`noise_multiplier_for_epsilon` ask Opacus's accountants (RDP by default, or PRV;
``pip install "functrain[privacy]"``). They assume Poisson sampling of each batch with
``sample_rate = batch_size / dataset_size``; shuffled fixed-size batches, as the loop draws them, are the
common approximation (Opacus and TF-Privacy tutorials make it too).

Example:
    >>> import torch
    >>> tx = dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
    >>> params = {"w": torch.zeros(2)}
    >>> per_example = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
    >>> updates, state = tx.update(per_example, tx.init(params), params)
    >>> updates["w"]  # -0.1 * ([0.6, 0.8] + [0.3, 0.4]) / 2
    tensor([-0.0450, -0.0600])
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from functrain import random, tree
from functrain.core.hash_normal import normal
from functrain.optim._leaves import check_nonnegative, zero_count
from functrain.optim.base import GradientTransformation, ScalarOrSchedule, chain, identity
from functrain.optim.transforms import scale_by_learning_rate, trace
from functrain.tree import PyTree

__all__ = [
    "DifferentiallyPrivateAggregateState",
    "differentially_private_aggregate",
    "dpsgd",
    "epsilon",
    "noise_multiplier_for_epsilon",
    "per_example_global_norm_clip",
]


@tree.struct
class DifferentiallyPrivateAggregateState:
    """State of :func:`differentially_private_aggregate`: the noise key's two 32-bit words (int64, on the
    params' device) and the number of updates made (each draws from ``(key, count)``)."""

    key: torch.Tensor
    count: torch.Tensor


def per_example_global_norm_clip(
    grads: list[torch.Tensor], l2_norm_clip: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(sum of the clipped per-example gradients, how many examples were clipped)``: each example's
    gradient (the leading axis of every leaf) is scaled by ``min(1, l2_norm_clip / ||g_i||)``, its norm
    taken over all leaves together (optax's function of the same name).

    Example:
        >>> summed, clipped = per_example_global_norm_clip([torch.tensor([[3.0, 4.0], [0.3, 0.4]])], 1.0)
        >>> summed[0], int(clipped)
        (tensor([0.9000, 1.2000]), 1)
    """
    norms = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads).sqrt()  # type: ignore[union-attr]
    factors = torch.clamp(l2_norm_clip / norms, max=1.0).nan_to_num(nan=1.0)  # a zero gradient: 0/0 at C=0
    # a product and a sum over the batch axis, not tensordot: inductor fuses it with the norms (measured
    # compiled, 64-wide MLP, B=64: 2.07 ms a step against tensordot's 3.90; a plain step 1.18)
    summed = [(g * factors.to(g.dtype).view(-1, *[1] * (g.ndim - 1))).sum(0) for g in grads]
    return summed, (norms > l2_norm_clip).sum()


def differentially_private_aggregate(
    l2_norm_clip: float, noise_multiplier: float, seed: int | None = None
) -> GradientTransformation:
    """The DP-SGD aggregate of per-example gradients (leading batch axis ``B`` on every leaf): clip each
    example's gradient to ``l2_norm_clip``, sum, add ``N(0, (noise_multiplier * l2_norm_clip)**2)`` to
    every coordinate, divide by ``B``. First in a chain, as in optax.

    ``seed``: the noise key's seed (keep it secret for the privacy guarantee); ``None`` takes one from the
    operating system. Given ``params``, each gradient leaf must be ``(B, *param.shape)``: a plain
    gradient is refused (its first axis would be taken for the batch).

    Example:
        >>> tx = differentially_private_aggregate(l2_norm_clip=1.0, noise_multiplier=1.1, seed=0)
        >>> params = {"w": torch.zeros(3)}
        >>> updates, state = tx.update({"w": torch.ones(8, 3)}, tx.init(params), params)
        >>> updates["w"].shape, int(state.count)
        (torch.Size([3]), 1)
    """
    l2_norm_clip = check_nonnegative("differentially_private_aggregate", "l2_norm_clip", l2_norm_clip)
    noise_multiplier = check_nonnegative(
        "differentially_private_aggregate", "noise_multiplier", noise_multiplier
    )
    if seed is None:
        seed = secrets.randbits(63)
    key = random.key(seed)
    noise_std = l2_norm_clip * noise_multiplier

    def init(params: PyTree) -> DifferentiallyPrivateAggregateState:
        count = zero_count(params)
        return DifferentiallyPrivateAggregateState(key=key.to(count.device), count=count)

    def update(
        updates: PyTree, state: DifferentiallyPrivateAggregateState, params: PyTree | None = None
    ) -> tuple[PyTree, DifferentiallyPrivateAggregateState]:
        leaves, spec = tree.flatten(updates)
        if not leaves:
            return updates, state
        if params is not None:
            _check_per_example(updates, params)
        batch = leaves[0].shape[0]
        summed, _ = per_example_global_norm_clip(leaves, l2_norm_clip)
        if noise_std:
            flat = normal(state.key, state.count, sum(g.numel() for g in summed), torch.float64)
            noises = flat.split([g.numel() for g in summed])
            summed = [g + noise_std * z.view(g.shape).to(g.dtype) for g, z in zip(summed, noises)]
        out = [g / batch for g in summed]
        return tree.unflatten(spec, out), state.replace(count=state.count + 1)

    return GradientTransformation(init, update)


def dpsgd(
    learning_rate: ScalarOrSchedule,
    l2_norm_clip: float,
    noise_multiplier: float,
    seed: int | None = None,
    momentum: float | None = None,
    nesterov: bool = False,
) -> GradientTransformation:
    """DP-SGD: :func:`differentially_private_aggregate`, then momentum (``trace``) when given, then the
    learning rate (optax's ``dpsgd``). Takes per-example gradients: ``make_train_step(...,
    per_example=True)``.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=1.1, seed=0))
        >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy),
        ...                           per_example=True)
        >>> state, metrics = step(state, (torch.randn(8, 4), torch.randint(0, 2, (8,))))
        >>> int(state.step)
        1
    """
    return chain(
        differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed),
        trace(momentum, nesterov) if momentum is not None else identity(),
        scale_by_learning_rate(learning_rate),
    )


def epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """The epsilon a DP-SGD run spends at ``delta``: ``steps`` updates with ``noise_multiplier``, each
    batch a ``sample_rate`` fraction of the data, by Opacus's accountant (``"rdp"``, ``"prv"`` or
    ``"gdp"``; needs ``pip install "functrain[privacy]"``).

    Example:
        >>> round(epsilon(1.1, 256 / 60_000, 2_340, 1e-5), 2)  # doctest: +SKIP
        1.1
    """
    acct = _accountants().create_accountant(mechanism=accountant)
    acct.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(acct.get_epsilon(delta=float(delta)))


def noise_multiplier_for_epsilon(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """The smallest noise multiplier whose ``steps`` updates at ``sample_rate`` spend at most
    ``target_epsilon`` at ``delta``, by Opacus's ``get_noise_multiplier`` (needs ``pip install
    "functrain[privacy]"``).

    Example:
        >>> noise_multiplier_for_epsilon(3.0, 1e-5, 256 / 60_000, 2_340)  # doctest: +SKIP
        0.7421875
    """
    from_opacus = _accountants().utils.get_noise_multiplier
    return float(
        from_opacus(
            target_epsilon=float(target_epsilon),
            target_delta=float(delta),
            sample_rate=float(sample_rate),
            steps=int(steps),
            accountant=accountant,
        )
    )


def _accountants() -> Any:
    try:
        import opacus.accountants
        import opacus.accountants.utils
    except ImportError as err:
        raise ImportError(
            "privacy accounting uses Opacus's accountants, which are not installed: "
            'pip install "functrain[privacy]" (or pip install opacus)'
        ) from err
    return opacus.accountants


def _check_per_example(updates: PyTree, params: PyTree) -> None:
    batches = set()
    for i, (g, p) in enumerate(zip(tree.leaves(updates), tree.leaves(params))):
        if tuple(g.shape[1:]) != tuple(p.shape) or g.ndim != p.ndim + 1:
            raise ValueError(
                f"differentially_private_aggregate takes per-example gradients (shape (B, *param.shape)); "
                f"{tree.paths(updates)[i]} is {tuple(g.shape)} for a param of shape {tuple(p.shape)}. Build the step with "
                "make_train_step(..., per_example=True)"
            )
        batches.add(g.shape[0])
    if len(batches) > 1:
        raise ValueError(
            f"differentially_private_aggregate: the per-example gradients disagree on the batch size "
            f"(leading axes {sorted(batches)})"
        )
