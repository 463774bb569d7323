"""`jit`: compile a pure step into one graph, seed its randomness, count compilations, donate buffers.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> state = ft.TrainState.create(model, ft.optim.adam(1e-3))
    >>> step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)))
    >>> state, metrics = step(state, (torch.randn(8, 4), torch.randint(0, 2, (8,))))  # compiles once
    >>> step.num_compiles
    1
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch._dynamo
import torch.utils._pytree as torch_pytree

from functrain import _compile_times, random, tree
from functrain import _foreach as foreach
from functrain._isa_probe import vec_isa_verified
from functrain.cache_hits import MISS, CacheHits, with_code
from functrain.distributed.env import rank as distributed_rank
from functrain.remat import RematRandomnessError
from functrain.traceable import traceable

__all__ = ["CompiledStep", "DonatedStateError", "GraphBreakError", "RecompileError", "jit"]

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


def _device_of(state: Any) -> torch.device | None:
    params = getattr(state, "params", None)
    if isinstance(params, dict):
        for x in params.values():
            if isinstance(x, torch.Tensor):
                return x.device
    return None


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


@dataclasses.dataclass(frozen=True)
class TorchWorkaround:
    """A workaround for a bug of some torch versions: which versions, what broke, when to remove it.

    ``options`` are inductor config patches that :func:`jit` applies on those versions (an explicit
    ``options=`` entry still wins); an entry without options records a workaround made in code
    (``where``).
    """

    first: tuple[int, int]
    last: tuple[int, int]
    symptom: str
    remove: str
    where: str = "functrain.jit"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def applies(self, version: tuple[int, int]) -> bool:
        return self.first <= version <= self.last


# Every version-specific workaround in functrain, in one place. When the oldest supported torch
# (pyproject's ``torch>=``) passes an entry's ``last``, delete the entry (tests/test_torch_versions.py
# fails until then) and the code it names.
TORCH_WORKAROUNDS: tuple[TorchWorkaround, ...] = (
    TorchWorkaround(
        first=(2, 10),
        last=(2, 11),
        symptom="inductor's loop_ordering_after_fusion (on by default since 2.10) fails bf16 one-graph "
        "steps of a GPT-2 and a ResNet-50 on CUDA in reorder_loops_by_dep_pair "
        "(assert isinstance(snode, SchedulerNode))",
        remove="2.12 turned the assertion into a refusal to fuse: delete when torch>=2.12",
        options={"loop_ordering_after_fusion": False},
    ),
    TorchWorkaround(
        first=(2, 10),
        last=(2, 12),
        symptom="comparing two optree treespecs inside a compiled step fails: 'Polyfill handler "
        "<method-wrapper '__eq__' of function object> does not have a traceable function'",
        remove="2.13 traces the comparison: make tree.same_structure(a, b) return a == b when torch>=2.13",
        where="functrain.tree.same_structure",
    ),
    TorchWorkaround(
        first=(2, 10),
        last=(2, 12),
        symptom="with options={'fallback_random': True}, a compiled step whose loss has two or more dropouts "
        "draws other masks than the eager step (torch.compile of torch.func.grad, without functrain too)",
        remove="nothing to undo in functrain: drop the xfail when torch>=2.13",
        where="tests/test_jit.py::test_compiled_matches_eager_trajectory (xfail on these versions)",
    ),
)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch), e.g. ``(2, 11)`` for ``2.11.0+cu130``."""
    match = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def _workaround_options(version: tuple[int, int]) -> dict[str, Any]:
    """The inductor options of the workarounds that apply to ``version``."""
    options: dict[str, Any] = {}
    for workaround in TORCH_WORKAROUNDS:
        if workaround.applies(version):
            options.update(workaround.options)
    return options


# Inductor settings that are better for a CPU training step than inductor's own defaults (measured in
# benchmarks/steps.py); an explicit ``options=`` entry always wins.
_CPU_DEFAULTS = {
    # Channels-last convolutions cost layout copies around every conv on CPU: 230 -> 161 ms per step
    # (-30%) on the benchmark's BatchNorm CNN; no effect on graphs without convolutions.
    "layout_optimization": False,
}


