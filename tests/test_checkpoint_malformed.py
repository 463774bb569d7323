"""Malformed and hostile files: each raises CheckpointError quickly, without crashing or allocating much."""

from __future__ import annotations

import os
import pickle
import resource
import time
import zlib

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functrain import checkpoint
from functrain.checkpoint import format as fmt
from functrain.checkpoint.errors import CheckpointError


def _good_file(tmp_path) -> bytes:
    state = {"w": torch.randn(40, 10), "b": torch.arange(5), "step": 3, "name": "x"}
    checkpoint.save(tmp_path / "good.ckpt", state, step=3, chunk_bytes=512, fsync=False)
    return (tmp_path / "good.ckpt").read_bytes()


def _deep_tree_header(depth: int) -> bytes:
    """A header whose tree is ``depth`` nested lists, beyond what msgpack itself would write."""
    without_tree = {k: v for k, v in _header({"tensors": []}).items() if k != "tree"}
    packed = msgpack.packb(without_tree, use_bin_type=True)
    assert packed[0] == 0x80 | len(without_tree)
    return (
        bytes([packed[0] + 1])
        + packed[1:]
        + msgpack.packb("tree")
        + b"\x91" * depth
        + msgpack.packb(["none"])
    )


def _header_bytes(**changes) -> bytes:
    return msgpack.packb(_header(changes), use_bin_type=True)


def _header(changes: dict) -> dict:
    header = {
        "format": 1,
        "functrain": "0",
        "torch": "0",
        "step": 1,
        "created": 0.0,
        "metrics": {},
        "metadata": {},
        "chunk_bytes": 1024,
        "tensors": [["w", "float32", [2], 8]],
        "tree": ["dict", [["w", ["tensor", 0]]]],
    }
    header.update(changes)
    return header


def _crafted(
    header_changes: dict, body: bytes = b"", *, end: bytes = fmt.END, raw_header: bytes | None = None
) -> bytes:
    header = _header(header_changes)
    packed = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
    return (
        fmt.MAGIC
        + fmt._ITEM.pack(0xC6, len(packed))
        + packed
        + fmt._ITEM.pack(0xCE, zlib.crc32(packed))
        + body
        + end
    )


def _chunk(data: bytes) -> bytes:
    return fmt._ITEM.pack(0xC6, len(data)) + data + fmt._ITEM.pack(0xCE, zlib.crc32(data))


GOOD_BODY = _chunk(b"\x00" * 8)

