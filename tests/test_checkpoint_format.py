"""Round trips through the checkpoint file format: every leaf type, bit-exact, streamed, chunked."""

from __future__ import annotations

import collections
import struct as binary
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_checkpoint_helpers import assert_bit_equal, plain

from functrain import checkpoint, tree
from functrain.checkpoint import format as fmt

DTYPES = [fmt.dtype_from_name(name) for name in fmt._DTYPES]
Pair = collections.namedtuple("Pair", "first second")


@tree.struct
class Box:
    value: object
    label: str = tree.field(static=True, default="box")


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    numel = 1
    for size in shape:
        numel *= size
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    t = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if raw
        else torch.empty(shape, dtype=dtype)
    )
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous
    elif t.dim() == 1 and t.numel() > 1 and draw(st.booleans()):
        t = t[::2]
    return t


any_float = st.binary(min_size=8, max_size=8).map(lambda b: binary.unpack("<d", b)[0])  # NaN payloads too
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    any_float,
    st.builds(complex, any_float, any_float),
    st.text(max_size=5),
    st.binary(max_size=5),
)
leaves = st.one_of(tensors(), scalars)
keys = st.one_of(st.text(max_size=4), st.integers(-5, 5))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.builds(Pair, children, children),
        st.builds(Box, children),
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=trees)
def test_round_trip_is_bit_exact_with_and_without_target(tmp_path, state):
    path = tmp_path / "state.ckpt"
    checkpoint.save(path, state, step=3, fsync=False, chunk_bytes=7)  # tiny chunks: many per tensor
    assert_bit_equal(checkpoint.restore(path), plain(state))
    assert_bit_equal(checkpoint.restore(path, target=state), state)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5, 7)], ids=str)
def test_every_dtype_and_shape_round_trips(tmp_path, dtype, shape):
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape)
    checkpoint.save(tmp_path / "t.ckpt", {"t": t}, fsync=False)
    assert_bit_equal(checkpoint.restore(tmp_path / "t.ckpt")["t"], t)


def test_conjugate_negative_and_strided_views_save_their_values(tmp_path):
    z = torch.randn(4, 3, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": torch._neg_view(z), "strided": torch.randn(6, 8)[::2, 1::3], "t": z.t()}
    checkpoint.save(tmp_path / "v.ckpt", state, fsync=False, chunk_bytes=16)
    restored = checkpoint.restore(tmp_path / "v.ckpt")
    for name, view in state.items():
        assert torch.equal(restored[name], view.resolve_conj().resolve_neg()), name
        assert restored[name].is_contiguous() and not restored[name].is_conj()


def test_large_non_contiguous_tensor_is_copied_a_slice_at_a_time(tmp_path):
    base = torch.randn(64, 300, 5)
    view = base.permute(2, 1, 0)  # each leading slice is 300*64 floats = 75 KiB
    checkpoint.save(tmp_path / "p.ckpt", [view], fsync=False, chunk_bytes=20_000)
    assert torch.equal(checkpoint.restore(tmp_path / "p.ckpt")[0], view)


def test_header_is_read_without_tensors(tmp_path):
    state = {"params": {"w": torch.zeros(3, 4, dtype=torch.bfloat16)}, "step": 12, "note": None}
    checkpoint.save(
        tmp_path / "h.ckpt", state, step=12, metrics={"loss": torch.tensor(0.5)}, metadata={"a": (1, 2)}
    )
    header = checkpoint.read_header(tmp_path / "h.ckpt")
    assert header.step == 12 and header.format_version == fmt.FORMAT_VERSION
    assert header.torch_version == torch.__version__
    assert header.metrics == {"loss": 0.5} and header.metadata == {"a": [1, 2]}
    assert header.tensors == [checkpoint.TensorInfo("params.w", torch.bfloat16, (3, 4), 24)]


def test_chunks_stay_below_the_chunk_size(tmp_path):
    t = torch.arange(1000, dtype=torch.int64)
    checkpoint.save(tmp_path / "c.ckpt", t, fsync=False, chunk_bytes=3000)
    data = (tmp_path / "c.ckpt").read_bytes()
    header = checkpoint.read_header(tmp_path / "c.ckpt")
    lengths = []
    offset = header.data_offset
    while data[offset] == 0xC6:
        length = int.from_bytes(data[offset + 1 : offset + 5], "big")
        lengths.append(length)
        offset += 5 + length + 5
    assert lengths == [3000, 3000, 2000]
    assert data[offset:] == fmt.END


def test_streaming_save_and_load_make_no_big_python_objects(tmp_path):
    state = {"big": torch.randn(8 << 20)}  # 32 MiB
    tracemalloc.start()
    try:
        checkpoint.save(tmp_path / "s.ckpt", state, fsync=False, chunk_bytes=4 << 20)
        checkpoint.restore(tmp_path / "s.ckpt", target=state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"Python objects peaked at {peak} bytes"


@pytest.mark.filterwarnings("ignore:.*quantize_per_tensor:UserWarning")
def test_unsupported_leaves_name_their_path(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=r"opt\[1\].*object"):
        checkpoint.save(tmp_path / "x.ckpt", {"opt": [1, object()]})
    with pytest.raises(checkpoint.CheckpointError, match=r"big.*64 bits"):
        checkpoint.save(tmp_path / "x.ckpt", {"big": 2**70})
    with pytest.raises(checkpoint.CheckpointError, match=r"q.*quint8|quint8.*q"):
        checkpoint.save(
            tmp_path / "x.ckpt", {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)}
        )
    with pytest.raises(checkpoint.CheckpointError, match=r"metadata.*JSON-like"):
        checkpoint.save(tmp_path / "x.ckpt", {}, metadata={"f": object()})
    assert not (tmp_path / "x.ckpt").exists()
    assert list(tmp_path.iterdir()) == [], "a failed save leaves no temporary file"
