"""Tensor parallelism (TP) as a parallel strategy of the train step: a layer's matmuls split over devices.

``tensor_parallel(model, plan, mesh)`` resolves a *plan* (submodule names or glob patterns -> ``"colwise"``,
``"rowwise"`` or ``"replicate"``) into one DTensor placement per parameter, as Megatron-LM and torchtitan
split a transformer block: a colwise ``nn.Linear`` keeps rows of its weight (``Shard(0)``, its output is
split on the last dim, so attention heads are split when q, k and v are), a rowwise one keeps columns
(``Shard(1)``, its output is a partial sum that DTensor all-reduces where it is used). Every other parameter
is replicated. The returned :class:`TensorParallel` places a state's params and optimizer moments as
DTensors (:meth:`TensorParallel.place`) and is the step's strategy
(``make_train_step(..., strategy=tp)``).

No hooks: torch's ``parallelize_module`` redistributes activations in forward hooks through
``autograd.Function``s without ``setup_context``, which ``torch.func.grad`` refuses. Here the model's own
forward runs on DTensor params; DTensor's sharding propagation inserts the collectives as ordinary
dispatched ops (traced into the one compiled graph), and plain tensors (the batch, masks a forward makes)
are taken as replicated over the mesh (DTensor's implicit replication), so **every rank of the mesh must be
given the same batch**. Whatever the plan, the result is the model's own computation (DTensor keeps the
semantics; a poor plan costs collectives, not correctness).

Example (under ``torchrun --nproc-per-node 2``; see ``examples/08_tensor_parallel.py``):

.. code-block:: python

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    tp = ft.distributed.tensor_parallel(model, ft.distributed.GPT_PLAN, mesh)
    state = tp.place(ft.TrainState.create(model, ft.optim.adamw(1e-3)))
    step = ft.jit(ft.make_train_step(model, loss_fn, strategy=tp))
    state, metrics = step(state, batch)          # the same batch on every rank of the mesh
    whole = tp.gather(state)                      # plain tensors: save it, evaluate it, resume it anywhere
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from functrain.core import foreach
from functrain.core.tree_walk import leaves_with_paths, rebuild
from functrain.distributed.gradients import GradientReducer
from functrain.distributed.sharding import Sharding, _collective
from functrain.distributed.strategy import Examples, Reduced, Replicated
from functrain.distributed.tp_forward import mark_placed
from functrain.distributed.tp_sharding import TPShards

__all__ = [
    "GPT2_PLAN",
    "GPT_PLAN",
    "LLAMA_PLAN",
    "Plan",
    "Style",
    "TensorParallel",
    "tensor_parallel",
]

Style = Literal["colwise", "rowwise", "replicate"]
Plan = Mapping[str, Style]
"""Submodule names or ``fnmatch`` patterns (``"blocks.*.attn.q"``) -> how that layer is split."""

STYLES: tuple[str, ...] = ("colwise", "rowwise", "replicate")

GPT_PLAN: Plan = {
    "*attn.q": "colwise",
    "*attn.k": "colwise",
    "*attn.v": "colwise",
    "*attn.proj": "rowwise",
    "*mlp.fc": "colwise",
    "*mlp.proj": "rowwise",
}
"""A GPT-style block whose attention has separate ``q``, ``k``, ``v`` and ``proj`` linears and whose MLP
has ``fc`` and ``proj``: the heads and the MLP's hidden units split over the mesh (Megatron-LM's plan)."""

LLAMA_PLAN: Plan = {
    "*self_attn.q_proj": "colwise",
    "*self_attn.k_proj": "colwise",
    "*self_attn.v_proj": "colwise",
    "*self_attn.o_proj": "rowwise",
    "*mlp.gate_proj": "colwise",
    "*mlp.up_proj": "colwise",
    "*mlp.down_proj": "rowwise",
}
"""Hugging Face ``LlamaForCausalLM`` (torchtitan's plan for the blocks; embeddings and head replicated)."""

GPT2_PLAN: Plan = {
    "*attn.c_attn": "colwise",
    "*attn.c_proj": "rowwise",
    "*mlp.c_fc": "colwise",
    "*mlp.c_proj": "rowwise",
}
"""Hugging Face ``GPT2LMHeadModel`` (``Conv1D`` layers, weights stored ``(in, out)``). ``c_attn`` holds q, k
and v in one matrix: split colwise, each rank holds a third of the heads' columns mixed, which DTensor
redistributes before the heads are split (correct, with one more collective than separate q, k, v)."""

# Which dim of each weight a style splits, by layer kind: nn.Linear stores (out, in), nn.Embedding
# (num, dim), Hugging Face's Conv1D (in, out). A colwise layer's output is split on its last dim.
_WEIGHT_DIM = {
    "Linear": {"colwise": 0, "rowwise": 1},
    "Embedding": {"colwise": 1, "rowwise": 0},
    "Conv1D": {"colwise": 1, "rowwise": 0},
}
# a bias follows a colwise split (it is added to the split output) and is whole after a rowwise one
_BIAS_SPLIT = {"colwise": True, "rowwise": False}


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return "Conv1D"
    return None


def _resolve(model: nn.Module, plan: Plan, size: int) -> dict[str, tuple[int | None, str, str]]:
    """``{param name: (dim it is split on or None, style, module path)}`` for every parameter the plan
    names; refuses unknown styles, patterns that match nothing and layers the plan cannot split."""
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tensor_parallel: plan[{pattern!r}] must be one of {STYLES}, got {style!r}")
    modules = dict(model.named_modules())
    # a weight tied to another (GPT-2's lm_head.weight is wte.weight) is one param, under its first name
    canonical = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, tuple[int | None, str, str]] = {}
    tied: list[tuple[str, str, int | None, str]] = []  # (a tied weight's other name, its name, dim, entry)
    for pattern, style in plan.items():
        matched = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(
                f"tensor_parallel: plan entry {pattern!r} matches no submodule of {type(model).__name__}; "
                f"its submodules are named like {sorted(modules)[1:6]}"
            )
        for path in matched:
            module, kind = modules[path], _kind(modules[path])
            if style != "replicate" and kind is None:
                raise ValueError(
                    f"tensor_parallel: plan entry {pattern!r} splits {path!r}, a {type(module).__name__}, "
                    f"but only nn.Linear, nn.Embedding and Hugging Face Conv1D layers can be split "
                    f"{style}; name its linear submodules instead, or map it to 'replicate'"
                )
            for attr, p in module.named_parameters(recurse=False):
                alias, name = f"{path}.{attr}", canonical[id(p)]
                dim = _split_dim(kind, style, attr, p)
                if alias != name:
                    tied.append((alias, name, dim, pattern))
                    continue
                if name in out and out[name][1] != style:
                    raise ValueError(
                        f"tensor_parallel: {name!r} is split {out[name][1]} by one plan entry and {style} by "
                        f"{pattern!r}; make the patterns disjoint"
                    )
                if dim is not None and p.shape[dim] % size:
                    raise ValueError(
                        f"tensor_parallel: {name!r} has {p.shape[dim]} along dim {dim}, which {style} splits "
                        f"over {size} ranks: not a multiple; choose a mesh size that divides it"
                    )
                out[name] = (dim, style, path)
    _refuse_tied(tied, out)
    return out


