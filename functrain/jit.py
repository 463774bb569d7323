"""`jit`: compile a pure step into one graph, seed its randomness, count compilations, donate buffers.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> state = ft.TrainState.create(model, ft.optim.adam(1e-3))
    >>> step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)))
    >>> step  # compiles on its first call
    CompiledStep(train_step, compiled, donate=False, compiles=0)
    >>> # an inductor compile: 15-20 s with cold caches on a 2-core CPU
    >>> state, metrics = step(state, (torch.randn(8, 4), torch.randint(0, 2, (8,))))  # doctest: +SKIP
    >>> step.num_compiles  # doctest: +SKIP
    1
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch

from functrain import random
from functrain.compile import compile_times, interrupt, wrappers
from functrain.compile.backend import TORCH_WORKAROUNDS, TorchWorkaround, compile_graph, torch_version
from functrain.compile.cache import CACHE_SUFFIX, PortableCache
from functrain.compile.cache_hits import MISS, CacheHits
from functrain.compile.guards import skip_library_guards
from functrain.compile.traceable import traceable
from functrain.distributed.env import rank as distributed_rank
from functrain.remat import RematRandomnessError
from functrain.step import Step, as_step, refuse_plain_state

__all__ = ["CompiledStep", "DonatedStateError", "GraphBreakError", "RecompileError", "jit"]
# The compile internals live in functrain.compile; these names stay importable from here (the torch
# version workarounds are read as functrain.jit.TORCH_WORKAROUNDS).
_REEXPORTED = (CACHE_SUFFIX, TORCH_WORKAROUNDS, TorchWorkaround, torch_version)

log = logging.getLogger(__name__)

# A compile that takes longer than this is logged (INFO for the first, WARNING with its cause for a
# recompilation).
SLOW_COMPILE_SECONDS = 5.0


class RecompileError(RuntimeError):
    """A compiled step compiled more often than its ``max_compiles``; the message names the cause."""


class GraphBreakError(RuntimeError):
    """The step cannot be captured as one graph under ``fullgraph=True``; the message says why."""


class DonatedStateError(RuntimeError):
    """A state was passed to a donating step after an earlier call had consumed it."""


def _seed_generators(seed: int, device: torch.device | None) -> None:
    """Seed the CPU generator and the generators of ``device``'s type (the ones the step draws from).

    Not ``torch.manual_seed``: on a build with CUDA/XPU/MTIA support it also queues a lazy seeding call
    for each of those backends, formatting a Python stack trace each time; that cost 0.5-2 ms per step
    on a CPU-only machine, a third of a small model's step.
    """
    torch.default_generator.manual_seed(seed)
    if device is not None and device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "manual_seed_all"):
            backend.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)


class CompiledStep:
    """A step function wrapped by :func:`jit`. Call it like the step: ``step(state, *args)``.

    Attributes:
        step: the :class:`functrain.step.Step` it runs (a plain function as a ``"custom"`` one); its fields
            (model, settle, kind) are read when the step is called.
        num_compiles: graphs compiled so far (1 after the first call at a fixed shape).
        compile_reasons: for each recompilation, the guard that failed (what changed).
        compile_seconds: wall time of the calls that compiled, summed (0.0 before the first call).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        compile: bool = True,
        donate: bool = False,
        fullgraph: bool = True,
        dynamic: bool | None = False,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        max_compiles: int = 8,
        on_max_compiles: Literal["raise", "warn"] = "raise",
        seed: bool = True,
        rank: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if on_max_compiles not in ("raise", "warn"):
            raise ValueError(f"on_max_compiles must be 'raise' or 'warn', got {on_max_compiles!r}")
        self.fn = fn
        self._step = as_step(fn)
        self.compile = compile
        self.donate = donate
        self.max_compiles = max_compiles
        self.on_max_compiles = on_max_compiles
        self.seed = seed
        self.rank = rank
        self.num_compiles = 0
        self.compile_reasons: list[str] = []
        self.compile_seconds = 0.0
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self._donated: weakref.WeakSet[Any] = weakref.WeakSet()
        self._warned = False
        pure = self._step.fn  # what dynamo traces: the step's own function (donated=True where it takes it)
        functools.update_wrapper(self, pure, updated=())
        self._pure = pure
        # The eager path (and the eager run that explains a trace's error) keeps the state's layouts.
        self._eager = wrappers.with_own_code(
            wrappers.donating(pure) if donate else wrappers.keeping_layouts(pure)
        )
        self._lookup_in_traceable = False
        self._settled = not compile  # the step's settling forward runs before the first trace
        self._cache = PortableCache(self.cache_dir, self.__name__) if self.cache_dir is not None else None
        self._options = {"fullgraph": fullgraph, "dynamic": dynamic, "mode": mode, "options": options}
        # Whether the traced step copies outputs into the strides of the state's tensors (decided at the
        # first compiled call: only where the state has a permuted layout, or after a graph's outputs
        # drifted from its inputs' strides): the per-leaf check costs dynamo ~40% of a step's trace.
        self._layouts_in_graph: bool | None = True if donate or not compile else None
        self._target = self._eager
        self._torch_compile: Callable[..., Any] | None = None
        if compile:
            # Imported here, not at module level: a step that never compiles (the eager tier of
            # compile: auto) never loads dynamo nor inductor (~2 s of CPU).
            import torch._dynamo
            import torch._inductor

            config = dict(torch._inductor.list_mode_options(mode)) if mode else {}
            config.update(options or {})
            # The caller's own filter replaces jit's.
            guard_filter = config.pop("guard_filter_fn", skip_library_guards)
            backend = functools.partial(self._backend, config=config)

            def torch_compile(target: Callable[..., Any]) -> Callable[..., Any]:
                return torch.compile(  # a new options dict each time: torch.compile pops from it
                    target,
                    fullgraph=fullgraph,
                    dynamic=dynamic,
                    backend=backend,
                    options={"guard_filter_fn": guard_filter},
                )

            self._torch_compile = torch_compile
        self._use_target(self._eager, enabled=compile and fullgraph)

    def _use_target(self, target: Callable[..., Any], *, enabled: bool) -> None:
        """Compile ``target`` from now on (a new code object: its own graphs and guards)."""
        self._target = target
        # After the first compile, calls whose inputs pass a cached graph's guards skip dynamo's frame
        # evaluation (functrain.compile.cache_hits): ~0.1 ms less host time per call.
        # After a graph break the cached code calls resume functions that only dynamo's frame
        # evaluation compiles: direct calls need the one graph of fullgraph=True.
        self._cache_hits = CacheHits(target, enabled=enabled)
        self._compiled = self._torch_compile(target) if self._torch_compile is not None else target

    def _choose_layout_handling(self, state: Any) -> None:
        """Before the first trace: keep layouts inside the graph only for a state with permuted ones."""
        self._layouts_in_graph = wrappers.has_permuted_layout(state)
        if not self._layouts_in_graph:
            target = wrappers.with_own_code(wrappers.passing_through(self._pure))
            self._use_target(target, enabled=self._cache_hits.enabled)

    def _check_layouts(self, state: Any, out: Any) -> Any:
        """After a compile without the in-graph layout copy: if the graph's state came back in other strides
        than it went in, restore them here (once) and compile the layout-keeping step from the next call."""
        restored = wrappers.restore_layouts(state, out)
        if restored is not out:
            log.info(
                "%s: the compiled step returned state tensors in other strides than it was given; "
                "compiling the layout-keeping step (one more compile)", self.__name__,
            )  # fmt: skip
            self._layouts_in_graph = True
            self._use_target(self._eager, enabled=self._cache_hits.enabled)
        return restored

    @property
    def step(self) -> Step:
        """The step this compiles (:class:`functrain.step.Step`)."""
        return self._step

    # The counting backend: every graph the step compiles passes through here.
    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any], *, config: dict[str, Any]) -> Any:
        count = self.num_compiles + 1
        reason = self._last_guard_failure() if count > 1 else None
        if count > self.max_compiles:
            msg = (
                f"{self.__name__}: compiled {count} times (max_compiles={self.max_compiles}). "
                f"Last cause: {reason or 'unknown'}. A Python "
                "number that changes between calls (keep it a 0-d tensor in the state), a batch whose shape "
                "changes (pad it, drop_last=True, or jit(..., dynamic=True)) or a new state structure each "
                "trigger a recompilation."
            )
            if self.on_max_compiles == "raise":
                self.num_compiles = count  # the refused compile is counted, with its cause
                self.compile_reasons.append(reason or "unknown")
                raise RecompileError(msg)
            if not self._warned:
                warnings.warn(msg, stacklevel=2)
                self._warned = True
        # Dynamo may restart its analysis from inside the backend (TensorifyScalarRestartAnalysis, when
        # a Python float it traced symbolically is turned into a tensor; seen with a cold inductor
        # cache) and call the backend again for the same compile: count only a graph that compiled.
        compiled = compile_graph(gm, example_inputs, config)
        interrupt.compiled()  # the graph runs next: a signal no longer abandons the step
        self.num_compiles = count
        if reason is not None:
            self.compile_reasons.append(reason)
        return compiled

    def _last_guard_failure(self) -> str:
        from torch._dynamo.utils import guard_failures

        code = getattr(self._target, "__code__", None)
        reasons = guard_failures.get(code) if code is not None else None
        if not reasons:
            return "unknown (set TORCH_LOGS=recompiles for details)"
        return " ".join(str(reasons[-1]).split())[:500]

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        # The one dispatcher: seed, then exactly one of three ways to run the step.
        if self._step.kind != "custom":
            refuse_plain_state(state, self.__name__)  # before dynamo traces a dict's missing .params
        if self.donate and state in self._donated:
            raise DonatedStateError(
                f"{self.__name__}: this state was donated to an earlier call, which wrote its results "
                "into the state's tensors; use the state that call returned (or jit(..., donate=False))"
            )
        if self.seed and hasattr(state, "rng"):
            rank = self.rank if self.rank is not None else distributed_rank()
            _seed_generators(random.step_seed(state.rng, state.step, rank), wrappers.device_of(state))
        if not self.compile:  # the model's torch.utils.checkpoint routed (torch.func.grad)
            with traceable(self._step.model, compiled=False):
                out = self._eager(state, *args, **kwargs)
        else:
            out = self._cached_graph(state, args, kwargs) if self.num_compiles else MISS
            if out is MISS:
                out = self._through_dynamo(state, args, kwargs)
        if self.donate:
            self._donated.add(state)
        return out

    def _cached_graph(self, state: Any, args: tuple, kwargs: dict) -> Any:
        """The compiled graph whose guards accept the call, run directly; ``MISS`` when none does.

        The lookup runs outside ``traceable`` (its patches matter only while dynamo traces), unless the
        graph guards one of them (a model that calls torch.utils.checkpoint, an RNN): then a lookup
        outside missed while dynamo's own lookup inside found the graph without compiling.
        """
        model = self._step.model
        with traceable(model, compiled=True) if self._lookup_in_traceable else contextlib.nullcontext():
            return self._cache_hits.call(state, args, kwargs)

    def _through_dynamo(self, state: Any, args: tuple, kwargs: dict) -> Any:
        """Call the step through ``torch.compile``, compiling if dynamo has to."""
        import torch._dynamo  # loaded by __init__ already (compile=True): a dict lookup

        if not self._settled:  # before the first trace, once it ran (its error is the user's, eager)
            settle = _settling_forward(self._step)
            if settle is not None:
                wrappers.settle_eagerly(settle, self.__name__, state, args, kwargs)
            self._settled = True
        if self._layouts_in_graph is None:
            self._choose_layout_handling(state)
        compiles, model = self.num_compiles, self._step.model
        # Cache misses are only read to decide whether to write a cache file.
        misses = self._cache.before_call(first=compiles == 0) if self._cache is not None else 0
        call = (state, args, kwargs)
        key = compile_times.announce(self.__name__, model, call, self._options) if not compiles else None
        # Dynamo stops compiling (and silently runs eagerly) after ``recompile_limit`` compiles; lift it
        # so that max_compiles decides. Set and restored by hand: config.patch costs ~5x more per call.
        dynamo_config = torch._dynamo.config
        limit, needed = dynamo_config.recompile_limit, max(64, self.max_compiles + 1)
        if limit < needed:
            dynamo_config.recompile_limit = needed
        started = time.perf_counter()
        try:
            # The model's torch.utils.checkpoint, RNNs and log calls, made traceable
            # (functrain.compile.traceable); Ctrl-C ends a compile at once (functrain.compile.interrupt).
            # A call that may run an existing graph on donated inputs is never abandoned.
            abandonable = not self.donate or compiles == 0
            with traceable(model, compiled=True), interrupt.compiling(abandonable=abandonable):
                out = self._compiled(state, *args, **kwargs)
        except RecompileError:
            raise
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = e.__cause__ or getattr(e, "inner_exception", None)
            if isinstance(inner, (RecompileError, RematRandomnessError)):
                raise inner from None
            raise
        except torch._dynamo.exc.Unsupported as e:
            error = self._explain(e, state, args, kwargs)
            if isinstance(error, GraphBreakError):
                raise error from e
            raise error from None  # the step's own error, run eagerly: its traceback, not dynamo's
        except interrupt.CompileInterrupted as e:
            # A handler that finishes the current step before stopping (functrain.callbacks.Preemption)
            # abandoned the compile: this step runs eagerly.
            log.warning("%s: compile interrupted by %s; this step runs eagerly", self.__name__, e)
            with traceable(model, compiled=False):
                return self._eager(state, *args, **kwargs)
        finally:
            if limit < needed:
                dynamo_config.recompile_limit = limit
        if self.num_compiles != compiles:
            interrupt.close_compile_workers()  # inductor's workers live only while it compiles
            self._compiled_in(time.perf_counter() - started, misses, key)
            if not self._layouts_in_graph:
                out = self._check_layouts(state, out)
        elif compiles and self._cache_hits.missed_on_guards:
            self._lookup_in_traceable = True
        return out

    def _compiled_in(self, seconds: float, misses_before: int, key: str | None) -> None:
        """Account for a call that compiled: time, log line, compile-time record, portable cache file."""
        self.compile_seconds += seconds
        if key is not None:
            compile_times.record(key, seconds)
        if self.num_compiles > 1:
            log.warning(
                "%s: recompiled (compile %d of at most %d) in %.1f s because %s",
                self.__name__, self.num_compiles, self.max_compiles, seconds,
                self.compile_reasons[-1] if self.compile_reasons else "unknown",
            )  # fmt: skip
        elif seconds >= SLOW_COMPILE_SECONDS:
            log.info(
                "%s: compiled in %.1f s%s", self.__name__, seconds,
                "" if self.cache_dir else " (jit(..., cache_dir=...) makes the next process start warm)",
            )  # fmt: skip
        if self._cache is not None:
            self._cache.after_compile(misses_before)

    def _explain(self, error: Exception, state: Any, args: tuple, kwargs: dict) -> Exception:
        # Dynamo reports a Python exception raised while tracing as "Unsupported: Observed exception".
        # Running the step eagerly once recovers the real error (with functrain's own message); if the
        # eager run succeeds, the step really is not capturable as one graph.
        try:
            self._eager(state, *args, **kwargs)
        except Exception as eager_error:
            return eager_error
        first = str(error).strip().splitlines()
        return GraphBreakError(
            f"{self.__name__} cannot be compiled as one graph (fullgraph=True): "
            + " ".join(line.strip() for line in first[:6])
            + ". Remove the construct named above from the step (print, .item(), data-dependent Python "
            "control flow, unsupported calls), or debug with jit(..., compile=False)."
        )

    def __repr__(self) -> str:
        how = "compiled" if self.compile else "eager"
        return f"CompiledStep({self.__name__}, {how}, donate={self.donate}, compiles={self.num_compiles})"