def _on_cpu(example_inputs: list[Any]) -> bool:
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(x.device.type == "cpu" for x in tensors)


def _uniform_below(x: torch.Tensor, p: Any) -> torch.Tensor:
    """An ``x``-shaped boolean mask, true with probability ``p``: float32 uniforms (exact p for bf16/fp16)."""
    return torch.rand(x.shape, dtype=torch.float32, device=x.device) < p


def _bernoulli(x: torch.Tensor, p: float = 0.5, generator: Any = None) -> Any:
    if generator is not None:
        return NotImplemented
    return _uniform_below(x, p).to(x.dtype)


def _bernoulli_inplace(x: torch.Tensor, p: float = 0.5, generator: Any = None) -> Any:
    draws = _bernoulli(x, p, generator)
    return draws if draws is NotImplemented else x.copy_(draws)


# AOTAutograd's and inductor's cache keys ignore custom decompositions, so without a mark a graph
# compiled with the dropout decompositions would be served to a compile of the same graph with
# ``fallback_random=True`` (eager's masks), or the reverse (seen here: an AOTAutograd cache hit across
# the two). ``unsafe_marked_cacheable_functions`` is hashed into both keys; this entry names no real
# function, so it marks nothing cacheable and only salts the key. Bump its version when the
# decompositions change.
_DROPOUT_CACHE_SALT = {"functrain.jit:cpu-dropout-masks": "float32 rand < p, v2"}


_RANDOM_MASK_OPS = ("dropout", "bernoulli")


