"""Checkpoints of a sharded state: one functrain file per rank plus a manifest, resharded on restore.

Layout of ``directory/step_<N>.shards/``::

    rank_00000_of_00002.ckpt   rank 0's local tree (its shards, and the replicated leaves)
    rank_00001_of_00002.ckpt   rank 1's
    manifest.ckpt              the commit point: world size, files, every sharded leaf's global shape

Every file is an ordinary functrain checkpoint (msgpack, checksummed, no pickle). Each rank writes its
own file atomically; rank 0 writes the manifest only after every rank has reported its file durable (a
gather of success flags), so a save killed on any rank leaves no manifest and the previous step stays
``latest`` for every reader. Each rank file names its rank and world size in its header, and a restore
refuses a file in the wrong slot: a writer that put one rank's shard under every name (the way
``torch.distributed.checkpoint`` silently keeps one rank's plain local tensor) cannot pass unnoticed.

A shard is the leaf's rows ``[r * k, (r + 1) * k)`` after zero-padding dim 0 to a multiple of the world
size, so a restore on any world size reads, for each leaf, only the rows its new block needs from the
files that hold them (one saved shard in memory at a time); with no process group (or ``target=None``)
the whole state is assembled. A tensor-parallel state is refused (save and restore): it has no rows of
its own, it is saved whole by ``CheckpointManager`` (:mod:`functrain.checkpoint.placed`).

Example:
    >>> save_sharded("run", 100, state)  # every rank calls it  # doctest: +SKIP
    >>> state = restore_sharded("run", target=state)  # any world size  # doctest: +SKIP
    >>> full = restore_sharded("run")  # plain containers, no process group needed  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from functrain import tree
from functrain.checkpoint import file as checkpoint_file
from functrain.checkpoint import format as fmt
from functrain.checkpoint import structure
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.folder import CheckpointFolder
from functrain.checkpoint.onto import fit_checkpoint_hint
from functrain.checkpoint.placed import placed_states
from functrain.checkpoint.shard_shapes import WHOLE_SHAPE, sharded_leaves, sharded_states
from functrain.core.tree_walk import Path, leaves_with_paths, rebuild
from functrain.distributed.sharding import local_rows

__all__ = [
    "ShardedCheckpointManager",
    "latest_sharded",
    "remove_uncommitted",
    "restore_sharded",
    "save_sharded",
    "sharded_steps",
]

MANIFEST = "manifest.ckpt"
_DIR = re.compile(r"^step_(\d+)\.shards$")
_KEY = "functrain_sharded"
# a param leaf's path as tree.path_str writes it: "params.w", "state.params['fc.weight']"
_PARAM = re.compile(r"(^|\.)params(\[[^\]]*\]|\.[A-Za-z_]\w*)$")


def _step_dir(directory: str | os.PathLike[str], step: int) -> str:
    return os.path.join(os.fspath(directory), f"step_{step:010d}.shards")


def _rank_file(rank: int, world_size: int) -> str:
    return f"rank_{rank:05d}_of_{world_size:05d}.ckpt"


def _group_of(obj: Any) -> tuple[Any, int, int]:
    found = sharded_states(obj)
    layout = found[0][1].layout if found else None
    if layout is not None:
        s = layout.request
        return s.group, s.rank, s.world_size
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def _refuse_placed(obj: Any, what: str) -> None:
    """A tensor-parallel state has no rows of its own to write: it is saved whole (its strategy gathers it),
    so each rank's file would hold one more whole copy and a restore would not place it."""
    found = placed_states(obj)
    if found:
        where = tree.path_str(found[0][0]) if found[0][0] else "the state"
        raise CheckpointError(
            f"{what}: {where} is a tensor-parallel state; sharded checkpoints hold each rank's rows of a "
            "ZeRO-sharded state, and a tensor-parallel state is saved whole (gathered over its mesh) and "
            "placed on load: use ft.checkpoint.save / CheckpointManager (every rank calls them; one file, "
            "resumable on any layout)"
        )


def _all_ok(ok: bool, group: Any, world_size: int) -> bool:
    if world_size == 1:
        return ok
    flags: list[Any] = [None] * world_size
    dist.all_gather_object(flags, bool(ok), group=group)
    return all(flags)


