"""Save a pytree to a checkpoint file and restore it, onto a target tree or as plain containers.

Example:
    >>> import torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "state.ckpt")
    >>> save(path, {"w": torch.ones(2), "step": 3}, step=3)
    >>> restore(path)
    {'w': tensor([1., 1.]), 'step': 3}
    >>> restore(path, target={"w": torch.zeros(2), "step": 0})["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from functrain import tree
from functrain.checkpoint import format as fmt
from functrain.checkpoint import structure
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.format import CheckpointHeader, TensorInfo
from functrain.checkpoint.onto import fit_checkpoint_hint, restore_onto
from functrain.checkpoint.placed import describe_saved_layout, gather_placed
from functrain.core.atomic import atomic_write
from functrain.core.tree_walk import Path, leaves_with_paths

__all__ = ["read_header", "restore", "save"]

PathLike = str | os.PathLike[str]


def save(
    path: PathLike,
    state: Any,
    *,
    step: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    fsync: bool = True,
    chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
) -> None:
    """Write ``state`` (any functrain pytree) to ``path`` atomically; a good file is never half-replaced.

    ``step``, ``metrics`` (numbers) and ``metadata`` (JSON-like) go in the header, readable with
    :func:`read_header` without loading tensors. ``fsync=False`` skips the flush to disk (faster; the
    replacement stays atomic for other processes, but may not survive a power cut).

    A tensor-parallel state (``tp.place(state)``, anywhere in ``state``) is saved whole: it is gathered
    first, so **every rank of its mesh calls** ``save``, and every calling rank writes ``path`` (the same
    bytes; a :class:`~functrain.checkpoint.CheckpointManager` writes on one rank). Its layout goes in the
    metadata; see :mod:`functrain.checkpoint.placed`.

    Example:
        >>> save("run/final.ckpt", state, step=1000, metrics={"loss": 0.25})  # doctest: +SKIP
    """
    state, layouts = gather_placed(state)
    node, tensors = structure.encode(state)
    write_encoded(
        path,
        node,
        tensors,
        step=step,
        metrics=metrics,
        metadata={**dict(metadata or {}), **layouts},
        fsync=fsync,
        chunk_bytes=chunk_bytes,
    )


def write_encoded(
    path: PathLike,
    node: Any,
    tensors: list[Any],
    *,
    step: int | None,
    metrics: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    fsync: bool,
    chunk_bytes: int,
) -> None:
    """Atomically write a tree already split by ``structure.encode`` (the manager encodes before it
    copies tensors off the device for an asynchronous save)."""
    try:
        with atomic_write(path, fsync=fsync) as file:
            fmt.write(
                file,
                tree_node=node,
                tensors=tensors,
                step=step,
                metrics=metrics,
                metadata=metadata,
                chunk_bytes=chunk_bytes,
            )
    except OSError as error:
        raise CheckpointError(f"{os.fspath(path)}: could not write the checkpoint: {error}") from error


def open_for_reading(path: PathLike, what: str = "checkpoint") -> Any:
    """``open(path, "rb")``, or a CheckpointError naming the file (and ``what`` kind of file it is)."""
    try:
        return open(path, "rb")
    except OSError as error:
        raise CheckpointError(f"{os.fspath(path)}: cannot open {what}: {error}") from error


def read_header(path: PathLike) -> CheckpointHeader:
    """The checkpoint's header (step, versions, metrics, metadata, tensor table), no tensor loaded.

    Example:
        >>> header = read_header("run/step_00001000.ckpt")  # doctest: +SKIP
        >>> header.step, header.metrics["loss"]  # doctest: +SKIP
        (1000, 0.25)
    """
    with open_for_reading(path) as file:
        return fmt.read_header(file, name=os.fspath(path))


def _describe(value: Any) -> str:
    if isinstance(value, TensorInfo):
        return f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return f"{type(value).__qualname__}"


def _mismatches(saved: dict[Path, Any], wanted: dict[Path, Any]) -> list[str]:
    problems = []
    for path, target in wanted.items():
        where = tree.path_str(path)
        if path not in saved:
            problems.append(f"missing in checkpoint: {where} ({_describe(target)})")
            continue
        value = saved[path]
        if isinstance(target, torch.Tensor) and isinstance(value, TensorInfo):
            if tuple(target.shape) != value.shape:
                problems.append(
                    f"wrong shape at {where}: checkpoint {list(value.shape)}, target {list(target.shape)}"
                )
            if target.dtype != value.dtype:
                problems.append(f"wrong dtype at {where}: checkpoint {value.dtype}, target {target.dtype}")
        elif (
            isinstance(target, torch.Tensor)
            or isinstance(value, TensorInfo)
            or type(target) is not type(value)
        ):
            problems.append(
                f"wrong type at {where}: checkpoint {_describe(value)}, target {_describe(target)}"
            )
    for path, value in saved.items():
        if path not in wanted:
            problems.append(f"unexpected in checkpoint: {tree.path_str(path)} ({_describe(value)})")
    return problems


def root_keys(node: Any) -> list[Any]:
    """The keys of a saved tree's root when it is a dict (``["state", "loop"]`` for ``fit``'s files)."""
    return [pair[0] for pair in node[1]] if node[0] == "dict" else []


def restore(path: PathLike, target: Any = None) -> Any:
    """Load the tree saved at ``path``, bit-exact.

    With ``target``, the result has ``target``'s structure and container types (struct static fields
    included) and each tensor lands on the matching target tensor's device; structure, shapes and dtypes
    are checked first, from the header alone, and every mismatch is reported by path in one
    :class:`CheckpointError`. Without ``target``, plain containers come back: structs as dicts of their
    data fields, named tuples as tuples. A ``TrainState``'s optimizer is code, not in the file: restore
    one onto a state built as before (a step refuses the plain dict, naming ``target=``). A
    tensor-parallel target is placed by its strategy (collective: every rank of its mesh calls
    ``restore``), whatever layout wrote the file.

    Example:
        >>> state = restore("run/state.ckpt", target=TrainState.create(model, tx))  # doctest: +SKIP
    """
    name = os.fspath(path)
    with open_for_reading(path) as file:
        header = fmt.read_header(file, name=name)
        saved_leaves: list[tuple[Path, Any]] = []
        structure.decode(header.tree, header.tensors, leaves=saved_leaves, name=name)
        if target is None:
            loaded: list[torch.Tensor | None] = [None] * len(header.tensors)
            for index, tensor in fmt.read_tensors(file, header, name=name):
                loaded[index] = tensor
            return structure.decode(header.tree, loaded, name=name)
        saved = dict(saved_leaves)
        wanted = dict(leaves_with_paths(target))
        problems = _mismatches(saved, wanted)
        if problems:
            listing = "\n  ".join(problems)
            hint = fit_checkpoint_hint(root_keys(header.tree), target) or (
                "restore without a target to inspect it, or build a target of the saved shape"
            )
            layout = describe_saved_layout(header.metadata)
            hint = f"{hint}; {layout}" if layout else hint
            raise CheckpointError(
                f"{name} does not match the target ({len(problems)} problem(s)); {hint}:\n  {listing}"
            )
        loaded = [None] * len(header.tensors)
        for index, tensor in fmt.read_tensors(file, header, name=name):
            loaded[index] = tensor
    return restore_onto(target, structure.decode(header.tree, loaded, name=name), where=name)