def _refuse_tied(tied: list[tuple[str, str, int | None, str]], out: Mapping[str, tuple[Any, ...]]) -> None:
    """A plan entry reaching a tied weight by its other name (GPT-2's ``lm_head.weight``, which is
    ``transformer.wte.weight``; ``named_parameters`` keeps the first name only) would be ignored in
    silence: the weight is placed as the entry for its first name says (replicated if none)."""
    for alias, name, dim, pattern in tied:
        placed = out.get(name, (None,))[0]
        if dim != placed:
            raise ValueError(
                f"tensor_parallel: plan entry {pattern!r} places {alias!r} {_placement_of(dim)}, but it is "
                f"tied to {name!r} (one param, named {name!r}), placed {_placement_of(placed)}; split the "
                f"tied weight by a plan entry for {name.rsplit('.', 1)[0]!r} (it places it for both layers), "
                f"or map {pattern!r} to 'replicate'"
            )


def _placement_of(dim: int | None) -> str:
    return "Replicate()" if dim is None else f"Shard({dim})"


def _split_dim(kind: str | None, style: str, attr: str, p: torch.Tensor) -> int | None:
    if style == "replicate" or kind is None:
        return None
    if attr == "weight":
        return _WEIGHT_DIM[kind][style]
    if attr == "bias" and _BIAS_SPLIT[style]:
        return 0
    return None