def _draws_dropout_masks(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo's graph calls dropout or bernoulli, directly or inside attention (``dropout_p``)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = getattr(node.target, "__name__", str(node.target)).lower()
        if any(op in name for op in _RANDOM_MASK_OPS):
            return True
        if "scaled_dot_product_attention" in name:
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if not (isinstance(p, (int, float)) and p == 0):
                return True
    return False


class _DecompositionTable(dict):  # type: ignore[type-arg]
    """A decomposition table that pickles as a call of the function building it.

    Inductor pickles a custom table into its FX graph cache key; ATen's table holds pybind11 functions
    that cannot be pickled, which made inductor bypass its cache (warm compiles as slow as cold ones).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_cpu_dropout_decompositions, ())


def _cpu_dropout_decompositions() -> dict[Any, Callable[..., Any]]:
    """Inductor's decompositions, with Bernoulli draws (dropout masks) as ``rand < p``.

    On CPU inductor keeps ``bernoulli_`` as a call to ATen's kernel, ~10 ns per element here; ATen's
    ``rand`` draws from the same generator in ~5 ns, and the compare and scale fuse into inductor's
    kernels. Dropout took 17% of the benchmark transformer's step. Used with ``fallback_random=True``,
    so ``rand`` stays ATen's (inductor's own CPU RNG was slower still, ~15 ns per element). The masks
    follow the same distribution as eager's but are different draws; pass
    ``options={"fallback_random": True}`` to draw exactly eager's masks instead.
    """
    # Inductor's table under fallback_random=True (what these graphs compile with), whatever the
    # config is when this runs: the cache calls this function again when it loads a graph.
    from torch._decomp.decompositions import native_dropout as default_dropout
    from torch._inductor.decomposition import decompositions as inductor_table

    aten = torch.ops.aten
    table = dict(inductor_table)

    def native_dropout(x: torch.Tensor, p: float, train: bool | None) -> Any:
        if not train or p in (0, 1) or not x.is_floating_point():
            return default_dropout(x, p, train)
        keep = _uniform_below(x, 1.0 - p)
        return keep * x * float(1.0 / (1.0 - p)), keep

    table[aten.bernoulli_.float] = _bernoulli_inplace
    table[aten.bernoulli.p] = _bernoulli
    table[aten.native_dropout.default] = native_dropout
    return _DecompositionTable(table)


# ------------------------------------------------------------------------------------------ guards
# Dynamo guards every global the trace read. Those that stay inside the code a functrain step runs
# through (functrain's own modules, torch's functional_call/functorch/pytree internals, optree, dataclasses,
# builtins: ~700 of the ~1300 guards of a 100-leaf step) fail only if that library code itself is
# monkeypatched during a run; evaluating them cost ~60 us per call here (benchmarks/README.md,
# "Per-call overhead"). They are skipped. A guard whose path leaves the library through a module
# attribute (``functrain.step``'s ``nn.functional.gelu`` is ``torch.nn.functional.gelu``, which a user
# may patch), and every guard on the globals of the user's modules or of ``torch.nn``'s, is kept:
# changing one still recompiles the step.
#
# The pytree registries (torch's ``SUPPORTED_NODES``, optree's ``_NODETYPE_REGISTRY``) are library data
# too: dynamo guards their keys (``len(__import__('torch').utils._pytree.SUPPORTED_NODES) != 115``),
# so any node type registered after the first call (a lazily imported module defining a
# ``functrain.tree.struct``: ``ft.evaluate`` imports ``functrain.loop``; a Hugging Face model module
# registering its ``ModelOutput`` classes) recompiled every step. The types a step flattens are
# registered before the state that holds them exists, and each input's type is still guarded; a node
# type registered later is one the step never saw.
_LIBRARY_MODULES = re.compile(
    r"(functrain|dataclasses|contextlib|functools|math|optree|torch\._functorch|torch\._dynamo"
    r"|torch\.utils\._pytree|torch\.nn\.utils\.(stateless|_named_member_accessor))(\..+)?"
)
# A guard's roots: a global of the traced function's module (``G['__import_functrain_dot_tree']``,
# ``G['torch_pytree']``) or a module dynamo imports by name (``__import__('torch')``), each with the
# attributes that follow; wrappers around them (``list(dict.keys(...))[3]``, ``type(...)``) read the same
# objects.
_ROOT_PATH = re.compile(r"G\['([^']+)'\]((?:\.\w+)*)|__import__\('([\w.]+)'\)((?:\.\w+)*)")
_MISSING = object()


def _is_library_path(name: str) -> bool:
    """Whether every root of a guard's source (``G['__import_functrain_dot_tree'].leaves.__code__``,
    ``list(dict.keys(__import__('torch').utils._pytree.SUPPORTED_NODES))[3]``) starts at a library
    module (or a global of this module) and reaches no other module on its way; a local (``L[...]``)
    anywhere in it keeps the guard."""
    roots = list(_ROOT_PATH.finditer(name))
    return bool(roots) and "L[" not in name and all(_is_library_root(*root.groups()) for root in roots)


def _is_library_root(global_name: str | None, attrs: str, module_name: str | None, import_attrs: str) -> bool:
    if module_name is not None:  # __import__('torch').utils._pytree...: start at the named submodule
        return _library_attrs(*_submodule(module_name, import_attrs.split(".")[1:]))
    if global_name.startswith("__builtins_dict___"):
        return True
    if global_name.startswith("__import_"):
        module_name = global_name[len("__import_") :].replace("_dot_", ".")
        obj = sys.modules.get(module_name, _MISSING) if _LIBRARY_MODULES.fullmatch(module_name) else _MISSING
    else:  # a global of this module: the wrappers dynamo traces first live here
        obj = globals().get(global_name, _MISSING)
    return _library_attrs(obj, attrs.split(".")[1:])


def _submodule(module_name: str, attrs: list[str]) -> tuple[Any, list[str]]:
    """``__import__(module_name)`` followed by ``attrs``: the deepest module reached under its own name
    (``torch.utils._pytree`` for ``torch`` + ``utils._pytree``; a module aliased elsewhere stops there),
    with the attributes left. A root that is not a library module resolves to nothing (kept)."""
    obj = sys.modules.get(module_name, _MISSING)
    while attrs and isinstance(getattr(obj, attrs[0], None), types.ModuleType):
        child = getattr(obj, attrs[0])
        if child.__name__ != f"{module_name}.{attrs[0]}":
            break
        obj, module_name, attrs = child, child.__name__, attrs[1:]
    return (obj if _LIBRARY_MODULES.fullmatch(module_name) else _MISSING), attrs


def _library_attrs(obj: Any, attrs: list[str]) -> bool:
    for attr in attrs:
        if _outside_library(obj):
            return False
        obj = getattr(obj, attr, _MISSING)
    return not _outside_library(obj)


def _outside_library(obj: Any) -> bool:
    """Missing, or a module that is not library code (a path through it may reach what users patch)."""
    return obj is _MISSING or (
        isinstance(obj, types.ModuleType) and not _LIBRARY_MODULES.fullmatch(obj.__name__)
    )


def _skip_library_guards(entries: list[Any]) -> list[bool]:
    """dynamo's ``guard_filter_fn``: keep every guard but those on library globals (see above)."""
    return [not _is_library_path(entry.name) for entry in entries]


