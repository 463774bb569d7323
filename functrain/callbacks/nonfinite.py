"""Non-finite steps: skipped inside the compiled step, counted and limited between steps.

One NaN example, or a loss that overflows, makes a step's loss or gradients NaN/inf; applied, that update
turns every parameter into NaN for the rest of the run. :func:`skip_nonfinite` wraps a train step so that
such a step changes nothing but the step count: the parameters, buffers (BatchNorm statistics) and
optimizer state stay those of the step before, chosen with ``torch.where`` inside the graph (no host sync,
no branch, no recompile), and the step reports ``skipped`` (1.0 or 0.0) in its metrics.
:class:`SkippedSteps` counts those reports on the device, logs the run's total as ``train/skipped_steps``
and ends the run with :class:`NonFiniteLossError` once too many steps in a row were skipped: a run whose
every step is skipped has diverged and will not recover.

``TrainerConfig(nonfinite=..., max_consecutive_nonfinite=...)`` sets both up for a ``Trainer``.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
    >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
    >>> data[0] = (torch.full((4,), float("nan")), torch.tensor(0))  # one batch's loss is NaN
    >>> guarded = ft.jit(skip_nonfinite(step), compile=False)
    >>> result = ft.fit(state, guarded, data, batch_size=16, epochs=1, progress_bar=False,
    ...                 callbacks=[SkippedSteps(10)])
    >>> result.history.latest("train/skipped_steps"), bool(result.state.params["weight"].isfinite().all())
    (1.0, True)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from functrain import tree
from functrain.callbacks.base import Callback, Context
from functrain.callbacks.monitors import NonFiniteLossError
from functrain.step import Step, as_step

__all__ = ["SkippedSteps", "skip_nonfinite"]


def skip_nonfinite(train_step: Callable[[Any, Any], tuple[Any, dict[str, Any]]]) -> Step:
    """``train_step`` whose steps with a non-finite loss or gradient norm leave the state as it was
    (except its step count) and report ``metrics["skipped"] = 1.0`` (else ``0.0``).

    With fp16 loss scaling (``state.loss_scale``) overflowing gradients are the scaler's to skip (it
    lowers the scale); then only a non-finite *loss* counts here. A skipped step does not advance the
    optimizer's own count, so schedules and bias corrections see applied steps only (as
    ``optim.skip_not_finite`` and ``optax.apply_if_finite``). The step needs the incoming state's tensors
    after the update, so it never updates them in place, even when donated.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> step = skip_nonfinite(ft.make_train_step(model, loss_fn))
        >>> new, metrics = step(state, (torch.full((2, 4), float("nan")), torch.tensor([0, 1])))
        >>> float(metrics["skipped"]), torch.equal(new.params["bias"], state.params["bias"]), int(new.step)
        (1.0, True, 1)
    """

    inner = as_step(train_step)  # the same step (model, settling forward, ...) around another function

    @functools.wraps(inner.fn)
    def skipping_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        # Never donated=True (jit passes it only to a step that declares it): a skipped step returns the
        # incoming tensors, so the update must not write into them.
        new, metrics = inner.fn(state, batch)
        finite = torch.isfinite(metrics["loss"]).all()
        if "grad_norm" in metrics and getattr(state, "loss_scale", None) is None:
            finite = finite & torch.isfinite(metrics["grad_norm"]).all()
        kept = {
            name: tree.keep_where(finite, getattr(new, name), getattr(state, name))
            for name in ("params", "buffers", "opt_state", "metrics")
            if getattr(new, name, None) is not None
        }
        return new.replace(**kept), {**metrics, "skipped": (~finite).float()}

    return inner.replace(fn=skipping_step)


class SkippedSteps(Callback):
    """Count the steps :func:`skip_nonfinite` skipped, log the total as ``train/skipped_steps``, and raise
    :class:`NonFiniteLossError` once ``max_consecutive`` steps in a row were skipped.

    The counts stay on the device; they are read when the loop logs (``log_steps``), so a run that
    diverged ends at the first logging step after its ``max_consecutive``-th skip in a row, with the
    parameters of its last finite step. ``every_step=True`` reads them after every step (one host sync
    per step) and raises at the skipped step itself. ``max_consecutive=None`` never raises.

    Example:
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> data[:16] = [(torch.full((4,), float("nan")), torch.tensor(0))] * 16  # every batch has a NaN
        >>> try:
        ...     ft.fit(state, skip_nonfinite(step), data, batch_size=16, epochs=1, progress_bar=False,
        ...            callbacks=[SkippedSteps(max_consecutive=4)])
        ... except NonFiniteLossError as error:
        ...     print(type(error).__name__)
        NonFiniteLossError
    """

    def __init__(self, max_consecutive: int | None = 10, *, every_step: bool = False) -> None:
        if max_consecutive is not None and (
            not isinstance(max_consecutive, int) or isinstance(max_consecutive, bool) or max_consecutive < 1
        ):
            raise ValueError(
                f"SkippedSteps: max_consecutive must be an int >= 1 or None, got {max_consecutive!r}"
            )
        self.max_consecutive = max_consecutive
        self.every_step = every_step
        self.total: Any = 0  # as of the last check (a list per member for an ensemble)
        self._saved: dict[str, Any] = {"total": 0, "consecutive": 0}
        self._counts: dict[str, torch.Tensor] | None = None  # total, consecutive, longest: on the device

    def state_dict(self) -> Any:
        if self._counts is None:
            return dict(self._saved)
        return {k: self._counts[k].tolist() for k in ("total", "consecutive")}

    def load_state_dict(self, state: Any) -> None:
        self._saved = {"total": state["total"], "consecutive": state["consecutive"]}
        self.total, self._counts = state["total"], None

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        skipped = ctx.metrics.get("skipped") if ctx.metrics else None
        if not isinstance(skipped, torch.Tensor):
            return state
        skipped = skipped.detach()
        if self._counts is None:
            saved = {
                k: torch.tensor(v, dtype=skipped.dtype, device=skipped.device) for k, v in self._saved.items()
            }
            zero = torch.zeros_like(skipped)
            self._counts = {k: zero + saved[k] for k in ("total", "consecutive")}
            self._counts["longest"] = self._counts["consecutive"].clone()
        c = self._counts
        c["total"] = c["total"] + skipped
        c["consecutive"] = (c["consecutive"] + 1) * skipped
        c["longest"] = torch.maximum(c["longest"], c["consecutive"])
        if self.every_step or ctx.logging_step:
            self._check(ctx)
        return state

    def _check(self, ctx: Context) -> None:
        from functrain.core.member_names import expand_members

        c = self._counts
        assert c is not None
        total, consecutive, longest = (
            torch.stack([c["total"], c["consecutive"], c["longest"]]).cpu().to(torch.int64).tolist()
        )
        members = c["total"].shape[0] if c["total"].ndim == 1 else None
        ctx.history.put_scalars(expand_members({"train/skipped_steps": c["total"]}, members), ctx.step)
        worst = max(longest) if members else longest
        before = sum(self.total) if isinstance(self.total, list) else self.total
        now = sum(total) if members else total
        self.total = total
        c["longest"] = c["consecutive"].clone()  # the next check looks at the runs after this one
        if self.max_consecutive is not None and worst >= self.max_consecutive:
            still = max(consecutive) if members else consecutive
            member = f" (ensemble member {longest.index(worst)})" if members else ""
            if worst == still == 1:
                what = f"training step {ctx.step} (epoch {ctx.epoch}, batch {ctx.batch_index}){member} had"
            else:
                where = (
                    f"steps {ctx.step - still + 1}-{ctx.step}"
                    if still == worst
                    else f"before step {ctx.step}"
                )
                what = f"{worst} training steps in a row{member} ({where}, epoch {ctx.epoch}) had"
            raise NonFiniteLossError(
                f"{what} a non-finite loss or gradients (NaN/inf); their updates were not applied, the state "
                "keeps the parameters of the last finite step. Lower the learning rate, clip gradients "
                "(max_grad_norm), check the data, or allow more such steps (TrainerConfig.nonfinite, "
                "max_consecutive_nonfinite)"
            )
        if now > before:
            warnings.warn(
                f"skipped {now - before} training step(s) with a non-finite loss or gradients (NaN/inf) up to "
                f"step {ctx.step}, {now} in this run so far; their updates were not applied",
                RuntimeWarning,
                stacklevel=2,
            )
