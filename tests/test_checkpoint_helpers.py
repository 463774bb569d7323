"""Shared by the checkpoint tests (no tests here): bit-exact tree comparison and a TrainState stand-in."""

from __future__ import annotations

import struct as binary
from typing import Any

import torch

from functrain import tree


@tree.struct
class StandInState:
    """The fields of functrain's TrainState that checkpoints care about."""

    step: torch.Tensor
    params: dict
    buffers: dict
    opt_state: Any
    rng: torch.Tensor
    name: str = tree.field(static=True, default="stand-in")


def tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    flat = flat.new_empty(flat.shape).copy_(flat)  # standard strides (a one-element view may keep odd ones)
    return bytes(flat.view(torch.uint8).numpy())


def assert_bit_equal(got: Any, expected: Any, path: str = "") -> None:
    """Same structure, container types, leaf types and bytes (NaN payloads and signed zeros included)."""
    assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert tensor_bytes(got) == tensor_bytes(expected), path
    elif isinstance(expected, float):
        assert binary.pack("<d", got) == binary.pack("<d", expected), path
    elif isinstance(expected, complex):
        assert binary.pack("<dd", got.real, got.imag) == binary.pack("<dd", expected.real, expected.imag), (
            path
        )
    elif isinstance(expected, dict):
        assert list(got) == list(expected), path
        for key in expected:
            assert_bit_equal(got[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_bit_equal(a, b, f"{path}[{i}]")
    elif tree.is_struct(expected):
        data, static = expected.__functrain_struct__
        for name in data:
            assert_bit_equal(getattr(got, name), getattr(expected, name), f"{path}.{name}")
        for name in static:
            assert getattr(got, name) == getattr(expected, name), f"{path}.{name}"
    else:
        assert got == expected, path


def plain(obj: Any) -> Any:
    """What restore without a target returns for ``obj``: structs as dicts, named tuples as tuples."""
    if tree.is_struct(obj):
        data, _ = obj.__functrain_struct__
        return {name: plain(getattr(obj, name)) for name in data}
    if isinstance(obj, tuple):
        return tuple(plain(x) for x in obj)
    if isinstance(obj, list):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj
