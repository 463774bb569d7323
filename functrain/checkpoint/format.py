"""The checkpoint file format: a msgpack stream written and read in chunks, each checksummed.

Layout (every item is a msgpack item, so the file is a valid msgpack stream)::

    str  "functrain-checkpoint"                      magic
    bin  msgpack(header)   uint32 crc32(header)      header, readable on its own
    for each tensor, for each chunk of its bytes:
    bin  chunk             uint32 checksum(chunk)    at most ``chunk_bytes`` (< 4 GiB) per item
    str  "end"                                       end marker; nothing may follow

The header holds the format version, functrain and torch versions, step, metrics, metadata, the tree's
structure (see :mod:`functrain.checkpoint.structure`) and a tensor table of ``[path, dtype, shape,
nbytes]``. Because the chunk size is in the header, the reader knows the exact file size before it reads
or allocates any tensor: truncation and absurd declared sizes are refused up front, and a corrupted byte
anywhere is caught by a checksum or a length check. Chunks are checked with the low 32 bits of xxh3-64
(``"checksum": "xxh3_64_low32"`` in the header; ~0.09 s per GiB here, against 0.3-0.4 s for zlib's CRC-32,
which is the cost that made loading slower than ``torch.load``); files whose header names ``"crc32"``
are read too. The header itself is checked with CRC-32.

Tensor bytes go to the file straight from the tensor's memory and come back with ``readinto`` straight
into the new tensor's memory: no bytes object the size of a tensor, let alone of the checkpoint, is made.

Example:
    >>> import io, torch
    >>> buffer = io.BytesIO()
    >>> write(buffer, tree_node=["tensor", 0], tensors=[((), torch.arange(3))], step=7)
    >>> _ = buffer.seek(0)
    >>> header = read_header(buffer, name="memory")
    >>> header.step, header.tensors[0].shape
    (7, (3,))
    >>> [t for _, t in read_tensors(buffer, header, name="memory")]
    [tensor([0, 1, 2])]
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

import msgpack
import torch

from functrain import tree
from functrain._version import __version__
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.memory import available_memory, human_size
from functrain.core.tree_walk import Path

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "CheckpointHeader",
    "TensorInfo",
    "dtype_from_name",
    "read_header",
    "read_tensors",
    "write",
]

MAGIC = b"\xb4functrain-checkpoint"  # msgpack fixstr of 20 characters
END = b"\xa3end"
FORMAT_VERSION = 1
CHECKSUM = "xxh3_64_low32"


def _xxh3_low32(data: Any) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


_CHECKSUMS: dict[str, Any] = {"crc32": zlib.crc32, "xxh3_64_low32": _xxh3_low32}
DEFAULT_CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = (1 << 32) - 1  # a msgpack bin32 length
MAX_HEADER_BYTES = 1 << 30
_MAX_INT64 = (1 << 63) - 1  # torch's sizes, strides and byte offsets are int64
_BIN32 = 0xC6
_UINT32 = 0xCE
_ITEM = struct.Struct(">BI")  # a one-byte msgpack tag and a big-endian uint32: bin32 length or uint32 value
_ITEM_BYTES = _ITEM.size
_CHUNK_OVERHEAD = 2 * _ITEM_BYTES  # the bin32 tag before a chunk and its crc item after

# Every dtype whose tensors are plain bytes; quantized and sub-byte "bits" dtypes are not.
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)  # fmt: skip
_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_DTYPE_TO_NAME = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a header names (``"bfloat16"`` -> ``torch.bfloat16``); unknown names are refused.

    Example:
        >>> dtype_from_name("float8_e4m3fn")
        torch.float8_e4m3fn
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown dtype name {name!r}; this torch knows {sorted(_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One row of the header's tensor table.

    Example:
        >>> TensorInfo("params['w']", torch.float32, (2, 3), 24).numel
        6
    """

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint says about itself, read without loading any tensor.

    Example:
        >>> header = read_header(open(path, "rb"), name=path)  # doctest: +SKIP
        >>> header.step, header.metrics, [t.path for t in header.tensors]  # doctest: +SKIP
    """

    format_version: int
    functrain_version: str
    torch_version: str
    step: int | None
    created: float
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    chunk_bytes: int
    tensors: list[TensorInfo]
    tree: Any
    data_offset: int  # where the first chunk starts in the file
    checksum: str = "crc32"  # the chunks' checksum, a key of _CHECKSUMS

    @property
    def num_bytes(self) -> int:
        """Total tensor bytes in the checkpoint."""
        return sum(t.nbytes for t in self.tensors)


# --------------------------------------------------------------------------------------------- write


def _refuse_dtensor(t: torch.Tensor, where: str) -> None:
    """A DTensor's bytes are this rank's part only: writing them under the global shape would corrupt
    the file (DTensor is loaded only once a program uses it)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None and isinstance(t, dtensor):
        raise CheckpointError(
            f"{where}: a DTensor (this rank's part of a tensor) outside a tensor-parallel TrainState cannot "
            "be saved by one process: save a state placed by tp.place(state) (saved whole, every rank "
            "calling save), or the DTensor's .full_tensor()"
        )


