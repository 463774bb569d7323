"""A step as a value (:class:`Step`: its function and what it is, as frozen fields), and the checks a step
makes of the state it is given before anything traces it.

Example:
    >>> as_step(lambda state, batch: (state, {})).kind
    'custom'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from torch import nn

from functrain import distributed
from functrain.core.member_axis import is_ensemble, metric_naming, size
from functrain.distributed.data_ranks import tp_size

__all__ = ["Step", "as_step", "check_state_matches", "expected_names", "refuse_plain_state"]


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """A pure step as a value: the function ``fn(state, batch)`` and what it is, said once as frozen fields.

    ``make_*_step`` and ``functrain.ensemble`` return steps; calling one runs ``fn``. :func:`functrain.jit`
    reads the fields when it runs the step (the model for its RNN rewrite, checkpoint routing and attention
    patch; ``settle`` before the first trace), and ``fit``, ``evaluate`` and ``predict`` ask them instead of
    probing the function. A changed step is a new value: ``step.replace(masked_batches=False)``.

    Attributes:
        fn: the pure function, ``fn(state, batch) -> ...``.
        kind: ``"train"``, ``"eval"``, ``"predict"``, or ``"custom"`` (a function of the user's own).
        model: the module (or apply function) the step runs.
        metrics: the metric collection whose state the step updates (``state.metrics`` for a train step).
        gradient_reducer: data parallelism's all-reduce of the gradients (``None``: one process).
        settle: what ``jit`` runs eagerly once before the first trace (a train step's forward).
        members: the step runs every member of an ensemble state at once (``functrain.ensemble``).
        sharding: how the step's state is laid out over the devices (``None``: replicated).
        masked_batches: the step takes :class:`functrain.data.MaskedBatch` inputs, so ``fit``,
            ``evaluate`` and ``predict`` pad a short last batch to the compiled batch size.

    Example:
        >>> import torch, functrain as ft
        >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> step = ft.make_train_step(torch.nn.Linear(4, 3), loss_fn)
        >>> step.kind, step.members, step.masked_batches
        ('train', False, True)
        >>> step.replace(masked_batches=False).masked_batches  # a new step; ``step`` is unchanged
        False
        >>> Step(lambda state, batch: (state, {})).kind
        'custom'
    """

    fn: Callable[..., Any]
    kind: Literal["train", "eval", "predict", "custom"] = "custom"
    model: Any = None
    metrics: Any = None
    gradient_reducer: Any = None
    settle: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    members: bool = False
    sharding: Any = None
    masked_batches: bool = False

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        return self.fn(state, *args, **kwargs)

    @property
    def __name__(self) -> str:  # what logs and errors call the step (its function's name)
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def replace(self, **fields: Any) -> Step:
        """This step with ``fields`` changed (a new value; this one is frozen)."""
        return dataclasses.replace(self, **fields)

    def check(self, state: Any, who: str = "fit") -> None:
        """Refuse a train step that cannot train ``state`` here: processes that would drift apart (no
        gradient all-reduce over them), or an ensemble state given a step for one model."""
        if self.kind != "train":
            return
        if distributed.is_distributed():
            # tensor parallelism: a tp group's ranks share one batch; its reducer spans the groups
            groups = distributed.world_size() // tp_size(state)
            reducer = self.gradient_reducer
            reduced = 1 if reducer is None and groups == 1 else getattr(reducer, "world_size", 0)
            if reduced != groups:
                raise ValueError(
                    f"{who}: {distributed.world_size()} processes train, but the train step does not "
                    "all-reduce its gradients over them, so the ranks would drift apart; build it with "
                    "make_train_step(..., gradient_reducer=functrain.distributed.gradient_reducer(model=model)), "
                    "created after functrain.distributed.initialize()"
                    + (
                        f"; with tensor parallelism over its {groups} tp groups (strategy="
                        "functrain.distributed.tensor_parallel(model, plan, mesh) with a (dp, tp) mesh)"
                        if groups != distributed.world_size()
                        else ""
                    )
                )
        if is_ensemble(state) and not self.members:
            raise ValueError(
                f"{who}: the state is an ensemble of {size(state)} members, but the train step runs one "
                "model; wrap it: ft.jit(ft.ensemble.step(train_step)) (and ft.ensemble.eval_step for "
                "evaluation)"
            )

    def naming(self, state: Any) -> Any:
        """How this step's metrics on ``state`` are named in the logs
        (:class:`functrain.core.member_names.MetricNaming`): the ensemble supplies its per-member naming."""
        return metric_naming(state)


def as_step(fn: Callable[..., Any]) -> Step:
    """``fn`` as a :class:`Step`: a step itself, the step a :func:`functrain.jit`-compiled step runs (its
    ``step``), or a ``"custom"`` step around a plain function.

    Example:
        >>> as_step(lambda state, batch: (state, {})).kind
        'custom'
    """
    if isinstance(fn, Step):
        return fn
    compiled = getattr(fn, "step", None)  # functrain.jit's CompiledStep (jit imports this module)
    return compiled if isinstance(compiled, Step) else Step(fn)


def expected_names(model: nn.Module | None) -> frozenset[str] | None:
    if model is None:
        return None
    names = {n for n, _ in model.named_parameters()} | {n for n, b in model.named_buffers() if b is not None}
    return frozenset(names)


def refuse_plain_state(state: Any, who: str = "the step") -> None:
    """Refuse a plain dict given as the state (what ``checkpoint.restore(path)`` gives without a target),
    in one line that says how to get a state back, before anything traces it.

    Example:
        >>> try:
        ...     refuse_plain_state({"params": {}}, "train_step")
        ... except TypeError as error:
        ...     print(str(error)[:42])
        train_step: the state is a plain dict (key
    """
    if type(state) is not dict:
        return
    if {"state", "loop"} <= set(state):
        how = "ft.checkpoint.restore_onto(state, ft.checkpoint.restore(path)['state'])"
        holds = "a fit checkpoint's {'state', 'loop'}"
    else:
        how = "ft.checkpoint.restore(path, target=state)"
        holds = f"keys {sorted(map(str, state))[:8]}"
    raise TypeError(
        f"{who}: the state is a plain dict ({holds}), which is what ft.checkpoint.restore(path) gives "
        f"without a target; restore onto a state built as before saving: state = {how}, with "
        "state = ft.TrainState.create(model, tx)"
    )


def check_state_matches(state: Any, expected: frozenset[str] | None) -> None:
    refuse_plain_state(state)
    if expected is None:
        return
    have = set(state.params) | set(state.buffers)
    if have != expected:
        missing = sorted(expected - have)[:8]
        unexpected = sorted(have - expected)[:8]
        raise ValueError(
            "the state does not belong to this model: "
            f"missing {missing}, unexpected {unexpected}. Create the state with "
            "TrainState.create(model, tx) from the same model the step was built with."
        )