def _settling_forward(step: Step) -> Callable[..., Any] | None:
    """What runs a step's model once eagerly before its first trace: a train step's ``settle`` (its loss
    function's forward, without gradients); an eval or predict step of a module is a forward itself."""
    if step.settle is None and step.kind in ("eval", "predict") and isinstance(step.model, torch.nn.Module):
        return step.fn
    return step.settle


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    compile: bool = True,
    donate: bool = False,
    fullgraph: bool = True,
    dynamic: bool | None = False,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    max_compiles: int = 8,
    on_max_compiles: Literal["raise", "warn"] = "raise",
    seed: bool = True,
    rank: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Compile a pure step ``fn(state, *args)`` with ``torch.compile(fullgraph=True)``.

    Before each call the global generator is seeded from ``(state.rng, state.step, rank)``, so dropout
    is reproducible: the same state and batch give the same result, and a resumed run continues the
    same random sequence. (Compiled and eager steps draw different masks from the same seed.)

    After the first compile, a call that a compiled graph's guards accept runs that graph directly,
    without dynamo's frame evaluation (:mod:`functrain.compile.cache_hits`); any other call goes through
    ``torch.compile``, which recompiles as usual. Dynamo's guards on library globals (functrain's
    modules, torch's functorch and pytree internals) are skipped; the globals of your own modules stay
    guarded, so changing one recompiles the step.

    Args:
        compile: ``False`` runs the step eagerly (debugging) with the same seeding and donation.
        donate: write the new state into the incoming state's tensors, as JAX's ``donate_argnums``:
            about half the peak memory of a pure step. The incoming state must not be used again; passing
            it again raises :class:`DonatedStateError`.
            A pure step (the default) returns new tensors with the strides of the ones they replace
            (channels_last weights and their optimizer moments stay channels_last), copying only where
            the computed layout differs.
        fullgraph: require one graph (default); a graph break raises :class:`GraphBreakError`.
        dynamic: passed to ``torch.compile`` (``False``: specialise on shapes, the fastest kernels).
        mode, options: inductor mode (``"max-autotune"``, ...) and config options. On the CPU, jit
            turns inductor's ``layout_optimization`` off unless ``options`` sets it (channels-last
            layout copies around convolutions made a BatchNorm CNN's step 30% slower), and draws
            dropout masks as float32 ``rand < p`` (half the cost of ATen's ``bernoulli_``) unless
            ``options`` sets ``fallback_random`` (``True``: exactly eager's masks), and runs one C++
            compiler per core that other processes leave idle unless ``options`` sets ``compile_threads``
            (:mod:`functrain.compile.workers`).
            On the torch versions named in :data:`TORCH_WORKAROUNDS`, jit also sets the inductor
            options listed there (e.g. ``loop_ordering_after_fusion=False`` on torch 2.10-2.11),
            again unless ``options`` sets them.
            ``options={"guard_filter_fn": f}`` is dynamo's, not inductor's: ``f`` replaces jit's
            library-globals filter (``torch.compiler.skip_guard_on_globals_unsafe`` and its siblings
            are such filters).
        max_compiles: compilations allowed before :class:`RecompileError` (or a warning); the error names
            the guard that failed.
        seed: seed the step's randomness from the state (on by default).
        rank: the process rank folded into the seed (default: ``torch.distributed`` rank or 0).
        cache_dir: a directory for torch's portable compile cache (one file per step, written after a
            compile that missed the local caches, loaded before the first compile): a new process, or
            a run resumed on another machine of the same kind (same torch, CPU/GPU, compiler), starts
            warm. The files are torch's pickled cache entries: use a directory only your runs write.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> train_step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> jit(train_step, donate=True)  # compiled on its first call
        CompiledStep(train_step, compiled, donate=True, compiles=0)
        >>> debug_step = jit(train_step, compile=False, donate=True)  # eager (debugging), same donation
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
        >>> new_state, metrics = debug_step(state, batch)
        >>> int(new_state.step), debug_step.num_compiles
        (1, 0)
        >>> new_state.params["weight"] is state.params["weight"]  # donated: written into its tensors
        True
        >>> debug_step(state, batch)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        functrain.jit.DonatedStateError: train_step: this state was donated to an earlier call, ...
    """
    kwargs = dict(
        compile=compile,
        donate=donate,
        fullgraph=fullgraph,
        dynamic=dynamic,
        mode=mode,
        options=options,
        max_compiles=max_compiles,
        on_max_compiles=on_max_compiles,
        seed=seed,
        rank=rank,
        cache_dir=cache_dir,
    )
    if fn is None:
        return lambda f: CompiledStep(f, **kwargs)
    return CompiledStep(fn, **kwargs)