def _plain_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor, conjugate and negative bits resolved."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a one-element view keeps its odd stride: still contiguous
        flat = flat.new_empty(flat.shape).copy_(flat)
    return flat.view(torch.uint8)


def _contiguous_pieces(t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """Contiguous CPU tensors whose bytes, concatenated, are ``t``'s bytes in C order.

    A contiguous CPU tensor is yielded as it is; anything else (strided views, other devices) is copied
    a few rows at a time so that no copy of the whole tensor is ever made.
    """
    if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        yield t
        return
    if t.dim() == 0 or t.numel() * t.element_size() <= max_bytes:
        yield (
            t.detach()
            .resolve_conj()
            .resolve_neg()
            .to("cpu", memory_format=torch.contiguous_format)
            .contiguous()
        )
        return
    row_bytes = max(1, t[0].numel() * t.element_size())
    rows = max(1, max_bytes // row_bytes)
    for start in range(0, t.shape[0], rows):
        block = t[start : start + rows]
        if rows == 1:
            yield from _contiguous_pieces(block[0], max_bytes)
        else:
            yield from _contiguous_pieces(block, max_bytes)


def _byte_chunks(t: torch.Tensor, chunk_bytes: int) -> Iterator[memoryview]:
    """``t``'s bytes as memoryviews of exactly ``chunk_bytes`` (the last one shorter)."""
    pieces = _contiguous_pieces(t, chunk_bytes)
    first = next(pieces, None)
    if first is t:  # contiguous CPU: slice the tensor's own memory
        view = memoryview(_plain_bytes(t).numpy())
        for start in range(0, len(view), chunk_bytes):
            yield view[start : start + chunk_bytes]
        return
    staging = torch.empty(chunk_bytes, dtype=torch.uint8)
    staging_view = memoryview(staging.numpy())
    fill = 0
    for piece in (first, *pieces) if first is not None else ():
        data = _plain_bytes(piece)
        offset = 0
        while offset < data.numel():
            take = min(data.numel() - offset, chunk_bytes - fill)
            staging[fill : fill + take].copy_(data[offset : offset + take])
            fill += take
            offset += take
            if fill == chunk_bytes:
                yield staging_view
                fill = 0
    if fill:
        yield staging_view[:fill]


def _json_like(value: Any, where: str) -> Any:
    """``value`` with tuples as lists and 0-d tensors as numbers, or a CheckpointError naming the key."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckpointError(
                f"{where}: only one-element tensors can be stored here, got shape {tuple(value.shape)}"
            )
        return value.item()
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(f"{where}: key {key!r} must be a str or int")
            out[key] = _json_like(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_json_like(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"{where}: {type(value).__qualname__} is not JSON-like; use dicts, lists, str, int, float, bool or None"
    )


def write(
    file: BinaryIO,
    *,
    tree_node: Any,
    tensors: Sequence[tuple[Path, torch.Tensor]],
    step: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> None:
    """Write a checkpoint (header, then every tensor in chunks, then the end marker) to ``file``.

    ``tree_node`` and ``tensors`` come from :func:`functrain.checkpoint.structure.encode`.

    Example:
        >>> import io, torch
        >>> write(io.BytesIO(), tree_node=["tensor", 0], tensors=[((), torch.ones(2))])
    """
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise CheckpointError(f"chunk_bytes={chunk_bytes} must be between 1 and {MAX_CHUNK_BYTES}")
    table = []
    for path, t in tensors:
        where = tree.path_str(path)
        name = _DTYPE_TO_NAME.get(t.dtype)
        if name is None:
            raise CheckpointError(f"{where}: dtype {t.dtype} cannot be saved; supported: {sorted(_DTYPES)}")
        if t.layout != torch.strided:
            raise CheckpointError(f"{where}: {t.layout} tensors cannot be saved; convert with .to_dense()")
        _refuse_dtensor(t, where)
        table.append([where, name, list(t.shape), t.numel() * t.element_size()])
    header = {
        "format": FORMAT_VERSION,
        "functrain": __version__,
        "torch": torch.__version__,
        "step": None if step is None else int(step),
        "created": time.time(),
        "metrics": _json_like(dict(metrics or {}), "metrics"),
        "metadata": _json_like(dict(metadata or {}), "metadata"),
        "chunk_bytes": chunk_bytes,
        "checksum": CHECKSUM,
        "tensors": table,
        "tree": tree_node,
    }
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > MAX_HEADER_BYTES:
        raise CheckpointError(f"the header is {len(packed)} bytes, more than the {MAX_HEADER_BYTES} allowed")
    file.write(MAGIC + _ITEM.pack(_BIN32, len(packed)))
    file.write(packed)
    file.write(_ITEM.pack(_UINT32, zlib.crc32(packed)))
    for (_path, t), row in zip(tensors, table):
        written = 0
        for chunk in _byte_chunks(t, chunk_bytes):
            # Hashing in the calling thread, chunk by chunk while it is in cache: measured here, a worker
            # thread hashing beside the write was 3x slower than doing both in turn (1 GiB: 4.4 s vs 1.4 s).
            crc = _xxh3_low32(chunk)
            file.write(_ITEM.pack(_BIN32, len(chunk)))
            file.write(chunk)
            file.write(_ITEM.pack(_UINT32, crc))
            written += len(chunk)
        if written != row[3]:  # a tensor changed under us (another thread wrote into it)
            raise CheckpointError(f"{row[0]}: wrote {written} bytes where the tensor has {row[3]}")
    file.write(END)


# --------------------------------------------------------------------------------------------- read


def _read_exact(file: BinaryIO, size: int, name: str, what: str) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise CheckpointError(f"{name}: file is truncated in {what} (wanted {size} bytes, got {len(data)})")
    return data


def _read_item(file: BinaryIO, tag: int, name: str, what: str) -> int:
    got_tag, value = _ITEM.unpack(_read_exact(file, _ITEM_BYTES, name, what))
    if got_tag != tag:
        raise CheckpointError(f"{name}: corrupted {what}: expected msgpack tag {tag:#x}, found {got_tag:#x}")
    return value


def _file_size(file: BinaryIO) -> int:
    try:
        return os.fstat(file.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # an in-memory file
        position = file.tell()
        size = file.seek(0, os.SEEK_END)
        file.seek(position)
        return size


REFUSED_PICKLE = (
    "functrain does not unpickle it: loading a pickle can run arbitrary code. Re-save the state as a "
    "functrain checkpoint from the code that made it (functrain.checkpoint.save), or its weights as "
    "safetensors (safetensors.torch.save_file)"
)


def check_magic(start: bytes, name: str) -> None:
    """Refuse a file that does not start with the checkpoint magic, saying what it looks like instead.

    Example:
        >>> check_magic(b"PK\\x03\\x04", "model.pt")
        Traceback (most recent call last):
        ...
        functrain.checkpoint.errors.CheckpointError: model.pt: not a functrain checkpoint: ...
    """
    if start == MAGIC:
        return
    if start[:1] == b"\x80" or start[:2] == b"PK":
        raise CheckpointError(
            f"{name}: not a functrain checkpoint: it looks like a pickle or torch.save file, and "
            + REFUSED_PICKLE
        )
    raise CheckpointError(f"{name}: not a functrain checkpoint (wrong magic bytes {start[:24]!r})")


_MISSING: Any = object()


def _field(header: Mapping[str, Any], key: str, kinds: Any, name: str, default: Any = _MISSING) -> Any:
    """``header[key]``, of exactly one of the types ``kinds`` (a bool is not an int here); ``default``
    when the key is absent and has one."""
    value = header.get(key, _MISSING)
    if value is _MISSING and default is not _MISSING:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if type(value) not in kinds:
        expected = " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)
        found = "missing" if value is _MISSING else f"a {type(value).__qualname__}: {value!r:.80}"
        raise CheckpointError(f"{name}: header field {key!r} must be {expected}, but it is {found}")
    return value


_JSON_LEAVES = (type(None), bool, int, float, str)


def _check_json_like(value: Any, where: str, name: str) -> None:
    """Refuse anything in ``metrics`` / ``metadata`` that :func:`write` would not have put there."""
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) not in (str, int):
                raise CheckpointError(
                    f"{name}: header field {where} has a key of type {type(key).__qualname__}"
                )
            _check_json_like(item, f"{where}[{key!r}]", name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_like(item, f"{where}[{i}]", name)
    elif type(value) not in _JSON_LEAVES:
        raise CheckpointError(
            f"{name}: header field {where} holds a {type(value).__qualname__}; "
            "metrics and metadata hold only dicts, lists, str, int, float, bool and None"
        )


def _json_like_field(header: Mapping[str, Any], key: str, name: str) -> dict[str, Any]:
    value = _field(header, key, dict, name)
    try:
        _check_json_like(value, repr(key), name)
    except RecursionError:
        raise CheckpointError(f"{name}: header field {key!r} is nested too deeply") from None
    return value


def _tensor_info(row: Any, name: str) -> TensorInfo:
    if not (isinstance(row, list) and len(row) == 4):
        raise CheckpointError(f"{name}: malformed tensor table entry {row!r:.200}")
    path, dtype_name, shape, nbytes = row
    where = f"{name}: tensor {path!r:.200}"
    if not isinstance(path, str):
        raise CheckpointError(f"{where}: path must be a string")
    try:
        dtype = dtype_from_name(dtype_name)
    except CheckpointError as error:
        raise CheckpointError(f"{where}: {error}") from None
    if not (isinstance(shape, list) and len(shape) <= 64 and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: malformed shape {shape!r:.200}; dimensions are non-negative ints")
    expected = math.prod(shape) * dtype.itemsize
    # torch computes strides (a dimension of size 0 counts as 1) and byte sizes in int64. A non-empty
    # tensor's are at most its byte size, which read_header bounds by the file's size.
    if expected == 0 and math.prod(max(d, 1) for d in shape) * dtype.itemsize > _MAX_INT64:
        raise CheckpointError(
            f"{where}: shape {shape!r:.200} of {dtype_name} is impossible: its sizes or strides overflow "
            "64-bit integers"
        )
    if type(nbytes) is not int or nbytes != expected:
        raise CheckpointError(
            f"{where}: shape {shape} of {dtype_name} needs {expected} bytes but the header says {nbytes!r:.50}"
        )
    return TensorInfo(path, dtype, tuple(shape), nbytes)


def read_header(file: BinaryIO, *, name: str) -> CheckpointHeader:
    """Read and validate the header; the file is left at the first tensor chunk.

    Also checks that the file's size is exactly what the header implies, so a truncated file or a header
    declaring absurd sizes fails here, before any tensor is allocated. ``name`` labels error messages.

    Example:
        >>> with open("run/step_100.ckpt", "rb") as f:  # doctest: +SKIP
        ...     print(read_header(f, name="run/step_100.ckpt").step)
        100
    """
    size = _file_size(file)
    check_magic(file.read(len(MAGIC)), name)
    header_bytes = _read_item(file, _BIN32, name, "header length")
    if header_bytes > min(MAX_HEADER_BYTES, size):
        raise CheckpointError(f"{name}: header declares {header_bytes} bytes but the file has {size}")
    packed = _read_exact(file, header_bytes, name, "header")
    crc = _read_item(file, _UINT32, name, "header checksum")
    if crc != zlib.crc32(packed):
        raise CheckpointError(f"{name}: header checksum mismatch: the file is corrupted")
    try:
        header = msgpack.unpackb(packed, raw=False, strict_map_key=False, use_list=True)
    except Exception as error:  # msgpack raises several unrelated types for malformed data
        raise CheckpointError(
            f"{name}: header is not valid msgpack ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: header is a {type(header).__qualname__}, expected a map")
    version = _field(header, "format", int, name)
    if version > FORMAT_VERSION or version < 1:
        raise CheckpointError(
            f"{name}: format version {version} is not supported by this functrain (reads 1..{FORMAT_VERSION}); "
            "upgrade functrain"
        )
    step = _field(header, "step", (int, type(None)), name, default=None)
    checksum = _field(header, "checksum", str, name, default="crc32")
    if checksum not in _CHECKSUMS:
        raise CheckpointError(
            f"{name}: unknown chunk checksum {checksum!r:.80} (known: {sorted(_CHECKSUMS)})"
        )
    chunk_bytes = _field(header, "chunk_bytes", int, name)
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise CheckpointError(f"{name}: header declares chunk_bytes={chunk_bytes}")
    functrain_version = _field(header, "functrain", str, name, default="?")
    torch_version = _field(header, "torch", str, name, default="?")
    created = float(_field(header, "created", (float, int), name, default=0.0))
    metrics = _json_like_field(header, "metrics", name)
    metadata = _json_like_field(header, "metadata", name)
    tree_node = _field(header, "tree", list, name)
    rows = _field(header, "tensors", list, name)
    infos = [_tensor_info(row, name) for row in rows]
    data_offset = len(MAGIC) + _ITEM_BYTES + header_bytes + _ITEM_BYTES
    expected_size = data_offset + len(END)
    for info in infos:
        expected_size += info.nbytes + _CHUNK_OVERHEAD * -(-info.nbytes // chunk_bytes)
    if expected_size > size:
        raise CheckpointError(
            f"{name}: file is truncated or its header declares too much data: the header implies "
            f"{expected_size} bytes, the file has {size}"
        )
    if expected_size < size:
        raise CheckpointError(
            f"{name}: {size - expected_size} unexpected bytes after the end of the checkpoint"
        )
    return CheckpointHeader(
        format_version=version,
        functrain_version=functrain_version,
        torch_version=torch_version,
        step=step,
        created=created,
        metrics=metrics,
        metadata=metadata,
        chunk_bytes=chunk_bytes,
        tensors=infos,
        tree=tree_node,
        data_offset=data_offset,
        checksum=checksum,
    )


def _empty(info: TensorInfo, name: str) -> torch.Tensor:
    try:
        if info.dtype != getattr(torch, "complex32", None):
            return torch.empty(info.shape, dtype=info.dtype)
        with warnings.catch_warnings():  # "ComplexHalf support is experimental": not news to a restore
            warnings.simplefilter("ignore", UserWarning)
            return torch.empty(info.shape, dtype=info.dtype)
    except (RuntimeError, MemoryError) as error:  # the allocator refused: memory is short after all
        raise CheckpointError(
            f"{name}: cannot allocate tensor {info.path!r} ({human_size(info.nbytes)}, {info.nbytes} bytes): "
            f"{error}"
        ) from None


def check_memory(
    header: CheckpointHeader, *, name: str, select: Callable[[int, TensorInfo], bool] | None = None
) -> None:
    """Refuse, before allocating anything, to load tensors whose declared sizes exceed available memory.

    A header's sizes agree with the file's size (checked by :func:`read_header`), but a sparse or
    crafted file can be that large on disk without holding data. Counts the tensors ``select`` keeps.

    Example:
        >>> check_memory(header, name="run/step_100.ckpt")  # doctest: +SKIP
    """
    chosen = [info for i, info in enumerate(header.tensors) if select is None or select(i, info)]
    needed = sum(info.nbytes for info in chosen)
    if not needed:
        return
    available = available_memory()
    if available is None or needed <= available:
        return
    largest = max(chosen, key=lambda info: info.nbytes)
    raise CheckpointError(
        f"{name}: loading needs {human_size(needed)} ({needed} bytes) for its tensors, "
        f"{human_size(largest.nbytes)} ({largest.nbytes} bytes) of it for tensor {largest.path!r}, but only "
        f"{human_size(available)} ({available} bytes) of memory is available (RAM plus swap); nothing was "
        "allocated. If the file is genuine, load it where there is more memory, or load only the weights "
        "you need with functrain.checkpoint.load_state_dict(path, wanted=...); a header this large may also "
        "be crafted or damaged"
    )


_HASHER: ThreadPoolExecutor | None = None


def _hasher() -> ThreadPoolExecutor:
    """One worker thread that checksums read chunks while the calling thread reads the next one."""
    global _HASHER
    if _HASHER is None:
        _HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="functrain-checkpoint-crc")
    return _HASHER


# A chunk's checksum being computed in the worker: (where, stored value, the computation), or None.
_Pending = tuple[str, int, Future[int]] | None


def _check_crc(pending: _Pending, name: str) -> None:
    if pending is not None:
        where, stored, computed = pending
        if stored != computed.result():
            raise CheckpointError(f"{name}: checksum mismatch in {where}: the file is corrupted")


def read_tensors(
    file: BinaryIO,
    header: CheckpointHeader,
    *,
    name: str,
    select: Callable[[int, TensorInfo], bool] | None = None,
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Yield ``(index, tensor)`` for every tensor in file order, each checked against its CRCs.

    Call right after :func:`read_header`. Tensors for which ``select(index, info)`` is false are skipped
    (seeked over, not read or checked) and yielded as ``None``. The end marker is checked last. Before
    anything is allocated, the selected tensors' total size is checked against available memory
    (:func:`check_memory`).

    Example:
        >>> with open(path, "rb") as f:  # doctest: +SKIP
        ...     header = read_header(f, name=path)
        ...     tensors = [t for _, t in read_tensors(f, header, name=path)]
    """
    check_memory(header, name=name, select=select)
    # Each tensor is yielded once its last chunk's checksum (computed in a worker while the next tensor
    # is read) has been verified: one tensor behind the reading, so one-chunk tensors overlap too.
    held: tuple[int, torch.Tensor | None, _Pending] | None = None
    for read in _read_unverified(file, header, name, select):
        if held is not None:
            _check_crc(held[2], name)
            yield held[0], held[1]
        held = read
    if held is not None:
        _check_crc(held[2], name)
        yield held[0], held[1]
    if file.read(len(END)) != END:
        raise CheckpointError(f"{name}: end marker missing or corrupted: the file is truncated or damaged")
    if file.read(1):
        raise CheckpointError(f"{name}: unexpected bytes after the end marker")


def _read_unverified(
    file: BinaryIO,
    header: CheckpointHeader,
    name: str,
    select: Callable[[int, TensorInfo], bool] | None,
) -> Iterator[tuple[int, torch.Tensor | None, _Pending]]:
    """``(index, tensor, pending check of its last chunk)`` for each tensor; earlier chunks are checked."""
    chunk_bytes = header.chunk_bytes
    for index, info in enumerate(header.tensors):
        chunks = -(-info.nbytes // chunk_bytes)
        if select is not None and not select(index, info):
            file.seek(info.nbytes + _CHUNK_OVERHEAD * chunks, os.SEEK_CUR)
            yield index, None, None
            continue
        result = _empty(info, name)
        view = memoryview(result.reshape(-1).view(torch.uint8).numpy()) if info.nbytes else memoryview(b"")
        pending: _Pending = None
        for chunk in range(chunks):
            where = f"tensor {info.path} chunk {chunk + 1}/{chunks}"
            start = chunk * chunk_bytes
            length = min(chunk_bytes, info.nbytes - start)
            declared = _read_item(file, _BIN32, name, where)
            if declared != length:
                raise CheckpointError(f"{name}: corrupted {where}: length {declared}, expected {length}")
            target = view[start : start + length]
            got = file.readinto(target)
            if got != length:
                raise CheckpointError(f"{name}: file is truncated in {where}")
            crc = _read_item(file, _UINT32, name, f"checksum of {where}")
            _check_crc(pending, name)
            # Reading, unlike writing, gains from hashing chunk i in a worker while chunk i + 1 is read.
            pending = (where, crc, _hasher().submit(_CHECKSUMS[header.checksum], target))
        yield index, result, pending
