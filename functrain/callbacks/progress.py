"""Progress reporting: a tqdm progress bar (terminal and notebook) and a print-every-N alternative."""

from __future__ import annotations

from typing import Any

from functrain.callbacks.base import Callback, Context

__all__ = ["PrintMetrics", "ProgressBar"]


def _format(logs: dict[str, float], keys: list[str] | None = None) -> str:
    items = [(k, v) for k, v in logs.items() if keys is None or k in keys]
    return "  ".join(f"{k}={v:.4g}" for k, v in items)


def _shown_by_default(key: str) -> bool:
    """Losses and eval metrics; for an ensemble the members' mean and best, not each member."""
    if "/member_" in key or key.endswith("/worst"):
        return False
    return key.endswith(("loss", "loss/best")) or key.startswith("eval/")


class ProgressBar(Callback):
    """A ``tqdm.auto`` progress bar over optimizer steps, showing the latest logged loss and metrics.

    The bar only shows values the loop has already logged, so it never syncs the device itself. It says
    which tier runs the steps (``ctx.tier``: "eager", "inductor") and, during a step that waits for a
    compile (``ctx.compiling``), "inductor: compiling" (functrain.jit logs the start, with the last
    compile's time on this machine). The compile's time counts in neither the bar's rate nor its ETA.
    A step that is not functrain's (``ctx.tier == ""``) is "compiling" until the run's first step
    returns, while nothing has compiled yet (``ctx.compiles == 0``).

    Example:
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> result = ft.fit(state, step, data, batch_size=16, epochs=1, callbacks=[ProgressBar(leave=False)])
        >>> int(result.state.step)  # the bar (on stderr) counted these
        4
    """

    def __init__(self, *, leave: bool = True, keys: list[str] | None = None) -> None:
        self.leave = leave
        self.keys = keys
        self._bar: Any = None
        self._shown: dict[str, float] = {}
        self._compiling = False

    def on_train_begin(self, state: Any, ctx: Context) -> Any:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=ctx.max_steps, initial=ctx.step, leave=self.leave, unit="step", dynamic_ncols=True
        )
        # a step that is not functrain's compiles on its first call: say so until it returns
        self._compiling = not ctx.tier and ctx.compiles == 0
        if self._compiling:
            self._bar.set_description_str("compiling", refresh=True)
        elif ctx.tier:
            self._bar.set_description_str(ctx.tier, refresh=True)
        return state

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        if self._bar is not None:
            if self._compiling:
                self._compiling = False
                self._bar.unpause()  # the compile's time is not the steps': out of the rate and the ETA
                self._bar.set_description_str(ctx.tier, refresh=False)
            self._bar.update(1)
        return state

    def _refresh(self, ctx: Context) -> None:
        if self._bar is not None and ctx.logs and ctx.logs != self._shown:
            self._shown = dict(ctx.logs)
            keys = self.keys or [k for k in ctx.logs if _shown_by_default(k)][:6]
            self._bar.set_postfix_str(_format(ctx.logs, keys), refresh=False)

    def on_epoch_end(self, state: Any, ctx: Context) -> Any:
        self._refresh(ctx)
        return state

    def on_eval_end(self, state: Any, ctx: Context) -> Any:
        self._refresh(ctx)
        return state

    def on_step_begin(self, state: Any, ctx: Context) -> Any:
        if self._bar is not None and ctx.tier:
            if ctx.compiling:
                self._compiling = True
                self._bar.set_description_str(f"{ctx.tier}: compiling", refresh=True)
            elif self._bar.desc != ctx.tier:
                self._bar.set_description_str(ctx.tier, refresh=False)
        self._refresh(ctx)
        return state

    def on_train_end(self, state: Any, ctx: Context) -> Any:
        if self._bar is not None:
            self._refresh(ctx)
            self._bar.close()
            self._bar = None
        return state


class PrintMetrics(Callback):
    """Print the logged values every ``every`` steps (Towhee's ``print_steps``) and after evaluations.

    Example:
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> result = ft.fit(state, step, data, batch_size=16, epochs=1, log_steps=2, progress_bar=False,
        ...                 callbacks=[PrintMetrics(every=2)])  # doctest: +ELLIPSIS
        step 2  epoch 0  train/grad_norm=...  train/loss=...
        done at step 4  train/grad_norm=...  train/loss=...
    """

    def __init__(self, every: int = 50, print_fn: Any = print) -> None:
        if every < 1:
            raise ValueError(f"PrintMetrics: every must be >= 1, got {every}")
        self.every = every
        self.print_fn = print_fn
        self._last = -1

    def on_step_begin(self, state: Any, ctx: Context) -> Any:
        # Logged values of the previous step are ready once the loop has written them.
        if ctx.step and ctx.step % self.every == 0 and ctx.step != self._last and ctx.logs:
            self._last = ctx.step
            self.print_fn(f"step {ctx.step}  epoch {ctx.epoch}  {_format(ctx.logs)}")
        return state

    def on_eval_end(self, state: Any, ctx: Context) -> Any:
        self.print_fn(f"step {ctx.step}  eval  {_format(ctx.eval_metrics or {})}")
        return state

    def on_train_end(self, state: Any, ctx: Context) -> Any:
        self.print_fn(f"done at step {ctx.step}  {_format(ctx.logs)}")
        return state
