"""The gradient transformations the optimizers are built from, one small pure function pair each.

Each works on the flat list of leaves with ``torch._foreach_*`` kernels (one launch for all parameters in
eager mode), returns new tensors and never modifies its inputs. Per-parameter state (moments, traces) has
the structure of the params given to ``init``; scalars (counts, hyperparameters) are 0-d tensors on the
params' device. Where something differentiates through them (``torch.func.grad`` of a loss after
unrolled steps, w.r.t. the params or the hyperparameters), ``functrain.core.foreach`` runs each op leaf
by leaf, out of place: the same transforms are then differentiable.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> tx = optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-3))
    >>> state = tx.init({"w": torch.zeros(3)})
    >>> updates, state = tx.update({"w": torch.tensor([1.0, -2.0, 0.0])}, state)
    >>> updates["w"]
    tensor([-0.0010,  0.0010, -0.0000])
"""

from __future__ import annotations

import math

import torch

from functrain import tree
from functrain.core import foreach
from functrain.optim._leaves import (
    check_nonnegative,
    check_range,
    check_real,
    flatten_matching,
    scalar,
    scalar_dtype,
    zero_count,
)
from functrain.optim.base import (
    EmptyState,
    GradientTransformation,
    NormFn,
    ScalarOrSchedule,
    stateless_leafwise,
)
from functrain.optim.hyperparams import hyperparam_field
from functrain.optim.schedules import evaluate
from functrain.optim.state_betas import Beta, with_betas_in_state
from functrain.tree import PyTree

__all__ = [
    "AddDecayedWeightsState",
    "LearningRateState",
    "ScaleByAdagradState",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "ScheduledLearningRateState",
    "TraceState",
    "add_decayed_weights",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_trust_ratio",
    "trace",
]


