"""Call a compiled step's cached code directly when dynamo's guards for it pass.

Every call of a ``torch.compile``'d function goes through dynamo's frame evaluation: a Python wrapper
(``_TorchDynamoContext``: eval-frame callback swaps, functorch layer-stack bookkeeping), then in C the
cache lookup (each cache entry's guards) and the call of the entry's transformed bytecode, which reads
the tensors out of the arguments, calls the compiled graph and rebuilds the outputs. For a small train
step the wrapper costs ~0.09 ms per call here (benchmarks/README.md, "Per-call overhead").

:class:`CacheHits` does that lookup itself: the same entries, in the order dynamo keeps them, with the
same guard managers (one C++ call each; they include the global state: grad mode, autocast, default
dtype, deterministic algorithms), skipping entries dynamo has invalidated; then it calls the winning
entry's code as a function with the original function's globals and closure, inside the profiler
range dynamo records for it. When no entry accepts the call (a new shape, dtype or structure, a
changed global state, ``torch._dynamo.reset()``) it returns ``None`` and the caller goes through
``torch.compile``, which recompiles exactly as it would have. It also steps aside while dynamo is
tracing (a step called inside another compiled function) and under any stance but the default
(``torch.compiler.set_stance("force_eager")`` still runs eagerly).

Only for functions compiled with ``fullgraph=True``: after a graph break the transformed code calls
resume functions that dynamo compiles (or finds) only while its frame callback is set, which a direct
call does not do.

The cache entries are dynamo's private API (``torch._C._dynamo.eval_frame._debug_get_cache_entry_list``,
present in every supported torch, 2.10-2.13): if it is missing or behaves differently the lookup turns
itself off for good, with a warning, and every call takes ``torch.compile``'s path.
tests/test_cache_hits.py checks that the direct path is taken on each supported torch, so a torch that
drops it fails a test, not a user.

Example (dynamo's ``"eager"`` backend: guards and cache entries without an inductor build):
    >>> from functrain.compile.wrappers import passing_through
    >>> step = passing_through(lambda state, batch: state * 2 + batch)  # a (state, *args, **kwargs) frame
    >>> compiled = torch.compile(step, fullgraph=True, backend="eager")
    >>> hits = CacheHits(step)  # the function given to torch.compile
    >>> state, batch = torch.ones(3), torch.zeros(3)
    >>> hits.call(state, (batch,), {}) is MISS  # nothing compiled yet: go through torch.compile
    True
    >>> compiled(state, batch)
    tensor([2., 2., 2.])
    >>> hits.call(state, (batch,), {}), hits.calls  # the cached code, called directly
    (tensor([2., 2., 2.]), 1)
    >>> hits.call(state.double(), (batch,), {}) is MISS, hits.missed_on_guards  # a dtype no guard accepts
    (True, True)
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MISS", "CacheHits", "with_code"]

log = logging.getLogger(__name__)

try:  # dynamo's cache entries (private)
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as _cache_entries
except ImportError:  # pragma: no cover - every supported torch has it
    _cache_entries = None


def _stance() -> str:
    """dynamo's current stance (``torch.compiler.set_stance``); ``"default"`` when unknown."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return getattr(stance, "stance", "default")


def _takes_state_args_kwargs(code: types.CodeType) -> bool:
    """Whether ``code`` is a ``(state, *args, **kwargs)`` function (the frames :meth:`CacheHits.lookup`
    knows how to bind)."""
    flags = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    return (
        code.co_argcount == 1
        and code.co_kwonlyargcount == 0
        and code.co_flags & flags == flags
        and code.co_varnames[:3] == ("state", "args", "kwargs")
    )


MISS = object()
"""What :meth:`CacheHits.call` returns when no cached graph accepts the call."""


def with_code(fn: Callable[..., Any], code: types.CodeType) -> Callable[..., Any]:
    """A function running ``code`` with ``fn``'s globals, closure and defaults (named like ``fn``)."""
    function = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    function.__kwdefaults__ = fn.__kwdefaults__
    return function


class CacheHits:
    """Direct calls of ``fn``'s dynamo cache entries (``fn``: a ``(state, *args, **kwargs)`` function
    given to ``torch.compile``). See the module docstring.

    Attributes:
        enabled: whether lookups are made (``enabled=False``, or dynamo's private API missing or
            misbehaved).
        calls: how many calls ran a cached graph (for tests and benchmarks).
        missed_on_guards: whether the last call missed because no live entry's guards passed (not
            because lookups are off, dynamo is tracing, or the stance is not the default).
    """

    def __init__(self, fn: Callable[..., Any], *, enabled: bool = True) -> None:
        code = getattr(fn, "__code__", None)
        self.fn = fn
        self.enabled = (
            enabled and _cache_entries is not None and code is not None and _takes_state_args_kwargs(code)
        )
        self.calls = 0
        self.missed_on_guards = False
        self._functions: dict[types.CodeType, Callable[..., Any]] = {}

    def call(self, state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(state, *args, **kwargs)`` run by the cached graph whose guards accept it, or :data:`MISS`
        (go through ``torch.compile``: no entry accepts it, dynamo is tracing, or a non-default stance)."""
        function, annotation = self._lookup(state, args, kwargs)
        if function is None:
            return MISS
        self.calls += 1
        if torch.autograd.profiler._is_profiler_enabled:  # the range dynamo's own call records
            with torch.profiler.record_function(annotation):
                return function(state, *args, **kwargs)
        return function(state, *args, **kwargs)

    def _lookup(self, state: Any, args: tuple, kwargs: dict) -> tuple[Callable[..., Any] | None, str]:
        self.missed_on_guards = False
        if not self.enabled or torch.compiler.is_dynamo_compiling() or _stance() != "default":
            return None, ""
        fn = self.fn
        try:
            entries = _cache_entries(fn.__code__)
            if not entries:
                return None, ""
            # The frame's locals as dynamo's guards see them: arguments by name, closure cells' contents.
            f_locals = {"state": state, "args": args, "kwargs": kwargs}
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                f_locals[name] = cell.cell_contents
            for entry in entries:
                # An entry dynamo invalidated (an object its guards watched was freed) keeps its place,
                # without code.
                if entry.code is not None and entry.guard_manager.check(f_locals):
                    return self._function(entry.code, len(entries)), entry.trace_annotation
            self.missed_on_guards = True
        except Exception as e:  # dynamo's private API changed: use torch.compile's path from now on
            self.enabled = False
            log.warning("functrain.compile.cache_hits: direct calls off (%s: %s)", type(e).__name__, e)
        return None, ""

    def _function(self, code: types.CodeType, live_entries: int) -> Callable[..., Any]:
        function = self._functions.get(code)
        if function is None:
            if len(self._functions) > 2 * live_entries + 8:  # entries dropped by recompiles and resets
                self._functions.clear()
            function = self._functions[code] = with_code(self.fn, code)
        return function
