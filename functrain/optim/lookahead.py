"""Lookahead (Zhang et al. 2019, "k steps forward, 1 step back") as a wrapper of any optimizer.

The fast optimizer updates the params (the state's, what the step differentiates) every step; every
``sync_period`` steps the slow params move ``slow_step_size`` of the way to the fast ones,
``slow += slow_step_size * (fast - slow)``, and the fast params restart from them. That is optax's
``lookahead`` with one difference of form: optax's params are a ``LookaheadParams(fast, slow)`` pair,
here the params are the fast ones and the slow ones live in the optimizer state (``state.slow``, the
weights to evaluate with, as optax advises), so the model, the step and the checkpoint stay as they are.
The update is optax's, merged into one step without a branch::

    diff = fast + u - slow
    slow_new = slow + slow_step_size * sync * diff
    update = u - sync * (1 - slow_step_size) * diff       # sync: 1 on every sync_period-th step

Example:
    >>> import torch
    >>> from functrain import optim
    >>> tx = lookahead(optim.sgd(1.0), sync_period=2, slow_step_size=0.5)
    >>> params = {"w": torch.zeros(1)}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...     updates, state = tx.update({"w": torch.ones(1)}, state, params)
    ...     params = optim.apply_updates(params, updates)
    >>> params["w"], state.slow["w"]  # fast went to -2, slow half-way: -1, fast restarts there
    (tensor([-1.]), tensor([-1.]))
"""

from __future__ import annotations

from typing import Any

import torch

from functrain import tree
from functrain.optim._leaves import check_range, zero_count
from functrain.optim.base import GradientTransformation, NormFn, OptState, update_with_norm
from functrain.tree import PyTree

__all__ = ["LookaheadState", "lookahead"]


@tree.struct
class LookaheadState:
    """State of :func:`lookahead`: the fast optimizer's state, the steps since the last sync (0-d int64)
    and the slow params."""

    fast_state: OptState
    steps_since_sync: torch.Tensor
    slow: PyTree


def lookahead(
    fast_optimizer: GradientTransformation, sync_period: int, slow_step_size: float, reset_state: bool = False
) -> GradientTransformation:
    """Lookahead around ``fast_optimizer``: every ``sync_period`` steps the slow params (``state.slow``)
    move ``slow_step_size`` towards the fast ones and the fast ones restart there; ``reset_state``
    re-initialises the fast optimizer's state at each sync (optax's argument).

    Example:
        >>> from functrain import optim
        >>> tx = lookahead(optim.adam(1e-3), sync_period=5, slow_step_size=0.5)
        >>> sorted(tx.init({"w": torch.zeros(2)}).slow)
        ['w']
    """
    if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period < 1:
        raise ValueError(f"lookahead: sync_period must be an int >= 1, got {sync_period!r}")
    alpha = check_range("lookahead", "slow_step_size", slow_step_size, 0.0, 1.0, high_open=False)

    def init(params: PyTree) -> LookaheadState:
        return LookaheadState(
            fast_state=fast_optimizer.init(params),
            steps_since_sync=zero_count(params),
            # a copy: a donating step writes the new params into the old ones' tensors
            slow=tree.map(torch.clone, params),
        )

    def update(
        updates: PyTree, state: LookaheadState, params: PyTree | None = None, *, norm: NormFn | None = None
    ) -> tuple[PyTree, LookaheadState]:
        if params is None:
            raise ValueError("lookahead: update needs the (fast) params: tx.update(grads, state, params)")
        updates, fast_state = update_with_norm(fast_optimizer, updates, state.fast_state, params, norm)
        sync = state.steps_since_sync == sync_period - 1

        def merged(u: torch.Tensor, fast: torch.Tensor, slow: torch.Tensor) -> tuple[Any, Any]:
            on = sync.to(u.dtype)
            diff = fast + u - slow
            return u - on * (1 - alpha) * diff, slow + alpha * on * diff

        pairs = tree.map(merged, updates, params, state.slow)
        new_updates = tree.map(lambda _, pair: pair[0], updates, pairs)
        slow = tree.map(lambda _, pair: pair[1], updates, pairs)
        if reset_state:
            fast_state = tree.keep_where(sync, fast_optimizer.init(params), fast_state)
        steps = torch.remainder(state.steps_since_sync + 1, sync_period)
        return new_updates, LookaheadState(fast_state=fast_state, steps_since_sync=steps, slow=slow)

    return GradientTransformation(init, update)