CRAFTED = {
    "control (valid)": _crafted({}, GOOD_BODY),
    "empty file": b"",
    "wrong magic": b"\xb4functrain-checkpoinX" + b"\x00" * 40,
    "pickle": pickle.dumps({"w": 1}),
    "torch.save zip": b"PK\x03\x04" + b"\x00" * 60,
    "header not msgpack": _crafted({}, GOOD_BODY, raw_header=b"\xc1\xc1\xc1"),
    "header is a list": _crafted({}, GOOD_BODY, raw_header=msgpack.packb([1, 2, 3])),
    "header length huge": fmt.MAGIC + fmt._ITEM.pack(0xC6, 0xFFFFFFFF) + b"\x00" * 64,
    "header checksum wrong": _crafted({}, GOOD_BODY).replace(
        fmt._ITEM.pack(0xCE, zlib.crc32(_header_bytes())),
        fmt._ITEM.pack(0xCE, zlib.crc32(_header_bytes()) ^ 1),
    ),
    "future format": _crafted({"format": 99}, GOOD_BODY),
    "format as bool": _crafted({"format": True}, GOOD_BODY),
    "missing tensor table": _crafted({"tensors": None}, GOOD_BODY),
    "unknown dtype name": _crafted({"tensors": [["w", "float33", [2], 8]]}, GOOD_BODY),
    "pickled dtype name": _crafted({"tensors": [["w", "__reduce__", [2], 8]]}, GOOD_BODY),
    "shape and bytes disagree": _crafted({"tensors": [["w", "float32", [3], 8]]}, GOOD_BODY),
    "negative dimension": _crafted({"tensors": [["w", "float32", [-2], -8]]}, GOOD_BODY),
    "huge declared tensor": _crafted({"tensors": [["w", "float32", [1 << 40], 4 << 40]]}, GOOD_BODY),
    "huge dimension of empty tensor": _crafted({"tensors": [["w", "float32", [1 << 62, 0], 0]]}),
    "empty tensor whose strides overflow": _crafted(
        {"tensors": [["w", "float32", [0, 1 << 61, 1 << 61], 0]]}
    ),
    "checksum is a list": _crafted({"checksum": ["crc32"]}, GOOD_BODY),
    "metrics hold bytes": _crafted({"metrics": {"loss": b"\x00"}}, GOOD_BODY),
    "tree is a string": _crafted({"tree": "w"}, GOOD_BODY),
    "chunk size zero": _crafted({"chunk_bytes": 0}, GOOD_BODY),
    "chunk length lies": _crafted({}, fmt._ITEM.pack(0xC6, 4) + b"\x00" * 8 + fmt._ITEM.pack(0xCE, 0)),
    "chunk tag wrong": _crafted({}, b"\xc4" + GOOD_BODY[1:]),
    "chunk checksum wrong": _crafted({}, GOOD_BODY[:-1] + b"\x01"),
    "end marker missing": _crafted({}, GOOD_BODY, end=b"\xa3enx"),
    "trailing garbage": _crafted({}, GOOD_BODY) + b"\x00",
    "tree index out of range": _crafted({"tree": ["dict", [["w", ["tensor", 5]]]]}, GOOD_BODY),
    "tree uses a tensor twice": _crafted({"tree": ["list", [["tensor", 0], ["tensor", 0]]]}, GOOD_BODY),
    "tree unknown node": _crafted({"tree": ["object", "os.system", "echo"]}, GOOD_BODY),
    "tree node is not a list": _crafted({"tree": {"w": 1}}, GOOD_BODY),
    "tree node arity wrong": _crafted({"tree": ["dict", [["w", ["tensor", 0]]], "extra"]}, GOOD_BODY),
    "header deeply nested": _crafted({}, GOOD_BODY, raw_header=b"\x91" * 5000 + b"\xc0"),
    "tree deeply nested": _crafted({}, raw_header=_deep_tree_header(100_000)),
    "int leaf holds a str": _crafted({"tensors": [], "tree": ["int", "1"]}),
    "ext type in header": _crafted({}, GOOD_BODY, raw_header=msgpack.packb(msgpack.ExtType(1, b"x"))),
}


@pytest.fixture(scope="module", autouse=True)
def _memory_guard():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 300 * 1024, f"reading malformed files raised peak memory by {grown_kib} KiB"


def _assert_refused(path) -> CheckpointError:
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        checkpoint.restore(path)
    assert time.perf_counter() - start < 1.0
    return info.value


def test_crafted_control_file_is_valid(tmp_path):
    (tmp_path / "ok.ckpt").write_bytes(CRAFTED["control (valid)"])
    assert torch.equal(checkpoint.restore(tmp_path / "ok.ckpt")["w"], torch.zeros(2))


@pytest.mark.parametrize("case", [c for c in CRAFTED if c != "control (valid)"])
def test_crafted_file_is_refused(tmp_path, case):
    path = tmp_path / "bad.ckpt"
    path.write_bytes(CRAFTED[case])
    error = _assert_refused(path)
    assert str(path) in str(error)


def test_messages_name_the_problem(tmp_path):
    expectations = {
        "unknown dtype name": "unknown dtype name 'float33'",
        "shape and bytes disagree": "needs 12 bytes but the header says 8",
        "huge declared tensor": "truncated or its header declares too much data",
        "pickle": "pickle",
        "chunk checksum wrong": "checksum mismatch in tensor w chunk 1/1",
        "future format": "format version 99",
        "tree unknown node": "unknown node kind 'object'",
        "empty tensor whose strides overflow": "its sizes or strides overflow 64-bit integers",
        "checksum is a list": "header field 'checksum' must be str, but it is a list: ['crc32']",
        "tree uses a tensor twice": "malformed tree in header at [1]: tensor 0 is used twice",
    }
    for case, message in expectations.items():
        path = tmp_path / f"{len(message)}.ckpt"
        path.write_bytes(CRAFTED[case])
        assert message in str(_assert_refused(path)), case