class TensorParallel(Replicated):
    """The TP strategy: params as DTensors on a 1-D mesh, split by a resolved plan; made by
    :func:`tensor_parallel`.

    Example:
        >>> tp = tensor_parallel(model, GPT_PLAN, mesh)  # doctest: +SKIP
        >>> tp.placements["blocks.0.attn.q.weight"]  # doctest: +SKIP
        (Shard(dim=0),)
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        mesh: DeviceMesh,
        dp_group: Any = None,
        sharding: Sharding | None = None,
    ) -> None:
        self.mesh = mesh
        self.plan = dict(plan)
        # data parallelism over the other mesh dim: each tp group its own batch, gradients averaged
        buffers = sharding.buffers if sharding is not None else "mean"
        self.dp = (
            GradientReducer(buffers=buffers, model=model, group=dp_group) if dp_group is not None else None
        )
        self.reducer = self.dp
        self.counts_examples = self.dp is not None
        split = _resolve(model, plan, mesh.size())
        self.placements: dict[str, tuple[Placement, ...]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, p in model.named_parameters():
            dim = split.get(name, (None, "", ""))[0]
            self.placements[name] = (Replicate(),) if dim is None else (Shard(dim),)
            shapes[name] = tuple(p.shape)
        self.shapes = shapes
        self.model = model
        self._batchnorms = tuple(
            (name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
        )
        self.group = mesh.get_group()
        # ZeRO over dp: every leaf's optimizer state (and params at level "params") kept as row pieces
        self.zero = TPShards(sharding, mesh, self.placements, shapes) if sharding is not None else None
        self.level = sharding.level if sharding is not None else None
        self.shards_params = self.level == "params"  # as a layout's request (TrainState.layout)
        # A mesh of one too: DTensor leaves, plain norms (the loop sums them).
        self.norm = self.zero.norms if self.zero is not None else self._norms
        self.request = self  # what a TrainState.layout's readers ask (request.shards_params)

    # ------------------------------------------------------------------ the state

    def place(self, state: Any) -> Any:
        """``state`` (whole params, as ``TrainState.create`` or a restored checkpoint gives it) with every
        param and every optimizer moment of a param's shape as a DTensor of this plan: each rank keeps its
        part (global rank 0's values on every rank, as :func:`functrain.distributed.replicate` makes: over
        the tp mesh, and over the dp replicas of a 2-D mesh). With ZeRO (``sharding=``) the moments, and
        at level ``"params"`` the params, are kept as this rank's row pieces
        (:mod:`functrain.distributed.tp_sharding`). Collective."""
        if getattr(state, "layout", None) is not None:
            raise ValueError(
                f"TensorParallel.place: the state already has a layout ({type(state.layout).__name__}); "
                "place a state made by TrainState.create(model, tx) without sharding=, or tp.gather(state). "
                "For ZeRO over the dp axis of a 2-D mesh pass the request to tensor_parallel(model, plan, "
                "mesh, sharding=fully_shard(mesh['dp'], level=...)) and place the whole state"
            )
        shapes = {n: tuple(p.shape) for n, p in state.params.items()}
        missing = sorted(set(self.placements) - set(shapes))[:8]
        if missing:
            raise ValueError(f"TensorParallel.place: the state lacks the model's params {missing}")
        if self.zero is not None:
            self._refuse_unshardable(state, shapes)

        def leaf(path: tuple[Any, ...], x: Any) -> Any:
            name = self._param_of(path, x, shapes)
            if name is None:
                return x
            if isinstance(x, DTensor):
                raise ValueError(f"TensorParallel.place: {'.'.join(map(str, path))} is already a DTensor")
            x = x.detach()
            if self.dp is not None:  # the first tp group's values in every dp replica
                x = x.contiguous().clone()
                dist.broadcast(x, src=dist.get_global_rank(self.dp.group, 0), group=self.dp.group)
            # src_data_rank=0: the tp group's rank 0's values on all its ranks (a broadcast, then a local cut)
            placed = distribute_tensor(x, self.mesh, self.placements[name], src_data_rank=0)
            if self.zero is not None and (path[0] == "opt_state" or self.shards_params):
                return self.zero.rows({name: placed})[name]
            return placed

        mark_placed(self.model)  # its compiled step is traced with implicit replication (functrain.jit)
        return rebuild(state, leaf).replace(layout=self)

    def gather(self, state: Any) -> Any:
        """The state with every DTensor whole (plain tensors, ``layout=None``): what one process training
        on the same batches would hold; save it, evaluate it or :meth:`place` it on another mesh.
        Collective: every rank of the mesh calls it."""

        def leaf(path: tuple[Any, ...], x: Any) -> Any:
            if not isinstance(x, DTensor):
                return x
            name = path[-1] if len(path) >= 2 and path[0] in ("params", "opt_state") else None
            if self.zero is not None and name in self.placements and self._is_rows(path, name, x):
                x = self.zero.whole({name: x})[name]
            return x.full_tensor()

        return rebuild(state, leaf).replace(layout=None)

    def _is_rows(self, path: tuple[Any, ...], name: str, x: DTensor) -> bool:
        """Whether a DTensor leaf of a ZeRO state is a row piece: ZeRO-3's params, every moment."""
        if path[0] == "params" and not self.shards_params:
            return False
        if not self.zero.is_rows(name, x):  # type: ignore[union-attr]
            raise ValueError(
                f"TensorParallel.gather: {'/'.join(map(str, path))} is a DTensor of shape {tuple(x.shape)}, "
                f"not a row piece of {name!r} ({self.zero.row_shapes[name]}); was the state placed by this "  # type: ignore[union-attr]
                "strategy (tp.place)?"
            )
        return True

    def full_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole params (``TrainState.state_dict()``). Collective."""
        if self.shards_params:
            params = self.forward_params(params)
        return {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in params.items()}

    def forward_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The params a forward runs on (the eval step's): whole DTensors (ZeRO-3's gathered)."""
        return self.zero.whole(params) if self.shards_params else dict(params)  # type: ignore[union-attr]

    @property
    def num_params(self) -> int:
        """Parameter elements of the whole model."""
        return sum(math.prod(s) for s in self.shapes.values())

    def full_state(self, state: Any) -> Any:
        """:meth:`gather` (what a layout's readers call)."""
        return self.gather(state)

    def at_rest(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the optimizer updated (its row pieces under ZeRO) as the state keeps its params: the row
        pieces gathered whole under ZeRO-1/2, else as they are. Collective under ZeRO-1/2."""
        if self.zero is not None and not self.shards_params:
            return self.zero.whole(params)
        return dict(params)

    def _refuse_unshardable(self, state: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """ZeRO cuts each optimizer leaf of a param's shape into row pieces; a leaf named after a param
        with another shape (a factored moment) would stay whole while its gradient is a piece."""
        for path, x in leaves_with_paths(state.opt_state):
            name = path[-1] if path else None
            if (
                isinstance(x, torch.Tensor)
                and x.ndim > 0
                and name in shapes
                and tuple(x.shape) != shapes[name]
            ):
                raise ValueError(
                    f"TensorParallel.place: opt_state/{'/'.join(map(str, path))} has shape {tuple(x.shape)}, "
                    f"not the shape of param {name!r} {shapes[name]}: ZeRO over dp (sharding=) keeps row "
                    "pieces of elementwise optimizer states only; use an optimizer whose state has each "
                    "param's shape (adamw, sgd, lion, ...) or no sharding="
                )

    def _param_of(self, path: tuple[Any, ...], x: Any, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """The param a state leaf is (``params/<name>``) or a moment of (``opt_state/.../<name>`` with the
        param's shape), else None."""
        if not isinstance(x, torch.Tensor) or len(path) < 2 or path[0] not in ("params", "opt_state"):
            return None
        name = path[-1]
        if name not in self.placements or not isinstance(name, str):
            return None
        return name if path[0] == "params" or tuple(x.shape) == shapes[name] else None

    # ------------------------------------------------------------------ the step

    def gathering(self) -> contextlib.AbstractContextManager[Any]:
        """The forward and backward take plain tensors (the batch) as replicated; a compiled step gets
        that from :func:`functrain.distributed.tp_forward.tensor_parallel_forward`, entered by ``jit``."""
        if torch.compiler.is_dynamo_compiling():
            return contextlib.nullcontext()
        return implicit_replication()

    def params_whole(self, state: Any) -> dict[str, torch.Tensor]:
        """Whole plain params (the eager forward ``jit`` runs before its first trace)."""
        return self.full_params(state.params)

    def params_for_grad(self, state: Any) -> dict[str, torch.Tensor]:
        """The DTensor params the forward and backward run on: ZeRO-3's row pieces gathered over dp (and
        the replicated params over tp) outside the differentiated function."""
        self._refuse_batch_statistics()
        return self.forward_params(state.params)

    def _refuse_batch_statistics(self) -> None:
        """A BatchNorm training with running statistics on an input the plan splits (after a colwise layer)
        would keep its ``running_mean``/``running_var`` as they are in silence: DTensor redistributes the
        plain buffers to new local tensors and updates those. Refused for every such BatchNorm (whether
        its input is split is not known before the forward); checked once the step set the modes."""
        found = [
            f"{name} ({type(m).__name__})"
            for name, m in self._batchnorms
            if m.training and m.track_running_stats
        ]
        if found:
            raise ValueError(
                f"tensor parallelism: the model's BatchNorm {', '.join(found[:6])} trains with running "
                "statistics: where the plan splits its input (after a colwise layer), DTensor updates copies "
                "of running_mean and running_var, and the state's would stay as they are. Use LayerNorm, "
                "BatchNorm(..., track_running_stats=False), or freeze the BatchNorm "
                "(make_train_step(..., freeze_batchnorm=True), the Trainer's freeze.batchnorm: true)"
            )

    def micro_grads(self, state: Any, grads: Any, examples: Examples | None) -> Any:
        """ZeRO-2/3: a micro-batch's gradients reduce-scattered over dp at once (``grad * examples``
        summed, row pieces); otherwise kept whole."""
        if self.zero is None or self.level == "optimizer":
            return grads
        return {k: self.zero.wrap(k, g) for k, g in self._scatter(state, grads, examples).items()}

    def _scatter(self, state: Any, grads: Any, examples: Examples | None) -> dict[str, torch.Tensor]:
        assert self.zero is not None and examples is not None  # counts_examples with a dp axis
        master = {k: v.dtype for k, v in state.params.items()}
        return self.zero.scatter({k: self._as_param(k, g) for k, g in grads.items()}, master, examples)

    def opt_params(self, state: Any) -> dict[str, torch.Tensor]:
        """What the optimizer updates: the params, or under ZeRO this rank's row pieces of them."""
        if self.zero is None or self.shards_params:
            return dict(state.params)
        return self.zero.rows(state.params)

    def apply_full_gradients(self, state: Any, grads: Mapping[str, torch.Tensor]) -> Any:
        """``state.apply_gradients(grads)`` for a placed state: ``grads`` whole and already reduced (the
        same on every rank; plain, or DTensors of the mesh), placed as the params (a plain one cut
        locally), under ZeRO cut to this rank's row pieces, and the optimizer run as the train step runs
        it (the strategy's norms over the mesh)."""
        from functrain.optim import apply_gradients

        if set(grads) != set(state.params):
            raise ValueError(
                f"apply_gradients: the gradients name {sorted(set(grads) ^ set(state.params))[:6]} which the "
                "params do not, or lack them; give one gradient per param"
            )
        placed = {}
        for name, g in grads.items():
            want = self.placements[name]
            if isinstance(g, DTensor):
                placed[name] = g.redistribute(self.mesh, want)
            else:  # the same whole tensor on every rank: each keeps its part, no collective
                placed[name] = distribute_tensor(g.detach(), self.mesh, want, src_data_rank=None)
        if self.zero is not None:
            placed = self.zero.rows(placed)
        params, opt_state = apply_gradients(
            state.tx, placed, state.opt_state, self.opt_params(state), norm=self.norm
        )
        return state.replace(
            step=state.step + 1, params=self.params_at_rest(state, params), opt_state=opt_state
        )

    def params_at_rest(self, state: Any, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The updated params (row pieces under ZeRO) as the state keeps them."""
        return self.at_rest(params)

    def reduce(
        self,
        state: Any,
        grads: Any,
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        examples: Examples | None,
    ) -> Reduced:
        """Gradients placed as their params (a partial sum is all-reduced over the mesh); the loss and
        metrics, replicated DTensors, as this rank's plain tensors."""
        if state.loss_scale is not None:
            raise ValueError(
                "tensor parallelism: fp16 loss scaling is not supported (its overflow check would see this "
                "rank's parts of the gradients only, and the ranks could disagree on skipping a step); use "
                "precision='bf16'"
            )
        loss, metrics = _local(loss), {k: _local(v) for k, v in metrics.items()}
        if self.dp is None:
            return {k: self._as_param(k, g) for k, g in grads.items()}, loss, metrics, dict(buffers)
        assert examples is not None  # counts_examples
        _, loss, metrics, buffers, total = self.dp.combine(
            {}, loss, metrics, buffers, state.buffers, examples
        )
        if self.zero is None:
            grads = {k: self._as_param(k, g) for k, g in grads.items()}
            return self._dp_mean(grads, examples, total), loss, metrics, buffers
        # this rank's rows of the example-weighted sum over dp, divided by the global example count
        rows = self._scatter(state, grads, examples) if self.level == "optimizer" else _locals(grads)
        mean = {k: self.zero.wrap(k, g.div_(total.to(g.dtype))) for k, g in rows.items()}
        return mean, loss, metrics, buffers

    def _dp_mean(self, grads: Mapping[str, DTensor], n: Examples, total: torch.Tensor) -> dict[str, DTensor]:
        """The example-weighted mean over the data-parallel ranks of each rank's gradient parts, in the
        gradients' own dtype (one all-reduce per dtype), placed as before."""
        names = list(grads)
        local = {k: grads[k].to_local() for k in names}
        out: dict[str, DTensor] = {}
        by_dtype: dict[torch.dtype, list[str]] = {}
        for k in names:
            by_dtype.setdefault(local[k].dtype, []).append(k)
        for dtype, group in by_dtype.items():
            weight = torch.as_tensor(n, dtype=dtype, device=local[group[0]].device)
            # torch.where, not a product with 0: an empty batch's gradients may be NaN
            flat = torch.cat([torch.where(weight > 0, local[k] * weight, 0).reshape(-1) for k in group])
            summed = _collective("all_reduce", flat, "sum", group=self.dp.group) / total.to(dtype)
            for k, piece in zip(group, summed.split([local[k].numel() for k in group])):
                g = grads[k]
                out[k] = DTensor.from_local(
                    piece.reshape(local[k].shape), self.mesh, g.placements, run_check=False,
                    shape=g.shape, stride=g.stride(),
                )  # fmt: skip
        return {k: out[k] for k in names}

    def _as_param(self, name: str, g: torch.Tensor) -> torch.Tensor:
        if not isinstance(g, DTensor):
            raise TypeError(
                f"tensor parallelism: the gradient of {name!r} is a plain tensor; the state's params must be "
                "placed with tp.place(state)"
            )
        want = self.placements[name]
        return g if tuple(g.placements) == want else g.redistribute(self.mesh, want)

    def _norms(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-leaf L2 norms of the whole tensors (``functrain.optim.NormFn``): local norms, the split
        leaves' squares summed over the mesh in float64 (one all-reduce)."""
        local = [x.to_local() if isinstance(x, DTensor) else x for x in leaves]
        norms = list(foreach.norm(local))
        split = [i for i, x in enumerate(leaves) if isinstance(x, DTensor) and _is_split(x)]
        if not split:
            return norms
        squares = torch.stack([norms[i].to(torch.float64) for i in split]).square()
        total = _collective("all_reduce", squares, "sum", group=self.group).sqrt()
        for j, i in enumerate(split):
            norms[i] = total[j].to(norms[i].dtype)
        return norms

    def __repr__(self) -> str:
        split = sum(1 for p in self.placements.values() if not isinstance(p[0], Replicate))
        return f"TensorParallel(mesh size {self.mesh.size()}, {split} of {len(self.placements)} params split)"


def _locals(grads: Mapping[str, DTensor]) -> dict[str, torch.Tensor]:
    return {k: g.to_local() for k, g in grads.items()}


def _is_split(x: DTensor) -> bool:
    return any(isinstance(p, Shard) for p in x.placements)


def _local(x: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (the same on every rank)."""
    if not isinstance(x, DTensor):
        return x
    if not all(isinstance(p, Replicate) for p in x.placements):
        x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return x.to_local()


def tensor_parallel(
    model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None, *, sharding: Sharding | None = None
) -> TensorParallel:
    """The tensor-parallel strategy for ``model``: ``plan`` resolved to a placement per parameter over ``mesh``
    (a 1-D ``DeviceMesh``; default: every rank of the ``torchrun`` world). A 2-D mesh with dims named
    ``("dp", "tp")`` adds data parallelism over ``dp``: each tp group takes its own batch (the same on
    its tp ranks), and gradients, loss and metrics are averaged over ``dp`` weighted by examples, in the
    gradients' own dtype; ``place`` gives every replica the first tp group's values.

    ``sharding=fully_shard(mesh["dp"], level=...)`` (2-D mesh only) adds ZeRO over ``dp``: ``"optimizer"``
    and ``"grads"`` keep 1/(dp * tp) of every optimizer moment per rank (the gradients reduce-scattered
    over dp once per step, or per micro-batch), ``"params"`` the params too, gathered outside the
    gradient for the step (its peak holds the tp parts whole; :mod:`functrain.distributed.tp_sharding`).
    Every level compiles (``ft.jit``: one graph, one compile per step).
    ``blocks=`` (gathers inside the gradient) and ``param_dtype=`` are refused (use ``precision="bf16"``).

    Refuses a plan entry that matches no submodule, a style other than ``"colwise"``, ``"rowwise"``,
    ``"replicate"``, a split of a layer that is not an ``nn.Linear``, ``nn.Embedding`` or Hugging Face
    ``Conv1D`` (naming its path), a split dim the mesh size does not divide, and a model with dropout
    (``nn.Dropout`` modules of ``p > 0``, or a Hugging Face ``config.attention_dropout > 0``: the ranks
    would draw different masks for the activations they share). A ``F.dropout`` call of the model's own
    is not seen: do not make one. A plan entry reaching a tied weight by its other name (GPT-2's
    ``lm_head``, tied to ``transformer.wte``) is refused unless it places the weight as the entry for its
    first name does (name that layer instead). The step refuses a BatchNorm training with running
    statistics (on an input the plan splits they would not be updated): use LayerNorm,
    ``track_running_stats=False`` or ``make_train_step(..., freeze_batchnorm=True)``.

    Example:
        >>> tp = tensor_parallel(model, {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"})  # doctest: +SKIP
        >>> state = tp.place(ft.TrainState.create(model, ft.optim.adamw(1e-3)))  # doctest: +SKIP
        >>> step = ft.jit(ft.make_train_step(model, loss_fn, strategy=tp))  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"tensor_parallel: model must be an nn.Module, got {type(model).__name__}")
    _refuse_dropout(model)
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError(
                "tensor_parallel: no mesh and no process group; run under torchrun after "
                "functrain.distributed.initialize(), or pass a DeviceMesh"
            )
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"tensor_parallel: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        if sharding is not None:
            raise ValueError(
                "tensor_parallel: sharding= shards over the dp axis of a 2-D mesh, and this mesh is 1-D (tp "
                "only); pass init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), or no sharding="
            )
        root = getattr(mesh, "_get_root_mesh", lambda: mesh)()  # not mesh: a mesh2d["tp"] (see _own_mesh)
        return TensorParallel(model, plan, mesh if root is mesh else _own_mesh(mesh))
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or set(names) != {"dp", "tp"}:
        raise ValueError(
            "tensor_parallel: mesh must be 1-D (the tensor-parallel ranks) or 2-D with dims named 'dp' and "
            f"'tp' (init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))); got {mesh.ndim}-D "
            f"named {names}"
        )
    if sharding is not None:
        _check_sharding(sharding, mesh["dp"])
    return TensorParallel(
        model, plan, _own_mesh(mesh["tp"]), dp_group=mesh["dp"].get_group(), sharding=sharding
    )


# one root mesh per tp group (_own_mesh), keyed by the sub-mesh (equal for equal 2-D meshes) and its
# group's name (a new process group, a new mesh)
_OWN_MESHES: dict[tuple[DeviceMesh, str], DeviceMesh] = {}


def _own_mesh(sub: DeviceMesh) -> DeviceMesh:
    """The tp axis of a 2-D mesh (made here, or given as ``mesh2d["tp"]``) as a 1-D mesh of its own (a root over the same process group), one object
    per group, which every strategy's DTensors live on. Not the sub-mesh ``mesh["tp"]``: each call of that
    makes a new object, equal to the others, and DTensor's sharding-propagation cache gives an op's output
    the mesh object of the first equal op it saw. A step traced after another strategy's then returns
    DTensors on that earlier object, which torch 2.13's make_fx, not finding it among the graph's inputs,
    derives from the input DTensors' sub-mesh by a ``device_mesh._get_submesh`` node that inductor cannot
    lower ("is not an OpOverload"): the second TP x ZeRO step compiled in a process failed. One object per
    group keeps the outputs on the inputs' mesh (one compile per step); a root mesh met untracked would be
    a graph constant, which inductor takes."""
    key = (sub, sub.get_group().group_name)
    if key not in _OWN_MESHES:
        _OWN_MESHES[key] = DeviceMesh.from_group(
            sub.get_group(), sub.device_type, mesh_dim_names=sub.mesh_dim_names
        )
    return _OWN_MESHES[key]


def _check_sharding(sharding: Sharding, dp: DeviceMesh) -> None:
    """ZeRO's request must shard over this mesh's dp axis, and ask for nothing TP cannot do right."""
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"tensor_parallel: sharding must come from functrain.distributed.fully_shard(...), got "
            f"{type(sharding).__name__}"
        )
    ranks = dp.mesh.flatten().tolist()
    if sharding.group is None or dist.get_process_group_ranks(sharding.group) != ranks:
        raise ValueError(
            f"tensor_parallel: sharding= must shard over the mesh's dp axis (ranks {ranks} here), got "
            f"{sharding!r}; pass fully_shard(mesh['dp'], level=...)"
        )
    if sharding.blocks is not None:
        raise ValueError(
            "tensor_parallel: fully_shard(blocks=...) is not supported with tensor parallelism: the blocks "
            "gather their params inside the differentiated function, and making a gathered tp part a DTensor "
            "there needs DTensor.from_local, an autograd.Function without setup_context, which torch.func's "
            "transforms refuse; use fully_shard(mesh['dp'], level='params') without blocks (gathered for "
            "the whole step, outside the gradient)"
        )
    if sharding.param_dtype is not None:
        raise ValueError(
            "tensor_parallel: fully_shard(param_dtype=...) is not supported with tensor parallelism; "
            "compute in bf16 with float32 params by make_train_step(..., precision='bf16')"
        )


def _refuse_dropout(model: nn.Module) -> None:
    """Dropout would make the ranks' copies of the replicated weights drift apart in silence: DTensor
    draws a replicated activation's mask from each rank's own generator (its RNG tracker, which keeps
    ranks in step, runs on CUDA-like devices only, and ``functrain.jit`` seeds every rank differently),
    so each rank computes another gradient for a weight all ranks believe they share."""
    found = [
        f"{name or type(model).__name__} (p={m.p})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    # Hugging Face's attention functions read this float and call F.dropout (no module to find)
    attention = getattr(getattr(model, "config", None), "attention_dropout", None)
    if isinstance(attention, float) and attention > 0:
        found.append(f"config.attention_dropout={attention}")
    if found:
        raise ValueError(
            f"tensor_parallel: the model has dropout ({', '.join(found[:6])}): each rank would draw its own "
            "masks for activations the ranks share, and their copies of the replicated weights would drift "
            "apart; set every dropout probability to 0 (nn.Dropout(p=0.0), or the Hugging Face "
            "config's dropout fields)"
        )
