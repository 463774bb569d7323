"""`TrainState`: everything a training run changes, as one immutable pytree.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    >>> state.num_params
    10
    >>> sorted(state.params)
    ['bias', 'weight']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from functrain import random, tree
from functrain.core.variables import model_variables
from functrain.distributed.sharding import shard_variables
from functrain.optim import GradientTransformation, apply_gradients

__all__ = ["TrainState"]


def _describe(tensors: Mapping[str, torch.Tensor] | Any) -> str:
    xs = [x for x in tree.leaves(tensors) if isinstance(x, torch.Tensor)]
    if not xs:
        return "none"
    n = sum(x.numel() for x in xs)
    dtypes = sorted({str(x.dtype).removeprefix("torch.") for x in xs})
    devices = sorted({str(x.device) for x in xs})
    return f"{_human(n)} in {len(xs)} tensors ({', '.join(dtypes)}; {', '.join(devices)})"


def _human(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


@tree.struct
class TrainState:
    """The whole training state: params, buffers, optimizer state, step and random key.

    Fields:
        step: 0-d ``int64`` CPU tensor, the number of optimizer updates applied so far.
        params: trainable parameters by ``named_parameters()`` name.
        buffers: buffers (BatchNorm statistics, ...) and frozen (``requires_grad=False``) parameters.
        opt_state: the optimizer's state, a pytree.
        rng: the run's random key (``functrain.random``); each step's randomness derives from
            ``(rng, step, rank)``.
        loss_scale: fp16 dynamic loss scaling state (``functrain.precision.LossScale``) or ``None``.
        metrics: training metric states accumulated by the step (``functrain.metrics``) or ``None``.
        tx: the optimizer (static: not a leaf, not saved).
        tied: ``(alias, canonical)`` names of tied tensors (static), so exports recreate every key.
        non_persistent: buffer names that ``state_dict()`` omits (static).
        layout: a ``functrain.distributed.ShardLayout`` when params and/or optimizer state are sharded
            over ranks (static; made by ``TrainState.create(..., sharding=fully_shard(...))``, the request
            in ``layout.request``), else ``None``.

    The state is never mutated: ``replace(...)``, ``apply_gradients(...)`` and the step functions return
    new states. ``step`` and ``rng`` stay on the CPU whatever device the rest lives on, so the host reads
    them without waiting for the device.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(3, 1)
        >>> state = TrainState.create(model, ft.optim.adam(1e-3), seed=1)
        >>> grads = tree.zeros_like(state.params)
        >>> int(state.apply_gradients(grads).step)
        1
    """

    step: torch.Tensor
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    rng: torch.Tensor
    loss_scale: Any = None
    metrics: Any = None
    tx: GradientTransformation | None = tree.field(static=True, default=None)
    tied: tuple[tuple[str, str], ...] = tree.field(static=True, default=())
    non_persistent: tuple[str, ...] = tree.field(static=True, default=())
    layout: Any = tree.field(static=True, default=None)

    # ------------------------------------------------------------------------------------ creation

    @classmethod
    def create(
        cls,
        model: nn.Module,
        tx: GradientTransformation,
        *,
        seed: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        loss_scale: Any = None,
        metrics: Any = None,
        copy: bool = True,
        sharding: Any = None,
    ) -> TrainState:
        """A fresh state from a module's current weights (copied, so the module is not touched, unless
        ``copy=False``).

        Args:
            model: the ``nn.Module`` whose parameters and buffers start the run.
            tx: the optimizer, a ``functrain.optim.GradientTransformation``.
            seed: seeds the state's random key (dropout, data order).
            device, dtype: where and in which floating dtype params, buffers and optimizer state live.
            loss_scale: a ``functrain.precision.LossScale`` for fp16 training.
            metrics: the initial training metric state (``collection.empty()``).
            copy: ``False`` makes params and buffers share the module's memory instead of copying it:
                no second copy of the weights, which a large model needs. A pure step never writes to
                them; a donating step (``jit(..., donate=True)``) then trains the module's own tensors
                in place, as ``torch.optim`` does. A ``device`` or ``dtype`` change still copies.
            sharding: ``functrain.distributed.fully_shard(...)``: rank 0's weights are broadcast leaf by
                leaf (other ranks may hold the model on the meta device) and cut to this rank's rows
                before the optimizer state is made, so that state is sharded from the start.

        Example:
            >>> import functrain as ft
            >>> state = TrainState.create(torch.nn.Linear(2, 2), ft.optim.sgd(0.1), device="cpu")
            >>> big = torch.nn.Linear(2, 2)
            >>> shared = TrainState.create(big, ft.optim.sgd(0.1), copy=False)
            >>> shared.params["weight"].data_ptr() == big.weight.data_ptr()
            True
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"TrainState.create: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                "TrainState.create: tx must be a functrain.optim.GradientTransformation (for example "
                f"functrain.optim.adamw(1e-3)), got {type(tx).__name__}"
            )
        params, buffers, tied, non_persistent = model_variables(model, copy=copy and sharding is None)
        layout = None
        if sharding is not None:
            params, buffers, layout = shard_variables(params, buffers, sharding, device=device, dtype=dtype)
        elif device is not None or dtype is not None:
            params = _to(params, device, dtype)
            buffers = _to(buffers, device, dtype)
        return cls(
            step=torch.zeros((), dtype=torch.int64),
            params=params,
            buffers=buffers,
            opt_state=tx.init(params if layout is None else layout.local(params)),
            rng=random.key(seed),
            # on the params' device, as ``to`` puts them: a CPU loss scale would mix devices in the step
            loss_scale=_to(loss_scale, device, None),
            metrics=_to(metrics, device, None),
            tx=tx,
            tied=tied,
            non_persistent=non_persistent,
            layout=layout,
        )

    # ------------------------------------------------------------------------------------ updates

    def apply_gradients(self, grads: Mapping[str, torch.Tensor]) -> TrainState:
        """One optimizer update with ``grads`` (a tree shaped like ``params``); ``step`` advances by one.

        A sharded or tensor-parallel state (``layout``) takes the whole gradients, already reduced (the
        same on every rank; a tensor-parallel state also DTensors of its mesh), and each rank updates its
        parts with the norms over every rank (clipping); collective then.

        Example:
            >>> import functrain as ft
            >>> state = TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(1.0))
            >>> new = state.apply_gradients({k: torch.ones_like(v) for k, v in state.params.items()})
            >>> bool((new.params["bias"] == state.params["bias"] - 1).all())
            True
        """
        if self.tx is None:
            raise ValueError("apply_gradients: this state has no optimizer (tx); create it with one")
        if self.layout is not None:  # whole (already reduced) grads: each rank updates its parts
            return self.layout.apply_full_gradients(self, grads)
        params, opt_state = apply_gradients(self.tx, grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state)

    # ------------------------------------------------------------------------------------ moving

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> TrainState:
        """Move params, buffers, optimizer, loss-scale and metric states to ``device`` and/or cast their
        floating tensors to ``dtype``. ``step`` and ``rng`` stay on the CPU.

        Example:
            >>> import functrain as ft
            >>> state = TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1))
            >>> state.to(dtype=torch.float64).params["weight"].dtype
            torch.float64
        """
        return self.replace(
            params=_to(self.params, device, dtype),
            buffers=_to(self.buffers, device, dtype),
            opt_state=_to(self.opt_state, device, dtype),
            loss_scale=_to(self.loss_scale, device, None),
            metrics=_to(self.metrics, device, None),
        )

    @property
    def device(self) -> torch.device:
        """The device of the parameters."""
        for x in tree.leaves(self.params):
            return x.device
        return torch.device("cpu")

    # ------------------------------------------------------------------------------------ export

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Params and persistent buffers under the module's own names (tied aliases included), ready for
        ``model.load_state_dict(state.state_dict())``.

        Example:
            >>> import functrain as ft
            >>> model = torch.nn.Linear(2, 1)
            >>> model.load_state_dict(TrainState.create(model, ft.optim.sgd(0.1)).state_dict())
            <All keys matched successfully>
        """
        out: dict[str, torch.Tensor] = {}
        out.update(self.params if self.layout is None else self.layout.full_params(self.params))
        out.update({k: v for k, v in self.buffers.items() if k not in self.non_persistent})
        for alias, canonical in self.tied:
            if canonical in out and alias not in self.non_persistent:
                out[alias] = out[canonical]
        return out

    def load_into(self, model: nn.Module, strict: bool = True) -> nn.Module:
        """Copy this state's weights into ``model`` (in place) and return it."""
        model.load_state_dict(self.state_dict(), strict=strict)
        return model

    @property
    def num_params(self) -> int:
        """Number of trainable parameter elements (of the whole model when sharded)."""
        return tree.num_elements(self.params) if self.layout is None else self.layout.num_params

    def __repr__(self) -> str:
        opt = type(self.opt_state).__name__ if self.opt_state is not None else "None"
        lines = [
            f"TrainState(step={self.step.tolist()},",  # a list for an ensemble's stacked steps
            f"  params={_describe(self.params)},",
            f"  buffers={_describe(self.buffers)},",
            f"  opt_state={opt}: {_describe(self.opt_state)},",
        ]
        if self.loss_scale is not None:
            lines.append(f"  loss_scale={self.loss_scale!r},")
        if self.metrics is not None:
            lines.append(f"  metrics={_describe(self.metrics)},")
        lines.append(f"  rng={self.rng.tolist()})")
        return "\n".join(lines)


def _to(t: Any, device: str | torch.device | None, dtype: torch.dtype | None) -> Any:
    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        cast = dtype if dtype is not None and x.is_floating_point() else None
        return x.to(device=device, dtype=cast)

    return tree.map(one, t)
