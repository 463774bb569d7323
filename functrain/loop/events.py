"""Callbacks as the loop sees them: one event fired on all of them, the state threaded through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from functrain.callbacks.base import Callback, Context

__all__ = ["Events", "callback_names"]


class Events:
    """Fires one event on every callback, threading the state through and checking what comes back."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def __call__(self, event: str, state: Any, ctx: Context) -> Any:
        for cb in self.callbacks:
            new = getattr(cb, f"on_{event}")(state, ctx)
            if type(new) is not type(state):
                raise TypeError(
                    f"callback {type(cb).__name__}.on_{event} returned {type(new).__name__}; a callback must "
                    f"return the state ({type(state).__name__}), unchanged or new"
                )
            state = new
        return state


def callback_names(callbacks: Sequence[Callback]) -> list[str]:
    """Each callback's name in a checkpoint: its ``name`` (or class name), numbered when repeated."""
    names: list[str] = []
    for cb in callbacks:
        base = cb.name or type(cb).__name__
        name, i = base, 1
        while name in names:
            i += 1
            name = f"{base}_{i}"
        names.append(name)
    return names