def save_sharded(
    directory: str | os.PathLike[str],
    step: int,
    state: Any,
    *,
    metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    fsync: bool = True,
) -> str:
    """Save a (sharded) state as the checkpoint of ``step``; every rank of the state's group calls it.

    Returns the step's folder. The manifest is written last, by rank 0, once every rank's file is
    durable; until then the step is not a checkpoint (``latest_sharded`` skips it).

    Example:
        >>> save_sharded("run", int(state.step), state, metrics={"loss": 0.3})  # doctest: +SKIP
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"save_sharded: step={step!r} must be a non-negative int")
    _refuse_placed(state, "save_sharded")
    group, rank, world = _group_of(state)
    folder = _step_dir(directory, step)
    if rank == 0:
        with contextlib.suppress(FileNotFoundError):  # re-saving a step: uncommit it first
            os.remove(os.path.join(folder, MANIFEST))
        os.makedirs(folder, exist_ok=True)
    if world > 1:
        dist.barrier(group=group)
    error: BaseException | None = None
    try:
        checkpoint_file.save(
            os.path.join(folder, _rank_file(rank, world)),
            state,
            step=step,
            metadata={_KEY: {"rank": rank, "world_size": world}},
            fsync=fsync,
        )
    except (OSError, CheckpointError) as caught:
        error = caught
    if not _all_ok(error is None, group, world):
        if error is not None:
            raise error
        raise CheckpointError(f"{folder}: another rank failed to write its shard; step {step} not committed")
    if rank == 0:
        sharded = sharded_leaves(state)
        manifest = {
            "world_size": world,
            "files": [_rank_file(r, world) for r in range(world)],
            "sharded": {tree.path_str(p): list(shape) for p, shape in sharded.items()},
        }
        checkpoint_file.save(
            os.path.join(folder, MANIFEST),
            {},
            step=step,
            metrics=metrics,
            metadata={**dict(metadata or {}), _KEY: manifest},
            fsync=fsync,
        )
    if world > 1:
        dist.barrier(group=group)
    return folder


def sharded_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Steps with a committed manifest in ``directory``, ascending.

    Example:
        >>> sharded_steps("no/such/folder")
        []
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for name in names if (m := _DIR.match(name))]
    return sorted(s for s in steps if os.path.exists(os.path.join(_step_dir(directory, s), MANIFEST)))


def latest_sharded(directory: str | os.PathLike[str]) -> int | None:
    """The newest committed step whose manifest reads, or ``None``.

    Example:
        >>> latest_sharded("no/such/folder") is None
        True
    """
    for step in reversed(sharded_steps(directory)):
        try:
            _manifest(directory, step)
        except CheckpointError:
            continue
        return step
    return None


def remove_uncommitted(directory: str | os.PathLike[str]) -> list[int]:
    """Delete step folders without a manifest (saves that never committed); returns their steps.
    Call it on one rank, when no save is running."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            m = _DIR.match(name)
            if m and not os.path.exists(os.path.join(directory, name, MANIFEST)):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
                removed.append(int(m.group(1)))
    return sorted(removed)


def _manifest_header(directory: str | os.PathLike[str], step: int) -> fmt.CheckpointHeader:
    """The header of ``step``'s manifest (its metrics and metadata); raises unless it is one."""
    path = os.path.join(_step_dir(directory, step), MANIFEST)
    header = checkpoint_file.read_header(path)
    if not isinstance(header.metadata.get(_KEY), dict) or header.step != step:
        raise CheckpointError(f"{path} is not the manifest of a sharded checkpoint of step {step}")
    return header


def _manifest(directory: str | os.PathLike[str], step: int) -> dict[str, Any]:
    return _manifest_header(directory, step).metadata[_KEY]