# ------------------------------------------------------------------------------------------ caches
# ``jit(..., cache_dir=...)`` keeps torch's portable compile cache (``torch.compiler.save_cache_artifacts``:
# AOTAutograd and inductor entries, compiled kernels) in a file per step, loaded into the local caches
# before the first compile in a new process, on this machine or another of the same kind.

CACHE_SUFFIX = ".compile-cache"
_loaded_cache_files: set[str] = set()


def _cache_misses() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


def _load_cache_dir(directory: str) -> int:
    """Load every cache file of ``directory`` not loaded by this process yet; returns how many.

    The files are torch's serialized cache entries (pickles, like inductor's own cache directory):
    load only a directory that your own runs wrote.
    """
    if not os.path.isdir(directory):
        return 0
    loaded = 0
    for name in sorted(os.listdir(directory)):
        path = os.path.abspath(os.path.join(directory, name))
        if not name.endswith(CACHE_SUFFIX) or path in _loaded_cache_files:
            continue
        _loaded_cache_files.add(path)
        try:
            with open(path, "rb") as f:
                torch.compiler.load_cache_artifacts(f.read())
            loaded += 1
        except Exception as e:  # a stale or foreign file costs a cold compile, never the run
            log.warning("functrain.jit: ignoring compile cache %s (%s: %s)", path, type(e).__name__, e)
    return loaded


def _save_cache_file(directory: str, name: str) -> None:
    """Write this process's compile artifacts (all of them, cumulative) to ``directory/name``.

    Written to a temporary name and renamed: ranks of one run may write the same file at once.
    """
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return
    path = os.path.join(directory, name + CACHE_SUFFIX)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(artifacts[0])
        os.replace(tmp, path)
    except OSError as e:
        log.warning("functrain.jit: could not write the compile cache %s: %s", path, e)
    _loaded_cache_files.add(os.path.abspath(path))