def _one_minus_pow(base: float | torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``1 - base ** count`` as torch.optim computes it, in float64 (as its Python floats are): float64
    params get torch's bias corrections to the last bit or two, float32 and bf16 ones the float64 value
    rounded once (the cancellation in ``1 - 0.999 ** 1`` costs ~1e-13 relative in float64, 4 of float32's 7
    digits). Float32 where the device has no float64 (MPS), as ``-expm1(count * log(base))``, accurate for
    small counts. The dtype follows the count's device, not the leaves: no per-leaf check to trace. A
    tensor ``base`` (betas in the state) is used as a tensor, so the result is differentiable in it.
    """
    if isinstance(base, torch.Tensor):
        dtype = torch.float32 if count.device.type == "mps" else torch.float64
        return 1.0 - base.to(dtype) ** count.to(dtype)
    if count.device.type == "mps":
        if base == 0.0:
            return torch.ones_like(count, dtype=torch.float32)
        return -torch.expm1(count.to(torch.float32) * math.log(base))
    return 1.0 - torch.full_like(count, base, dtype=torch.float64) ** count.to(torch.float64)


def _add_scaled_square(acc: list[torch.Tensor], grads: list[torch.Tensor], weight: Beta) -> None:
    """``acc += weight * grads**2`` in place (the list's items): one ``addcmul`` for a float weight; a
    tensor weight (a beta in the state) scales a factor first, as ``addcmul`` takes only a number."""
    if isinstance(weight, torch.Tensor):
        foreach.addcmul_(acc, grads, foreach.mul(grads, weight))
    else:
        foreach.addcmul_(acc, grads, grads, weight)


def _once(*scalars: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same 0-d values, computed once per step under ``torch.compile`` rather than once per element.

    Inductor inlines a 0-d computation into every kernel that reads it, so ``expm1``/``sqrt`` of the
    step count (Adam's bias corrections) or a schedule's ``cos`` ran in the inner loop over every
    parameter: 2.4 of the 19 ms of the MLP benchmark's step. A stack and a sum over a size-1 dimension
    (exact: it adds nothing) make them a buffer of their own. Eagerly this costs two tiny kernels.
    """
    return tuple(torch.stack(scalars).unsqueeze(1).sum(1).unbind(0))


def _require_params(who: str, params: PyTree | None) -> PyTree:
    if params is None:
        raise ValueError(f"{who} needs the current parameters: call update(updates, state, params)")
    return params


# --------------------------------------------------------------------------------------------- scaling


def scale(step_size: float) -> GradientTransformation:
    """Multiply every update by the constant ``step_size`` (no state; not a hyperparameter).

    Example:
        >>> scale(-2.0).update({"w": torch.ones(1)}, EmptyState())[0]
        {'w': tensor([-2.])}
    """
    step_size = check_real("scale", "step_size", step_size)
    return stateless_leafwise(lambda leaves: foreach.mul(leaves, step_size))


@tree.struct
class LearningRateState:
    """State of :func:`scale_by_learning_rate` with a constant learning rate (settable)."""

    learning_rate: torch.Tensor = hyperparam_field()


@tree.struct
class ScheduledLearningRateState:
    """State of :func:`scale_by_learning_rate` with a schedule.

    ``learning_rate`` is the value the last update used (read-only, for logging); ``learning_rate_scale``
    multiplies the schedule and is settable.
    """

    count: torch.Tensor
    learning_rate: torch.Tensor = hyperparam_field(read_only=True)
    learning_rate_scale: torch.Tensor = hyperparam_field()


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (``+`` with ``flip_sign=False``); the rate lives in the state.

    A constant rate is a settable hyperparameter. A schedule ``count -> lr`` is evaluated at the state's
    count (0 for the first update); the state keeps the value used, and ``learning_rate_scale`` multiplies
    it (see :mod:`functrain.optim.hyperparams`).

    Example:
        >>> tx = scale_by_learning_rate(0.1)
        >>> tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-0.1000])}
    """
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        schedule = learning_rate

        def init_scheduled(params: PyTree) -> ScheduledLearningRateState:
            count = zero_count(params)
            return ScheduledLearningRateState(
                count=count,
                learning_rate=evaluate(schedule, count, scalar_dtype(params)),
                learning_rate_scale=scalar(1.0, params),
            )

        def update_scheduled(
            updates: PyTree, state: ScheduledLearningRateState, params: PyTree | None = None
        ) -> tuple[PyTree, ScheduledLearningRateState]:
            scale = state.learning_rate_scale
            # float32, or float64 when the state's hyperparameters are (never a cast-down bf16 count)
            dtype = torch.promote_types(scale.dtype, torch.float32)
            (lr,) = _once(evaluate(schedule, state.count, dtype) * scale)
            new_state = ScheduledLearningRateState(
                count=state.count + 1, learning_rate=lr, learning_rate_scale=state.learning_rate_scale
            )
            leaves, spec = tree.flatten(updates)
            if not leaves:
                return updates, new_state
            return tree.unflatten(spec, foreach.mul(leaves, lr * sign)), new_state

        return GradientTransformation(init_scheduled, update_scheduled)

    rate = check_real("scale_by_learning_rate", "learning_rate", learning_rate)

    def init(params: PyTree) -> LearningRateState:
        return LearningRateState(learning_rate=scalar(rate, params))

    def update(
        updates: PyTree, state: LearningRateState, params: PyTree | None = None
    ) -> tuple[PyTree, LearningRateState]:
        leaves, spec = tree.flatten(updates)
        if not leaves:
            return updates, state
        return tree.unflatten(spec, foreach.mul(leaves, state.learning_rate * sign)), state

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------------------------- decay


@tree.struct
class AddDecayedWeightsState:
    """State of :func:`add_decayed_weights`: the settable ``weight_decay``."""

    weight_decay: torch.Tensor = hyperparam_field()


def add_decayed_weights(weight_decay: float = 0.0, mask: PyTree | None = None) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update.

    Before ``scale_by_adam`` this is L2 regularisation (torch.optim.Adam's ``weight_decay``); after it and
    before ``scale_by_learning_rate`` it is decoupled decay (AdamW). ``mask`` (a pytree of bools like the
    params, or a function ``params -> mask``) limits the decay to leaves where it is True; the others pass
    through unchanged (see :func:`functrain.optim.masked`).

    Example:
        >>> tx = add_decayed_weights(0.5)
        >>> params = {"w": torch.tensor([2.0])}
        >>> tx.update({"w": torch.zeros(1)}, tx.init(params), params)[0]
        {'w': tensor([1.])}
    """
    decay = check_nonnegative("add_decayed_weights", "weight_decay", weight_decay)
    if mask is not None:
        from functrain.optim.masking import masked  # masking builds on this module's transforms

        return masked(add_decayed_weights(decay), mask)

    def init(params: PyTree) -> AddDecayedWeightsState:
        return AddDecayedWeightsState(weight_decay=scalar(decay, params))

    def update(
        updates: PyTree, state: AddDecayedWeightsState, params: PyTree | None = None
    ) -> tuple[PyTree, AddDecayedWeightsState]:
        params = _require_params("add_decayed_weights", params)
        leaves, (param_leaves,), spec = flatten_matching("add_decayed_weights", updates, params)
        if not leaves:
            return updates, state
        decayed = foreach.mul(param_leaves, state.weight_decay)
        foreach.add_(decayed, leaves)
        return tree.unflatten(spec, decayed), state

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------------------------- momentum


