"""Start every rank from the same state, and check that they still agree.

Data parallelism needs identical parameters, buffers and optimizer state on every rank before the first
step: the all-reduced gradient then keeps them identical. Seeding every rank alike usually gives that,
but a model initialised from the global RNG after anything rank-dependent touched it does not.
:func:`replicate` makes it certain by broadcasting rank 0's state (once, on the host, outside the step).

Example:
    >>> import torch, functrain as ft
    >>> from functrain import distributed
    >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1))
    >>> state = distributed.replicate(state)  # no process group: returned as it is
    >>> distributed.assert_replicated(state.params)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from functrain import tree
from functrain.distributed.env import is_distributed

__all__ = ["NotReplicatedError", "assert_replicated", "replicate"]


class NotReplicatedError(RuntimeError):
    """Ranks hold different values where they must agree; the message names the leaves."""


def _comm_device(x: torch.Tensor) -> torch.device:
    # NCCL only moves CUDA tensors: the state's CPU leaves (step, rng) travel through the current GPU.
    if dist.get_backend() == "nccl" and x.device.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    return x.device


def replicate(state: Any, *, src: int = 0, device: str | torch.device | None = None) -> Any:
    """Every tensor of ``state`` (a pytree) as rank ``src`` holds it, optionally moved to ``device`` first.

    Call it once after creating (or restoring) the state, before training; every rank must call it.

    Example:
        >>> import torch, functrain as ft
        >>> from functrain import distributed
        >>> env = distributed.initialize()  # under torchrun  # doctest: +SKIP
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1), seed=0)
        >>> replicate(state) is state  # one process: nothing to copy (under torchrun: device=env.device)
        True
    """
    if device is not None:
        state = (
            state.to(device)
            if hasattr(state, "to") and not isinstance(state, torch.Tensor)
            else tree.map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, state)
        )
    if not is_distributed():
        return state

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        comm = _comm_device(x)
        buf = x.detach().to(comm, copy=True).contiguous()
        dist.broadcast(buf, src=src)
        return buf.to(x.device)

    return tree.map(one, state)


def _fingerprints(leaves: list[torch.Tensor]) -> torch.Tensor:
    # Exact comparison: the raw bits of each leaf, summed as int64 after a position-dependent mix so that
    # permuted values do not cancel out. Computed in float64 bit space, so any single-bit change shows.
    out = []
    for x in leaves:
        flat = x.detach().reshape(-1)
        if flat.numel() == 0:
            out.append(torch.zeros((), dtype=torch.int64, device=x.device))
            continue
        if flat.is_floating_point() or flat.is_complex():
            bits = (
                flat.to(torch.float64).view(torch.int64)
                if not flat.is_complex()
                else torch.view_as_real(flat).to(torch.float64).view(torch.int64).reshape(-1)
            )
        else:
            bits = flat.to(torch.int64)
        mix = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) * 0x9E3779B1
        out.append(((bits ^ mix) * 0x100000001B3).sum())
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def assert_replicated(values: Any, *, what: str = "state") -> None:
    """Raise :class:`NotReplicatedError` unless every rank holds bit-identical tensors in ``values``.

    A debugging check (it synchronises the host): use it after :func:`replicate`, after a restore, or
    at the end of a run.

    Example:
        >>> assert_replicated({"w": torch.ones(2)})
    """
    if not is_distributed():
        return
    paths = tree.paths(values)
    tensors = [(p, x) for p, x in zip(paths, tree.leaves(values)) if isinstance(x, torch.Tensor)]
    if not tensors:
        return
    local = _fingerprints([x for _, x in tensors]).cpu()
    comm = _comm_device(local)
    gathered = [torch.empty_like(local, device=comm) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local.to(comm))
    table = torch.stack([g.cpu() for g in gathered])
    differ = (table != table[0]).any(dim=0)
    if bool(differ.any()):
        names = [p for (p, _), d in zip(tensors, differ.tolist()) if d]
        raise NotReplicatedError(
            f"{what}: ranks disagree on {len(names)} tensor(s): {', '.join(names[:10])}. Start every rank "
            "from functrain.distributed.replicate(state), and train with make_train_step(..., "
            "gradient_reducer=functrain.distributed.gradient_reducer(...)) so updates stay identical"
        )
