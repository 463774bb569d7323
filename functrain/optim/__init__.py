"""Optimizers as optax-style gradient transformations over pytrees of tensors.

``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)`` are pure functions:
they compile together with the forward and backward pass into one ``torch.compile(fullgraph=True)`` graph.
Learning rates and weight decays live in the state as 0-d tensors (:func:`hyperparams`,
:func:`set_hyperparams`), schedules are tensor functions of the state's step count, and every step count is
a 0-d int64 tensor, so nothing that changes between steps triggers a recompile.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> params = {"w": torch.ones(3)}
    >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.01))
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": torch.ones(3)}, state, params)
    >>> params = optim.apply_updates(params, updates)

Train steps call :func:`apply_gradients`, which takes a transformation's fused ``apply`` when it has one
(``adam``/``adamw`` run torch's fused kernel as one op: shorter compiles).

Every optimizer is differentiable: ``torch.func.grad`` through unrolled train steps w.r.t. the initial
params and the hyperparameters (set with :func:`set_hyperparams`; Adam's, Lion's and LAMB's betas too with
``betas_in_state=True``, :mod:`functrain.optim.state_betas`) takes the leaf-by-leaf, out-of-place
path by itself wherever an argument requires a gradient (tests/test_differentiable_training.py); where
nothing does, the foreach and fused kernels run as before.

Modules: ``base`` (the pair, ``chain``, ``apply_updates``, ``apply_gradients``), ``transforms`` (the
building blocks), ``fused`` (Adam's fused kernel), ``clipping``, ``schedules``, ``hyperparams``,
``masking`` (``multi_transform``, ``masked``, ``freeze``), ``selection`` (masks and labels by parameter
name or module index), ``finite`` (``skip_not_finite``), ``aliases`` (``sgd``, ``adam``, ``adamw``,
``rmsprop``, ``adagrad``, ``lion``, ``lamb``), ``privacy`` (``differentially_private_aggregate``,
``dpsgd``: per-example gradients in), ``lookahead``, ``averaging`` (``ema``, ``swa``: ``ft.optim.averaging.ema(0.999)``
chained last).
"""

from functrain.optim import averaging
from functrain.optim.aliases import adagrad, adam, adamw, lamb, lion, rmsprop, sgd
from functrain.optim.base import (
    EmptyState,
    GradientTransformation,
    NormFn,
    OptState,
    ScalarOrSchedule,
    Schedule,
    apply_gradients,
    apply_updates,
    chain,
    identity,
    set_to_zero,
    stateless_leafwise,
)
from functrain.optim.clipping import clip, clip_by_global_norm
from functrain.optim.finite import SkipNotFiniteState, all_finite, skip_not_finite
from functrain.optim.hyperparams import hyperparam_field, hyperparams, set_hyperparams
from functrain.optim.lookahead import LookaheadState, lookahead
from functrain.optim.masking import (
    FreezeState,
    MaskedState,
    MultiTransformState,
    freeze,
    masked,
    multi_transform,
)
from functrain.optim.privacy import (
    DifferentiallyPrivateAggregateState,
    differentially_private_aggregate,
    dpsgd,
    per_example_global_norm_clip,
)
from functrain.optim.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    one_cycle_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_cosine_decay_schedule,
)
from functrain.optim.selection import (
    Pattern,
    batchnorm_param_names,
    labels_by_name,
    mask_by_name,
    names_by_module_index,
    param_names,
)
from functrain.optim.state_betas import BetasState, with_betas_in_state
from functrain.optim.transforms import (
    AddDecayedWeightsState,
    LearningRateState,
    ScaleByAdagradState,
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByRmsState,
    ScheduledLearningRateState,
    TraceState,
    add_decayed_weights,
    scale,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_trust_ratio,
    trace,
)

__all__ = [
    "AddDecayedWeightsState",
    "BetasState",
    "DifferentiallyPrivateAggregateState",
    "EmptyState",
    "FreezeState",
    "GradientTransformation",
    "LearningRateState",
    "LookaheadState",
    "MaskedState",
    "MultiTransformState",
    "NormFn",
    "OptState",
    "Pattern",
    "ScalarOrSchedule",
    "ScaleByAdagradState",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "Schedule",
    "ScheduledLearningRateState",
    "SkipNotFiniteState",
    "TraceState",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_gradients",
    "apply_updates",
    "averaging",
    "batchnorm_param_names",
    "chain",
    "clip",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "differentially_private_aggregate",
    "dpsgd",
    "exponential_decay",
    "freeze",
    "hyperparam_field",
    "hyperparams",
    "identity",
    "join_schedules",
    "labels_by_name",
    "lamb",
    "linear_schedule",
    "lion",
    "lookahead",
    "mask_by_name",
    "masked",
    "multi_transform",
    "names_by_module_index",
    "one_cycle_schedule",
    "param_names",
    "per_example_global_norm_clip",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "rmsprop",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_trust_ratio",
    "set_hyperparams",
    "set_to_zero",
    "sgd",
    "skip_not_finite",
    "stateless_leafwise",
    "trace",
    "warmup_cosine_decay_schedule",
    "with_betas_in_state",
]