@tree.struct
class TraceState:
    """State of :func:`trace`: the momentum buffer."""

    trace: PyTree


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = decay * t + g``; the update is ``t``, or ``g + decay * t`` with ``nesterov``.

    This is torch.optim.SGD's momentum buffer with ``dampening=0`` (the buffer starts at zero, so the
    first step's buffer is the gradient, as in torch).

    Example:
        >>> tx = trace(0.9)
        >>> s = tx.init({"w": torch.zeros(1)})
        >>> u, s = tx.update({"w": torch.ones(1)}, s)
        >>> tx.update({"w": torch.ones(1)}, s)[0]
        {'w': tensor([1.9000])}
    """
    decay = check_range("trace", "decay", decay, 0.0, 1.0, high_open=False)

    def init(params: PyTree) -> TraceState:
        return TraceState(trace=tree.zeros_like(params))

    def update(updates: PyTree, state: TraceState, params: PyTree | None = None) -> tuple[PyTree, TraceState]:
        leaves, (buffers,), spec = flatten_matching("trace", updates, state.trace)
        if not leaves:
            return updates, state
        new_buffers = foreach.mul(buffers, decay)
        foreach.add_(new_buffers, leaves)
        out = foreach.add(leaves, new_buffers, alpha=decay) if nesterov else new_buffers
        return tree.unflatten(spec, out), TraceState(trace=tree.unflatten(spec, new_buffers))

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------------------------- adaptive


@tree.struct
class ScaleByAdamState:
    """State of :func:`scale_by_adam`: step count, first and second moments, and (amsgrad) their running max."""

    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    nu_max: PyTree  # None unless amsgrad


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    amsgrad: bool = False,
    betas_in_state: bool = False,
) -> GradientTransformation:
    """Adam's direction: ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with bias-corrected moments.

    With ``eps_root=0`` this is ``torch.optim.Adam``'s ``m / bc1 / (sqrt(v) / sqrt(bc2) + eps)``; with
    ``amsgrad`` the running maximum of the (uncorrected) second moment replaces it, as in torch.
    ``betas_in_state``: ``b1``, ``b2`` are settable, differentiable hyperparameters in the state
    (:mod:`functrain.optim.state_betas`).

    Example:
        >>> tx = scale_by_adam()
        >>> tx.update({"w": torch.tensor([3.0])}, tx.init({"w": torch.zeros(1)}))[0]["w"].round(decimals=6)
        tensor([1.])
    """
    who = "scale_by_adam"
    b1, b2 = check_range(who, "b1", b1, 0.0, 1.0), check_range(who, "b2", b2, 0.0, 1.0)
    eps, eps_root = check_nonnegative(who, "eps", eps), check_nonnegative(who, "eps_root", eps_root)

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=zero_count(params),
            mu=tree.zeros_like(params),
            nu=tree.zeros_like(params),
            nu_max=tree.zeros_like(params) if amsgrad else None,
        )

    def update(
        updates: PyTree, state: ScaleByAdamState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAdamState]:
        return update_with(updates, state, params, b1, b2)

    def update_with(
        updates: PyTree, state: ScaleByAdamState, params: PyTree | None, b1: Beta, b2: Beta
    ) -> tuple[PyTree, ScaleByAdamState]:
        moments = (state.mu, state.nu, state.nu_max) if amsgrad else (state.mu, state.nu)
        grads, state_leaves, spec = flatten_matching(who, updates, *moments)
        count = state.count + 1
        if not grads:
            return updates, state.replace(count=count)
        mu = foreach.lerp(state_leaves[0], grads, 1.0 - b1)
        nu = foreach.mul(state_leaves[1], b2)
        _add_scaled_square(nu, grads, 1.0 - b2)
        nu_max = foreach.maximum(state_leaves[2], nu) if amsgrad else None
        second = nu_max if amsgrad else nu
        bias_correction1 = _one_minus_pow(b1, count)
        bias_correction2 = _one_minus_pow(b2, count)
        if eps_root == 0.0:
            bias_correction1, sqrt_bias_correction2 = _once(bias_correction1, torch.sqrt(bias_correction2))
            denom = foreach.sqrt(second)
            foreach.div_(denom, sqrt_bias_correction2)
        else:
            bias_correction1, bias_correction2 = _once(bias_correction1, bias_correction2)
            denom = foreach.div(second, bias_correction2)
            foreach.add_(denom, eps_root)
            foreach.sqrt_(denom)
        foreach.add_(denom, eps)
        direction = foreach.div(mu, denom)
        foreach.div_(direction, bias_correction1)
        new_state = ScaleByAdamState(
            count=count,
            mu=tree.unflatten(spec, mu),
            nu=tree.unflatten(spec, nu),
            nu_max=tree.unflatten(spec, nu_max) if amsgrad else None,
        )
        return tree.unflatten(spec, direction), new_state

    if betas_in_state:
        return with_betas_in_state(init, update_with, b1, b2)
    return GradientTransformation(init, update)


@tree.struct
class ScaleByRmsState:
    """State of :func:`scale_by_rms`: the running mean of squares and (centered) of gradients."""

    nu: PyTree
    mu: PyTree  # None unless centered


def scale_by_rms(
    decay: float = 0.99, eps: float = 1e-8, centered: bool = False, initial_scale: float = 0.0
) -> GradientTransformation:
    """RMSprop's direction: ``g / (sqrt(v) + eps)``, ``v = decay * v + (1 - decay) * g**2``.

    ``eps`` is added outside the square root and ``centered`` subtracts the squared running mean of the
    gradients, both as in ``torch.optim.RMSprop`` (``decay`` is its ``alpha``).

    Example:
        >>> tx = scale_by_rms(decay=0.75)
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([2.])}
    """
    who = "scale_by_rms"
    decay = check_range(who, "decay", decay, 0.0, 1.0)
    eps = check_nonnegative(who, "eps", eps)
    initial_scale = check_nonnegative(who, "initial_scale", initial_scale)

    def init(params: PyTree) -> ScaleByRmsState:
        return ScaleByRmsState(
            nu=tree.map(lambda p: torch.full_like(p, initial_scale), params),
            mu=tree.zeros_like(params) if centered else None,
        )

    def update(
        updates: PyTree, state: ScaleByRmsState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByRmsState]:
        moments = (state.nu, state.mu) if centered else (state.nu,)
        grads, state_leaves, spec = flatten_matching(who, updates, *moments)
        if not grads:
            return updates, state
        nu = foreach.mul(state_leaves[0], decay)
        foreach.addcmul_(nu, grads, grads, 1.0 - decay)
        if centered:
            mu = foreach.lerp(state_leaves[1], grads, 1.0 - decay)
            avg = foreach.addcmul(nu, mu, mu, -1.0)
            foreach.sqrt_(avg)
        else:
            mu = None
            avg = foreach.sqrt(nu)
        foreach.add_(avg, eps)
        new_state = ScaleByRmsState(
            nu=tree.unflatten(spec, nu), mu=tree.unflatten(spec, mu) if centered else None
        )
        return tree.unflatten(spec, foreach.div(grads, avg)), new_state

    return GradientTransformation(init, update)


@tree.struct
class ScaleByAdagradState:
    """State of :func:`scale_by_adagrad`: the running sum of squared gradients."""

    sum_of_squares: PyTree


def scale_by_adagrad(initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> GradientTransformation:
    """Adagrad's direction ``g / (sqrt(sum of g**2) + eps)``, with ``eps`` outside the root as in torch.

    Example:
        >>> tx = scale_by_adagrad()
        >>> tx.update({"w": torch.tensor([-4.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-1.])}
    """
    who = "scale_by_adagrad"
    initial = check_nonnegative(who, "initial_accumulator_value", initial_accumulator_value)
    eps = check_nonnegative(who, "eps", eps)

    def init(params: PyTree) -> ScaleByAdagradState:
        return ScaleByAdagradState(sum_of_squares=tree.map(lambda p: torch.full_like(p, initial), params))

    def update(
        updates: PyTree, state: ScaleByAdagradState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAdagradState]:
        grads, (sums,), spec = flatten_matching(who, updates, state.sum_of_squares)
        if not grads:
            return updates, state
        new_sums = foreach.addcmul(sums, grads, grads)
        std = foreach.sqrt(new_sums)
        foreach.add_(std, eps)
        direction = foreach.div(grads, std)
        return tree.unflatten(spec, direction), ScaleByAdagradState(
            sum_of_squares=tree.unflatten(spec, new_sums)
        )

    return GradientTransformation(init, update)


@tree.struct
class ScaleByLionState:
    """State of :func:`scale_by_lion`: the momentum."""

    mu: PyTree


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, betas_in_state: bool = False) -> GradientTransformation:
    """Lion's direction ``sign(b1 * m + (1 - b1) * g)``, then ``m = b2 * m + (1 - b2) * g``.

    ``betas_in_state``: ``b1``, ``b2`` are settable, differentiable hyperparameters in the state
    (:mod:`functrain.optim.state_betas`).

    Example:
        >>> tx = scale_by_lion()
        >>> tx.update({"w": torch.tensor([0.3, -2.0])}, tx.init({"w": torch.zeros(2)}))[0]
        {'w': tensor([ 1., -1.])}
    """
    who = "scale_by_lion"
    b1, b2 = check_range(who, "b1", b1, 0.0, 1.0), check_range(who, "b2", b2, 0.0, 1.0)

    def init(params: PyTree) -> ScaleByLionState:
        return ScaleByLionState(mu=tree.zeros_like(params))

    def update(
        updates: PyTree, state: ScaleByLionState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByLionState]:
        return update_with(updates, state, params, b1, b2)

    def update_with(
        updates: PyTree, state: ScaleByLionState, params: PyTree | None, b1: Beta, b2: Beta
    ) -> tuple[PyTree, ScaleByLionState]:
        grads, (mu,), spec = flatten_matching(who, updates, state.mu)
        if not grads:
            return updates, state
        direction = foreach.sign(foreach.lerp(mu, grads, 1.0 - b1))
        new_mu = foreach.lerp(mu, grads, 1.0 - b2)
        return tree.unflatten(spec, direction), ScaleByLionState(mu=tree.unflatten(spec, new_mu))

    if betas_in_state:
        return with_betas_in_state(init, update_with, b1, b2)
    return GradientTransformation(init, update)


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> GradientTransformation:
    """LAMB's layer-wise trust ratio: scale each leaf's update by ``||param|| / ||update||``.

    Norms are floored at ``min_norm``; where either norm is zero the ratio is 1 (as in optax).
    ``update(..., norm=fn)`` takes the per-leaf norms with ``fn`` (a sharded step's are over all ranks'
    rows; :data:`functrain.optim.NormFn`).

    Example:
        >>> tx = scale_by_trust_ratio()
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> tx.update({"w": torch.tensor([0.0, 0.5])}, tx.init(params), params)[0]
        {'w': tensor([0., 5.])}
    """
    who = "scale_by_trust_ratio"
    min_norm = check_nonnegative(who, "min_norm", min_norm)
    trust_coefficient = check_real(who, "trust_coefficient", trust_coefficient)
    eps = check_nonnegative(who, "eps", eps)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(
        updates: PyTree, state: EmptyState, params: PyTree | None = None, *, norm: NormFn | None = None
    ) -> tuple[PyTree, EmptyState]:
        params = _require_params(who, params)
        leaves, (param_leaves,), spec = flatten_matching(who, updates, params)
        if not leaves:
            return updates, state
        norms = foreach.norm if norm is None else norm
        param_norms = torch.stack(norms(param_leaves)).clamp(min=min_norm)
        update_norms = torch.stack(norms(leaves)).clamp(min=min_norm)
        ratio = trust_coefficient * param_norms / (update_norms + eps)
        ratio = torch.where((param_norms == 0) | (update_norms == 0), torch.ones_like(ratio), ratio)
        out = [u * r.to(u.dtype) for u, r in zip(leaves, ratio.unbind())]
        return tree.unflatten(spec, out), state

    return GradientTransformation(init, update)
