"""The inductor options :func:`functrain.jit` compiles a step with: torch version workarounds, CPU defaults,
the vector-ISA verdict and the dropout decompositions, each under the caller's own ``options``.

Example:
    >>> torch_version("2.11.0+cu130")
    (2, 11)
    >>> _workaround_options((2, 11))
    {'loop_ordering_after_fusion': False}
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from functrain.compile import header_cache, lazy_templates, workers
from functrain.compile.dropout import DROPOUT_CACHE_SALT, cpu_dropout_decompositions, draws_dropout_masks
from functrain.compile.isa_probe import vec_isa_verified

__all__ = ["TORCH_WORKAROUNDS", "TorchWorkaround", "compile_graph", "gathers_params", "torch_version"]


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
    where: str = "functrain.compile.backend"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def applies(self, version: tuple[int, int]) -> bool:
        return self.first <= version <= self.last


# Every version-specific workaround in functrain, in one place (functrain.jit re-exports it). When the
# oldest supported torch (pyproject's ``torch>=``) passes an entry's ``last``, delete the entry
# (tests/test_torch_versions.py fails until then) and the code it names.
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


def gathers_params(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo's graph (or a subgraph of it: a block's gather sits in its autograd.Function's
    forward) all-gathers: a ZeRO-3 step, whose gathers depend on the step's inputs only.

    Example:
        >>> gathers_params(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))
        False
    """
    return any(
        "all_gather_into_tensor" in str(node.target)
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function"
    )


# A step that gathers its blocks' params one block at a time: inductor's reorder_for_locality hoists every
# all-gather (inputs only) to the top of the graph, so all blocks' params were whole at once. On the
# benchmark's 8 x Linear(1024), 2 ranks, donating: step peak 46.2 -> 31.9 MB, throughput unchanged
# (benchmarks/README.md, sharded).
_GATHERING_DEFAULTS = {"reorder_for_locality": False}


def _on_cpu(example_inputs: list[Any]) -> bool:
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(x.device.type == "cpu" for x in tensors)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: dict[str, Any]) -> Any:
    """Compile dynamo's graph with inductor: functrain's defaults, then the caller's ``config`` (which wins)."""
    lazy_templates.install()  # before inductor's GPU kernel modules compile their templates at import
    from torch._inductor.compile_fx import compile_fx

    defaults = _workaround_options(torch_version())
    if gathers_params(gm):
        defaults.update(_GATHERING_DEFAULTS)
    if not _on_cpu(example_inputs):
        return compile_fx(gm, example_inputs, config_patches={**defaults, **config} or None)
    defaults.update(_CPU_DEFAULTS)
    threads = workers.machine_compile_threads()  # a g++ per idle core only (functrain.compile.workers)
    if threads is not None:
        defaults["compile_threads"] = threads
    header_cache.install()  # no g++ -E of inductor's prefix header in every new process
    if vec_isa_verified():  # skips inductor's per-process ISA load check (functrain.compile.isa_probe)
        defaults["cpp.vec_isa_ok"] = True
    # The caller chose how random ops compile (fallback_random), or the graph draws no dropout mask:
    # inductor's own path.
    if "fallback_random" in config or not draws_dropout_masks(gm):
        return compile_fx(gm, example_inputs, config_patches={**defaults, **config})
    from torch._inductor import config as inductor_config

    salted = {**inductor_config.unsafe_marked_cacheable_functions, **DROPOUT_CACHE_SALT}
    return compile_fx(
        gm,
        example_inputs,
        config_patches={
            **defaults,
            "fallback_random": True,
            "unsafe_marked_cacheable_functions": salted,
            **config,
        },
        decompositions=cpu_dropout_decompositions(),
    )