class _Source:
    """The saved checkpoint: its rank files' headers and the global shape of each leaf."""

    def __init__(self, directory: str | os.PathLike[str], step: int) -> None:
        self.folder = _step_dir(directory, step)
        manifest = _manifest(directory, step)
        self.world_size = int(manifest["world_size"])
        self.sharded = {p: tuple(shape) for p, shape in manifest["sharded"].items()}
        self.files = [os.path.join(self.folder, f) for f in manifest["files"]]
        self.headers = []
        for r, path in enumerate(self.files):
            header = checkpoint_file.read_header(path)
            slot = header.metadata.get(_KEY, {})
            if slot.get("rank") != r or slot.get("world_size") != self.world_size:
                raise CheckpointError(
                    f"{path}: holds rank {slot.get('rank')} of {slot.get('world_size')} where the manifest "
                    f"expects rank {r} of {self.world_size}: the shards were mixed up; this checkpoint "
                    "cannot be restored"
                )
            self.headers.append(header)
        self.index = {info.path: i for i, info in enumerate(self.headers[0].tensors)}

    def rows_of(self, where: str) -> int:
        shape = self.sharded[where]
        return -(-(shape[0] if shape else 1) // self.world_size)

    def read(self, wanted: Mapping[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """``{path: rows [start, stop) of the saved global leaf}`` for sharded leaves (padding rows
        included as zeros) and ``{path: whole leaf}`` for replicated ones (``(0, -1)``)."""
        out: dict[str, torch.Tensor] = {}
        for r, (path, header) in enumerate(zip(self.files, self.headers)):
            picks: dict[int, str] = {}
            for where, (start, stop) in wanted.items():
                if where not in self.index:
                    continue
                if where in self.sharded:
                    k = self.rows_of(where)
                    if start < (r + 1) * k and stop > r * k:
                        picks[self.index[where]] = where
                elif r == 0:
                    picks[self.index[where]] = where
            if not picks:
                continue
            with checkpoint_file.open_for_reading(path) as file:
                fmt.read_header(file, name=path)
                for i, tensor in fmt.read_tensors(
                    file, header, name=path, select=lambda i, _, picks=picks: i in picks
                ):
                    if tensor is None:
                        continue
                    where = picks[i]
                    if where not in self.sharded:
                        out[where] = tensor
                        continue
                    start, stop = wanted[where]
                    k = self.rows_of(where)
                    piece = tensor.reshape(k, *tensor.shape[1:])
                    if where not in out:
                        out[where] = piece.new_zeros((stop - start, *piece.shape[1:]))
                    lo, hi = max(start, r * k), min(stop, (r + 1) * k)
                    out[where][lo - start : hi - start] = piece[lo - r * k : hi - r * k]
        return out


def restore_sharded(
    directory: str | os.PathLike[str],
    target: Any = None,
    *,
    step: int | None = None,
    sharding: Any = None,
) -> Any:
    """Load the sharded checkpoint of ``step`` (default: the latest committed one).

    With a ``target`` state, each leaf gets the rows that target holds on this rank: a sharded target
    (any world size, any level) gets its shards, an unsharded one the whole leaves; shapes and dtypes
    are checked against the checkpoint's global ones. Without ``target``, the whole state comes back as
    plain containers (structs as dicts), and no process group is needed; with ``sharding`` (a
    ``fully_shard(...)``) too, the sharded leaves come back as this rank's rows for that request (params
    whole unless it shards them): what ``fit`` puts onto its state. Bit-exact either way.

    Example:
        >>> state = restore_sharded("run", target=state)  # doctest: +SKIP
    """
    _refuse_placed(target, "restore_sharded")
    if step is None:
        step = latest_sharded(directory)
        if step is None:
            raise CheckpointError(f"no committed sharded checkpoint in {os.fspath(directory)}")
    source = _Source(directory, step)
    header0 = source.headers[0]
    if target is None:
        local = {}
        if sharding is not None:
            for where, shape in source.sharded.items():
                if sharding.shards_params or not _PARAM.search(where):
                    k = sharding.rows(shape)
                    local[where] = (sharding.rank * k, (sharding.rank + 1) * k)
        wanted = {info.path: local.get(info.path, _whole(source, info.path)) for info in header0.tensors}
        tensors = source.read(wanted)
        loaded = [_local_or_trimmed(source, info.path, tensors, local, info) for info in header0.tensors]
        return structure.decode(header0.tree, loaded, name=source.files[0])

    found = sharded_states(target)
    mine = sharded_leaves(target)
    s = found[0][1].layout.request if found else None
    wanted, targets = {}, {}
    problems = []
    for path, leaf in leaves_with_paths(target):
        if not isinstance(leaf, torch.Tensor):
            continue
        where = tree.path_str(path)
        if where not in source.index:
            problems.append(f"missing in checkpoint: {where}")
            continue
        info = header0.tensors[source.index[where]]
        shape = source.sharded.get(where, info.shape)
        want_shape = mine.get(path, tuple(leaf.shape))
        if tuple(shape) != tuple(want_shape) or info.dtype != leaf.dtype:
            problems.append(
                f"{where}: checkpoint {info.dtype} {list(shape)}, target {leaf.dtype} {list(want_shape)}"
            )
            continue
        if path in mine:
            k = s.rows(tuple(shape))
            wanted[where] = (s.rank * k, (s.rank + 1) * k)
        else:
            wanted[where] = _whole(source, where)
        targets[where] = (path, leaf)
    if problems:
        hint = fit_checkpoint_hint(checkpoint_file.root_keys(header0.tree), target, sharded=True)
        raise CheckpointError(
            f"{source.folder} does not match the target ({len(problems)} problem(s)){'; ' if hint else ''}"
            f"{hint}:\n  " + "\n  ".join(problems)
        )
    tensors = source.read(wanted)

    def leaf_fn(path: Path, old: Any) -> Any:
        if not isinstance(old, torch.Tensor):
            return old
        where = tree.path_str(path)
        if where not in tensors:  # a new shard made of padding rows only
            return torch.zeros_like(old)
        value = tensors[where]
        if path not in mine:
            value = _trim(source, where, value)
        elif where not in source.sharded:  # saved whole (ZeRO-1 params), restored as a shard
            value = local_rows(value, s).clone()
        return value.to(old.device) if value.device != old.device else value

    return rebuild(target, leaf_fn)


def _local_or_trimmed(
    source: _Source, where: str, tensors: Mapping[str, torch.Tensor], local: Mapping[str, Any], info: Any
) -> torch.Tensor:
    if where not in local:
        return _trim(source, where, tensors[where])
    start, stop = local[where]
    rows = tensors.get(where)
    if rows is None:  # padding rows only
        rows = torch.zeros((stop - start, *source.sharded[where][1:]), dtype=info.dtype)
    setattr(rows, WHOLE_SHAPE, source.sharded[where])  # what a mismatch report names (restore_onto)
    return rows


def _whole(source: _Source, where: str) -> tuple[int, int]:
    if where not in source.sharded:
        return (0, -1)
    return (0, source.rows_of(where) * source.world_size)


def _trim(source: _Source, where: str, value: torch.Tensor) -> torch.Tensor:
    """A sharded leaf read whole: padding rows dropped, the global shape restored."""
    if where not in source.sharded:
        return value
    shape = source.sharded[where]
    return value[: (shape[0] if shape else 1)].reshape(shape).clone()


class ShardedCheckpointManager(CheckpointFolder):
    """A folder of sharded checkpoints with :class:`~functrain.checkpoint.CheckpointManager`'s interface,
    so ``fit(..., checkpoints=ShardedCheckpointManager(dir, sharding))`` saves and resumes a sharded run.

    Every rank saves (its own file); rank 0 commits the manifest and applies retention, the
    ``CheckpointManager``'s rules (:class:`~functrain.checkpoint.folder.CheckpointFolder`). Metrics,
    latest and best are read from the manifests. ``restore(which)`` without a target returns plain
    containers holding this rank's rows for ``sharding`` (any saved world size).

    Example:
        >>> manager = ShardedCheckpointManager("runs/a", distributed.fully_shard())  # doctest: +SKIP
        >>> result = ft.fit(state, step, data, checkpoints=manager, resume_from_checkpoint=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        sharding: Any,
        *,
        max_to_keep: int | None = 5,
        keep_every: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        keep_best: int = 1,
        fsync: bool = True,
    ) -> None:
        super().__init__(directory, max_to_keep, keep_every, best_metric, best_mode, keep_best)
        self.sharding = sharding
        self.fsync = fsync

    @property
    def is_writer(self) -> bool:
        """Every rank writes its own file."""
        return True

    def path(self, step: int) -> str:
        """The manifest of the checkpoint at ``step`` (its header holds the metrics and metadata)."""
        return os.path.join(_step_dir(self.directory, step), MANIFEST)

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sharded_steps(self.directory)

    def _read_header(self, step: int) -> fmt.CheckpointHeader:
        return _manifest_header(self.directory, step)

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Save on every rank (collective), then rank 0 applies retention."""
        if isinstance(step, torch.Tensor):
            step = int(step.item())
        plain = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in dict(metrics or {}).items()}
        save_sharded(self.directory, step, state, metrics=plain, metadata=metadata, fsync=self.fsync)
        if self.sharding.rank == 0:
            steps = self.all_steps()
            keep = self._kept(steps)
            for old in steps:
                if old not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path(old))  # uncommit first
                    shutil.rmtree(_step_dir(self.directory, old), ignore_errors=True)
                    self._forget(old)

    def restore(self, which: int | str = "latest", target: Any = None) -> Any:
        """``"latest"``, ``"best"`` or a step; onto ``target``, or as plain containers of this rank's rows."""
        step = self._step_of(which)
        if target is not None:
            return restore_sharded(self.directory, target, step=step)
        return restore_sharded(self.directory, step=step, sharding=self.sharding)

    def wait_until_finished(self) -> None:
        """Saves are synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> ShardedCheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