class CompiledStep:
    """A step function wrapped by :func:`jit`. Call it like the step: ``step(state, *args)``.

    Attributes:
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
        functools.update_wrapper(self, fn)
        self._model = getattr(fn, "model", None)  # what functrain.traceable adapts (steps carry it)
        target = _with_own_code(_donating(fn) if donate else _keeping_layouts(fn))
        self._eager = target
        # After the first compile, calls whose inputs pass a cached graph's guards skip dynamo's frame
        # evaluation (functrain.cache_hits): ~0.1 ms less host time per call.
        # After a graph break the cached code calls resume functions that only dynamo's frame
        # evaluation compiles: direct calls need the one graph of fullgraph=True.
        self._cache_hits = CacheHits(target, enabled=compile and fullgraph)
        self._lookup_in_traceable = False
        self._settle = _settling_forward(fn) if compile else None
        self._options = {"fullgraph": fullgraph, "dynamic": dynamic, "mode": mode, "options": options}
        if compile:
            config = dict(torch._inductor.list_mode_options(mode)) if mode else {}
            config.update(options or {})
            # The caller's own filter replaces jit's.
            guard_filter = config.pop("guard_filter_fn", _skip_library_guards)
            backend = functools.partial(self._backend, config=config)
            self._compiled = torch.compile(
                target,
                fullgraph=fullgraph,
                dynamic=dynamic,
                backend=backend,
                options={"guard_filter_fn": guard_filter},
            )
        else:
            self._compiled = target

    # The counting backend: every graph the step compiles passes through here.
    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any], *, config: dict[str, Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        if self.num_compiles > 1:
            self.compile_reasons.append(self._last_guard_failure())
        if self.num_compiles > self.max_compiles:
            msg = (
                f"{self.__name__}: compiled {self.num_compiles} times (max_compiles={self.max_compiles}). "
                f"Last cause: {self.compile_reasons[-1] if self.compile_reasons else 'unknown'}. A Python "
                "number that changes between calls (keep it a 0-d tensor in the state), a batch whose shape "
                "changes (pad it, drop_last=True, or jit(..., dynamic=True)) or a new state structure each "
                "trigger a recompilation."
            )
            if self.on_max_compiles == "raise":
                raise RecompileError(msg)
            if not self._warned:
                warnings.warn(msg, stacklevel=2)
                self._warned = True
        defaults = _workaround_options(torch_version())
        if not _on_cpu(example_inputs):
            return compile_fx(gm, example_inputs, config_patches={**defaults, **config} or None)
        defaults.update(_CPU_DEFAULTS)
        if vec_isa_verified():  # skips inductor's per-process ISA load check (functrain._isa_probe)
            defaults["cpp.vec_isa_ok"] = True
        # The caller chose how random ops compile (fallback_random), or the graph draws no dropout mask:
        # inductor's own path.
        if "fallback_random" in config or not _draws_dropout_masks(gm):
            return compile_fx(gm, example_inputs, config_patches={**defaults, **config})
        from torch._inductor import config as inductor_config

        salted = {**inductor_config.unsafe_marked_cacheable_functions, **_DROPOUT_CACHE_SALT}
        return compile_fx(
            gm,
            example_inputs,
            config_patches={
                **defaults,
                "fallback_random": True,
                "unsafe_marked_cacheable_functions": salted,
                **config,
            },
            decompositions=_cpu_dropout_decompositions(),
        )

    def _last_guard_failure(self) -> str:
        from torch._dynamo.utils import guard_failures

        code = getattr(self._eager, "__code__", None)
        reasons = guard_failures.get(code) if code is not None else None
        if not reasons:
            return "unknown (set TORCH_LOGS=recompiles for details)"
        return " ".join(str(reasons[-1]).split())[:500]

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        if self.donate and state in self._donated:
            raise DonatedStateError(
                f"{self.__name__}: this state was donated to an earlier call, which wrote its results "
                "into the state's tensors; use the state that call returned (or jit(..., donate=False))"
            )
        if self.seed and hasattr(state, "rng"):
            rank = self.rank if self.rank is not None else distributed_rank()
            _seed_generators(random.step_seed(state.rng, state.step, rank), _device_of(state))
        out = self._call(state, args, kwargs)
        if self.donate:
            self._donated.add(state)
        return out

    def _call(self, state: Any, args: tuple, kwargs: dict) -> Any:
        # After the first compile, a call that a compiled graph's guards accept runs that graph directly.
        # The lookup runs outside ``traceable`` (its patches matter only while dynamo traces), unless
        # the graph guards one of them (a model that calls torch.utils.checkpoint, an RNN): then a
        # lookup outside missed while dynamo's own lookup inside found the graph without compiling.
        if self.num_compiles:
            with (
                traceable(self._model, compiled=True)
                if self._lookup_in_traceable
                else contextlib.nullcontext()
            ):
                out = self._cache_hits.call(state, args, kwargs)
            if out is not MISS:
                return out
        if self._settle is not None:  # before the first trace, once
            settle, self._settle = self._settle, None
            _settle(settle, self.__name__, state, args, kwargs)
        compiles = self.num_compiles
        # The model's torch.utils.checkpoint, RNNs and log calls, made traceable (functrain.traceable).
        with traceable(self._model, compiled=self.compile):
            out = self._call_through_dynamo(state, args, kwargs)
        if compiles and self.num_compiles == compiles and self._cache_hits.missed_on_guards:
            self._lookup_in_traceable = True
        return out

    def _call_through_dynamo(self, state: Any, args: tuple, kwargs: dict) -> Any:
        """Call the step through ``torch.compile`` (or eagerly), compiling if dynamo has to."""
        # Dynamo stops compiling (and silently runs eagerly) after ``recompile_limit`` compiles; lift it
        # so that max_compiles decides. Set and restored by hand: config.patch costs ~5x more per call.
        dynamo_config = torch._dynamo.config
        limit = dynamo_config.recompile_limit
        needed = max(64, self.max_compiles + 1)
        if limit < needed:
            dynamo_config.recompile_limit = needed
        try:
            return self._run(state, args, kwargs)
        except RecompileError:
            raise
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = e.__cause__ or getattr(e, "inner_exception", None)
            if isinstance(inner, (RecompileError, RematRandomnessError)):
                raise inner from None
            raise
        except torch._dynamo.exc.Unsupported as e:
            raise self._explain(e, state, args, kwargs) from e
        finally:
            if limit < needed:
                dynamo_config.recompile_limit = limit

    def _run(self, state: Any, args: tuple, kwargs: dict) -> Any:
        """Call the step, timing a compile if there is one."""
        if not self.compile:
            return self._compiled(state, *args, **kwargs)
        if self.cache_dir is not None and self.num_compiles == 0:
            _load_cache_dir(self.cache_dir)
        # Cache misses are only read to decide whether to write a cache file.
        misses = _cache_misses() if self.cache_dir is not None else 0
        key = self._announce_first_compile(state, args, kwargs) if self.num_compiles == 0 else None
        compiles, started = self.num_compiles, time.perf_counter()
        out = self._compiled(state, *args, **kwargs)
        if self.num_compiles != compiles:
            seconds = time.perf_counter() - started
            self._compiled_in(seconds, misses)
            if key is not None:
                _compile_times.record(key, seconds)
        return out

    def _announce_first_compile(self, state: Any, args: tuple, kwargs: dict) -> str | None:
        """Log that the first compile starts, with the last one's time on this machine where functrain's
        cache has it (:mod:`functrain._compile_times`); returns the key to record this one under."""
        try:
            key = _compile_times.compile_key(self.__name__, self._model, (state, args, kwargs), self._options)
            last = _compile_times.estimate(key)
        except Exception as e:  # only the estimate is lost
            log.debug("%s: no compile-time estimate (%s: %s)", self.__name__, type(e).__name__, e)
            key, last = None, None
        log.info(
            "compiling %s: first call%s", self.__name__,
            f" (~{last:.3g} s: the last compile of this step on this machine)" if last is not None else "",
        )  # fmt: skip
        return key

    def _compiled_in(self, seconds: float, misses_before: int) -> None:
        """Account for a call that compiled: time, log line, portable cache file (``misses_before``:
        :func:`_cache_misses` before the call, read only with a ``cache_dir``)."""
        self.compile_seconds += seconds
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
        if self.cache_dir is not None and _cache_misses() > misses_before:
            _save_cache_file(self.cache_dir, self.__name__)

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


def _settling_forward(step: Callable[..., Any]) -> Callable[..., Any] | None:
    """What runs a step's model once eagerly before its first trace: a train step's ``settle`` (its loss
    function's forward, without gradients); an eval or predict step of a module is a forward itself."""
    settle = getattr(step, "settle", None)
    if settle is None and getattr(step, "kind", None) in ("eval", "predict"):
        settle = step if isinstance(getattr(step, "model", None), torch.nn.Module) else None
    return settle


def _settle(settle: Callable[..., Any], name: str, state: Any, args: tuple, kwargs: dict) -> None:
    """Run ``settle(state, *args)`` eagerly, leaving the random generators as they were.

    Models settle Python attributes in their first forward: Hugging Face's classification heads (BERT,
    ViT, ...) set ``config.problem_type`` from the labels. Traced first, the step guards the unsettled
    value (``config.problem_type is None``) and recompiles on its second call, as any ``torch.compile``
    of such a model does. One eager forward first costs far less than a compile (benchmarks/README.md).
    A forward that fails here is left to the compiled call, which reports it.
    """
    device = _device_of(state)
    devices = [device.index or 0] if device is not None and device.type not in ("cpu", "meta") else []
    started = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            settle(state, *args, **kwargs)
    except Exception as e:
        log.debug("%s: the eager forward before the first compile failed (%s: %s)", name, type(e).__name__, e)
        return
    log.debug("%s: eager forward before the first compile: %.3f s", name, time.perf_counter() - started)


def _with_own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own.

    Dynamo keeps compiled graphs, recompile counts and guard failures per code object. The wrappers
    made by ``_donating`` and ``_keeping_layouts`` (and steps made by one factory) share theirs, so
    without a copy every CompiledStep in a process would share one cache: each call would first check
    the other steps' guards, their compiles would count toward dynamo's recompile limit, and a
    recompile would be explained by another step's guard failure.
    """
    return functools.update_wrapper(with_code(fn, fn.__code__.replace()), fn)


def _donating(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a step so it writes the new state into the incoming state's tensors (JAX's donation)."""

    @functools.wraps(fn)
    def donating_step(state: Any, *args: Any, **kwargs: Any) -> Any:
        with foreach.flag("donated", True):  # make_train_step's optimizer may then update in place
            new_state, *rest = fn(state, *args, **kwargs)
        # torch's pytree, not optree: dynamo cannot trace optree flattening an empty dict (a model
        # without buffers) inside the graph ("SourcelessBuilder ... DictMetaData", torch 2.11-2.13 with
        # optree 0.20).
        old_leaves, spec = torch_pytree.tree_flatten(state)
        new_leaves, new_spec = torch_pytree.tree_flatten(new_state)
        if not tree.same_structure(spec, new_spec):
            return (new_state, *rest)
        merged = [old.copy_(new) if _replaces(new, old) else new for old, new in zip(old_leaves, new_leaves)]
        return (torch_pytree.tree_unflatten(merged, spec), *rest)

    return donating_step


def _replaces(new: Any, old: Any) -> bool:
    """Whether ``new`` is another tensor of ``old``'s shape, dtype and device: one a step can write
    into ``old`` (donation) or into ``old``'s layout (:func:`_keeping_layouts`)."""
    return (
        isinstance(old, torch.Tensor)
        and isinstance(new, torch.Tensor)
        and old is not new
        and old.shape == new.shape
        and old.dtype == new.dtype
        and old.device == new.device
    )


def _keeping_layouts(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a pure step so each tensor of the new state has the strides of the one it replaces.

    A compiled graph's outputs get the strides its fake-tensor trace predicted, which need not be the
    inputs' nor eager's: before pytorch/pytorch#171622 the convolution backward's meta kernel predicted
    contiguous weight gradients where CUDA returns channels_last ones, and what is computed from the
    gradients (the optimizer's moments, through decomposed pointwise ops) can follow that layout. A state
    whose layout changes after a step recompiles the step and feeds its convolutions converted copies;
    issue 10 measured the pure ResNet-50 step at twice the donating one's time on an H100. The donating
    step cannot drift: it copies into the input's tensors. Here the same copy goes into a fresh tensor of
    the input's layout, only where the strides differ (decided while tracing: nothing is added where they
    match); inductor fuses it into the kernel that computes the value.
    """

    @functools.wraps(fn)
    def layout_keeping_step(state: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(state, *args, **kwargs)
        if not (isinstance(out, tuple) and out and type(out[0]) is type(state)):
            return out  # an eval or predict step: no new state
        old_leaves = torch_pytree.tree_leaves(state)
        new_leaves, spec = torch_pytree.tree_flatten(out[0])
        if len(old_leaves) != len(new_leaves):
            return out
        kept = [_like_layout(new, old) for old, new in zip(old_leaves, new_leaves)]
        if all(k is n for k, n in zip(kept, new_leaves)):
            return out
        return (torch_pytree.tree_unflatten(kept, spec), *out[1:])

    return layout_keeping_step


def _like_layout(new: Any, old: Any) -> Any:
    """``new``, copied into ``old``'s strides when they differ (dense layouts only)."""
    if not _replaces(new, old) or new.stride() == old.stride():
        return new
    out = torch.empty_like(old)  # preserve_format: old's exact strides when old is dense
    return out.copy_(new) if out.stride() == old.stride() else new


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
    without dynamo's frame evaluation (:mod:`functrain.cache_hits`); any other call goes through
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
            ``options`` sets ``fallback_random`` (``True``: exactly eager's masks).
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
        >>> fast_step = jit(train_step, donate=True)
        >>> debug_step = jit(train_step, compile=False)
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