@pytest.mark.parametrize("index", range(20))
def test_truncated_file_is_refused(tmp_path, index):
    data = _good_file(tmp_path)
    cut = [0, 1, 5, len(fmt.MAGIC), len(fmt.MAGIC) + 3][index] if index < 5 else (index - 4) * len(data) // 16
    cut = min(cut, len(data) - 1)
    (tmp_path / "cut.ckpt").write_bytes(data[:cut])
    assert "truncated" in str(_assert_refused(tmp_path / "cut.ckpt")) or cut < len(fmt.MAGIC) + 5


def test_every_flipped_bit_position_is_detected(tmp_path):
    data = _good_file(tmp_path)
    step = max(1, len(data) // 200)
    for position in range(0, len(data), step):
        for bit in (0, 7):
            corrupted = bytearray(data)
            corrupted[position] ^= 1 << bit
            (tmp_path / "flip.ckpt").write_bytes(bytes(corrupted))
            with pytest.raises(CheckpointError):
                checkpoint.restore(tmp_path / "flip.ckpt")


def test_flipped_tensor_byte_names_the_tensor(tmp_path):
    data = bytearray(_good_file(tmp_path))
    header = checkpoint.read_header(tmp_path / "good.ckpt")
    data[header.data_offset + 5] ^= 0xFF  # first data byte of the first tensor in file order, 'w'
    (tmp_path / "flip.ckpt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor w"):
        checkpoint.restore(tmp_path / "flip.ckpt")


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_pickle_payload_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "executed"
    for name, data in {
        "raw.ckpt": pickle.dumps({"w": _Payload(str(marker))}),
        "zip.pt": None,
    }.items():
        path = tmp_path / name
        if data is None:
            torch.save({"w": _Payload(str(marker))}, path)  # a torch.save file with code inside
        else:
            path.write_bytes(data)
        with pytest.raises(CheckpointError):
            checkpoint.restore(path)
        with pytest.raises(CheckpointError):
            checkpoint.load_state_dict(path)  # torch.load(weights_only=True) refuses the payload
        with pytest.raises(CheckpointError):
            checkpoint.read_header(path)
    assert not marker.exists(), "the pickle payload ran"


# Every header field with values of the wrong type: each entry point refuses it, naming the file and field.
WRONG_TYPES = {
    "format": ["1", 1.0, None, True, [1]],
    "functrain": [1, None, ["0"], b"0"],
    "torch": [0, None, {"version": "2"}],
    "step": ["1", 1.5, True, [1]],
    "created": ["yesterday", None, [0.0], True],
    "metrics": [[], "loss", None, {"loss": b"x"}, {b"loss": 1.0}, {"loss": [{"a": b"x"}]}],
    "metadata": [[], 1, None, {"tied_parameters": b"x"}],
    "chunk_bytes": ["1024", 1024.0, None, True],
    "checksum": [["crc32"], {"crc32": 1}, 32, None, b"crc32"],
    "tensors": [{}, "w", None],
    "tree": ["w", {"w": 0}, None, 0],
}
_WRONG_CASES = [(field, value) for field, values in WRONG_TYPES.items() for value in values]


@pytest.mark.parametrize(("field", "value"), _WRONG_CASES, ids=[f"{f}={v!r}" for f, v in _WRONG_CASES])
def test_wrong_header_field_type_is_named_at_every_entry_point(tmp_path, field, value):
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / "step_0000000001.ckpt"
    path.write_bytes(_crafted({field: value}, GOOD_BODY))
    expected = f"{path}: header field {field!r}"
    for read in (checkpoint.read_header, checkpoint.restore, checkpoint.load_state_dict):
        with pytest.raises(CheckpointError) as info:
            read(path)
        assert expected in str(info.value), read
    manager = checkpoint.CheckpointManager(folder)
    with pytest.warns(UserWarning, match="ignoring unreadable checkpoint") as warned:
        assert manager.latest() is None
    assert expected in str(warned[0].message)
    for read in (lambda: manager.header(1), lambda: manager.restore(1)):
        with pytest.raises(CheckpointError) as info:
            read()
        assert expected in str(info.value)


def test_missing_optional_fields_take_their_defaults(tmp_path):
    """Fields an older writer may not have written (versions, created, step, checksum) are optional."""
    header = _header({})
    for optional in ("functrain", "torch", "created", "step"):
        del header[optional]
    (tmp_path / "old.ckpt").write_bytes(_crafted({}, GOOD_BODY, raw_header=msgpack.packb(header)))
    read = checkpoint.read_header(tmp_path / "old.ckpt")
    assert (read.functrain_version, read.torch_version, read.created, read.step) == ("?", "?", 0.0, None)
    assert read.checksum == "crc32"
    assert torch.equal(checkpoint.restore(tmp_path / "old.ckpt")["w"], torch.zeros(2))


def _sparse_file(path, nbytes: int) -> None:
    """A checkpoint whose header declares one float32 tensor 'w' of ``nbytes`` and whose size agrees:
    a sparse file, nothing written where the data would be."""
    chunk = fmt.MAX_CHUNK_BYTES
    header = _header({"chunk_bytes": chunk, "tensors": [["w", "float32", [nbytes // 4], nbytes]]})
    start = _crafted({}, raw_header=msgpack.packb(header), end=b"")
    with open(path, "wb") as file:
        file.write(start)
        file.truncate(len(start) + nbytes + fmt._CHUNK_OVERHEAD * -(-nbytes // chunk) + len(fmt.END))


def test_a_sparse_file_declaring_a_terabyte_is_refused_before_allocating(tmp_path):
    path = tmp_path / "huge.ckpt"
    _sparse_file(path, 1 << 40)
    assert checkpoint.read_header(path).num_bytes == 1 << 40  # the header alone is consistent
    folder = tmp_path / "run"
    folder.mkdir()
    os.link(path, folder / "step_0000000001.ckpt")
    manager = checkpoint.CheckpointManager(folder)
    for read in (checkpoint.restore, checkpoint.load_state_dict, lambda _: manager.restore("latest")):
        start = time.perf_counter()
        with pytest.raises(CheckpointError) as info:
            read(path)
        assert time.perf_counter() - start < 1.0
        message = str(info.value)
        assert "loading needs 1.0 TiB (1099511627776 bytes)" in message, message
        assert "for tensor 'w'" in message and "of memory is available" in message
        assert message.startswith(str(path)) or message.startswith(str(folder))


def test_the_memory_check_refuses_only_what_does_not_fit(tmp_path, monkeypatch):
    """Exactly enough memory loads; one byte less is refused, naming the file, tensor and sizes."""
    state = {"a": torch.randn(100), "b": torch.arange(50)}
    checkpoint.save(tmp_path / "s.ckpt", state, fsync=False)
    needed = 100 * 4 + 50 * 8
    monkeypatch.setattr(fmt, "available_memory", lambda: needed)
    assert torch.equal(checkpoint.restore(tmp_path / "s.ckpt")["a"], state["a"])
    assert torch.equal(
        checkpoint.load_state_dict(tmp_path / "s.ckpt", wanted=lambda n: n == "a")["a"], state["a"]
    )
    monkeypatch.setattr(fmt, "available_memory", lambda: needed - 1)
    with pytest.raises(CheckpointError) as info:
        checkpoint.restore(tmp_path / "s.ckpt")
    assert str(info.value).startswith(f"{tmp_path / 's.ckpt'}: loading needs 800 B (800 bytes)")
    assert "400 B (400 bytes) of it for tensor 'a'" in str(info.value)
    assert "799 B (799 bytes) of memory is available" in str(info.value)
    # Reading part of it needs only that part's memory.
    monkeypatch.setattr(fmt, "available_memory", lambda: 400)
    assert sorted(checkpoint.load_state_dict(tmp_path / "s.ckpt", wanted=lambda n: n == "b")) == ["b"]


def test_without_a_memory_figure_the_allocator_refusal_is_still_a_checkpoint_error(tmp_path, monkeypatch):
    path = tmp_path / "huge.ckpt"
    _sparse_file(path, 1 << 40)
    monkeypatch.setattr(fmt, "available_memory", lambda: None)  # a platform that does not say
    with pytest.raises(CheckpointError, match=str(path)):  # the allocator refuses, or the zeros do not parse
        checkpoint.restore(path)


def test_export_refuses_pickles_in_its_own_words(tmp_path):
    """`functrain export` of a torch.save file: functrain's refusal and advice, never torch's."""
    marker = tmp_path / "executed"
    torch.save({"w": torch.ones(2)}, tmp_path / "tensors.pt")
    torch.save({"w": _Payload(str(marker))}, tmp_path / "payload.pt")
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps({"w": _Payload(str(marker))}))
    for name in ("tensors.pt", "payload.pt", "raw.pkl"):
        with pytest.raises(CheckpointError) as info:
            checkpoint.export(tmp_path / name, tmp_path / "out.safetensors", format="safetensors")
        message = str(info.value)
        assert message.startswith(f"{tmp_path / name}: not a functrain checkpoint: it looks like a pickle")
        assert "loading a pickle can run arbitrary code" in message and "functrain.checkpoint.save" in message
        assert "weights_only" not in message and info.value.__cause__ is None
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_load_state_dict_refuses_pickled_objects_without_torchs_advice(tmp_path):
    marker = tmp_path / "executed"
    torch.save({"w": _Payload(str(marker))}, tmp_path / "payload.pt")
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps({"w": _Payload(str(marker))}))
    for name in ("payload.pt", "raw.pkl"):
        with pytest.raises(CheckpointError) as info:
            checkpoint.load_state_dict(tmp_path / name)
        message = str(info.value)
        assert message.startswith(
            f"{tmp_path / name}: not a functrain checkpoint, a safetensors file or a torch"
        )
        assert "refused it with UnpicklingError" in message and "can run arbitrary code" in message
        assert "weights_only=False" not in message and info.value.__suppress_context__
    assert not marker.exists()


_MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["crc32", "xxh3_64_low32", "float32", "tensor", "dict", "w"]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)
_TENSOR_ROWS = st.lists(
    st.tuples(
        st.text(max_size=3) | _MSGPACK_VALUES,
        st.sampled_from(["float32", "int64", "bool", "float33"]) | _MSGPACK_VALUES,
        st.lists(st.integers(min_value=-2, max_value=2**64 - 1) | _MSGPACK_VALUES, max_size=4)
        | _MSGPACK_VALUES,
        st.integers(min_value=-1, max_value=2**64 - 1) | _MSGPACK_VALUES,
    ).map(list),
    max_size=3,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(
        st.sampled_from(sorted(_header({}))),
        _MSGPACK_VALUES | _TENSOR_ROWS,
        max_size=3,
    ),
    removed=st.sets(st.sampled_from(sorted(_header({}))), max_size=2),
)
def test_fuzzed_header_fields_raise_only_checkpoint_errors(tmp_path, changes, removed):
    """Any values in any header fields: each entry point works or raises CheckpointError naming the file."""
    header = _header(changes)
    for key in removed:
        header.pop(key, None)
    path = tmp_path / "fuzz.ckpt"
    path.write_bytes(_crafted({}, GOOD_BODY, raw_header=msgpack.packb(header, use_bin_type=True)))
    for read in (checkpoint.read_header, checkpoint.restore, checkpoint.load_state_dict):
        try:
            read(path)
        except CheckpointError as error:
            assert str(error).startswith(str(path)), error
