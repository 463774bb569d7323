"""The process group of a ``torchrun`` launch: read the environment, initialise, place, tear down.

``torchrun --nproc_per_node=N script.py`` starts one process per device and sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. :func:`initialize` reads them,
creates the default process group (``nccl`` when CUDA is available, ``gloo`` on the CPU) and picks the
process's device (``cuda:LOCAL_RANK`` or ``cpu``). Without ``WORLD_SIZE`` it is a one-process run and no
group is created, so the same script runs with ``python`` and with ``torchrun``.

Example:
    >>> from functrain import distributed
    >>> with distributed.initialize() as env:  # a plain `python` run: one process, nothing to set up
    ...     env.rank, env.world_size, env.is_main_process
    (0, 1, True)
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from functrain.distributed.teardown import wait_for_gloo_workers_at_exit

__all__ = [
    "DistributedEnv",
    "DistributedSetupError",
    "barrier",
    "initialize",
    "is_distributed",
    "is_main_process",
    "local_rank",
    "rank",
    "world_size",
]


class DistributedSetupError(RuntimeError):
    """The launch environment is incomplete or inconsistent; the message names the variable to fix."""


@dataclasses.dataclass
class DistributedEnv:
    """This process's place in the run: ``rank`` of ``world_size``, its ``device`` and ``backend``.

    Use it as a context manager to destroy the process group on exit (only a group that
    :func:`initialize` created itself is destroyed).

    Example:
        >>> env = DistributedEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        >>> env.is_main_process, env.is_distributed
        (True, False)
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None = None
    owns_group: bool = False

    @property
    def is_main_process(self) -> bool:
        """True on rank 0: the process that logs and writes checkpoints."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group with more than one process is running."""
        return self.world_size > 1

    def shutdown(self) -> None:
        """Destroy the process group if :func:`initialize` created it (idempotent)."""
        if self.owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False

    def __enter__(self) -> DistributedEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _read_int(environ: Mapping[str, str], name: str, why: str) -> int:
    value = environ.get(name)
    if value is None:
        raise DistributedSetupError(
            f"WORLD_SIZE is set but {name} is missing ({why}); launch with `torchrun --nproc_per_node=N "
            f"...`, which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or set {name} yourself"
        )
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(f"{name}={value!r} is not an integer") from None


def _default_device(local_rank: int, backend: str | None) -> torch.device:
    if torch.cuda.is_available() and backend != "gloo":
        if local_rank >= torch.cuda.device_count():
            raise DistributedSetupError(
                f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} CUDA devices; "
                "start at most that many processes per node (torchrun --nproc_per_node)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def initialize(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: datetime.timedelta | None = None,
    environ: Mapping[str, str] | None = None,
) -> DistributedEnv:
    """Join the ``torchrun`` process group (or describe a one-process run) and pick this process's device.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... (default: ``nccl`` with CUDA, else ``gloo``).
        device: this process's device (default: ``cuda:LOCAL_RANK`` with CUDA, else ``cpu``).
        timeout: how long collectives wait for a missing rank before failing.
        environ: the environment to read (default ``os.environ``).

    Returns:
        a :class:`DistributedEnv`; ``with initialize() as env:`` tears the group down on exit. A group
        that already exists (initialised by someone else) is reused and left alone.

    Example:
        >>> env = initialize(environ={})  # no WORLD_SIZE: a single process
        >>> env.world_size
        1
    """
    environ = os.environ if environ is None else environ
    if dist.is_available() and dist.is_initialized():
        r, n = dist.get_rank(), dist.get_world_size()
        local = int(environ.get("LOCAL_RANK", r))
        used = dist.get_backend()
        dev = torch.device(device) if device is not None else _default_device(local, used)
        _set_cuda_device(dev)
        wait_for_gloo_workers_at_exit()
        return DistributedEnv(r, n, local, dev, used, owns_group=False)
    if "WORLD_SIZE" not in environ:
        for name in ("RANK", "LOCAL_RANK"):
            if name in environ:
                raise DistributedSetupError(
                    f"{name} is set but WORLD_SIZE is missing; launch with torchrun, or set WORLD_SIZE too"
                )
        dev = torch.device(device) if device is not None else _default_device(0, backend)
        _set_cuda_device(dev)
        return DistributedEnv(0, 1, 0, dev, None, owns_group=False)

    n = _read_int(environ, "WORLD_SIZE", "the number of processes")
    r = _read_int(environ, "RANK", "this process's global rank")
    local = _read_int(environ, "LOCAL_RANK", "this process's index on its node, which picks its GPU")
    if n < 1 or not 0 <= r < n:
        raise DistributedSetupError(f"RANK={r} must be in [0, WORLD_SIZE={n})")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in environ:
            raise DistributedSetupError(
                f"{name} is missing: the ranks cannot find each other. torchrun sets it; by hand, set "
                "MASTER_ADDR to rank 0's host and MASTER_PORT to a free port"
            )
    if not dist.is_available():
        raise DistributedSetupError("this PyTorch build has no torch.distributed; install a build with it")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and device is None else "gloo"
    dev = torch.device(device) if device is not None else _default_device(local, backend)
    _set_cuda_device(dev)
    kwargs: dict[str, Any] = {"backend": backend, "rank": r, "world_size": n}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if dev.type == "cuda" and backend == "nccl":
        kwargs["device_id"] = dev  # binds NCCL to this GPU up front: no guessing, no hang on first use
    dist.init_process_group(**kwargs)
    wait_for_gloo_workers_at_exit()  # a gloo worker still releasing a collective at exit aborts the process
    return DistributedEnv(r, n, local, dev, backend, owns_group=True)


def _set_cuda_device(device: torch.device) -> None:
    # NCCL and the CUDA caching allocator use the current device: without this every rank would
    # allocate on cuda:0.
    if device.type == "cuda":
        torch.cuda.set_device(device)


def is_distributed() -> bool:
    """True inside a process group of more than one process.

    Example:
        >>> is_distributed()
        False
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without a process group).

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 without a process group).

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    """This process's index on its node (``LOCAL_RANK``; 0 without one).

    Example:
        >>> local_rank()
        0
    """
    return int(os.environ.get("LOCAL_RANK", 0)) if dist.is_available() and dist.is_initialized() else 0


def is_main_process() -> bool:
    """True on rank 0 (and in a one-process run): the process that logs and writes checkpoints.

    Example:
        >>> is_main_process()
        True
    """
    return rank() == 0


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for in a one-process run).

    Example:
        >>> barrier()
    """
    if is_distributed():
        dist.barrier()
