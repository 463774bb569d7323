"""The ``inspect`` and ``export`` sub-commands, through a parser built as the main command builds it."""

from __future__ import annotations

import argparse

import torch

from functrain import checkpoint
from functrain.checkpoint.cli import register


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="functrain")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_inspect_prints_header_and_tree(tmp_path, capsys):
    state = {"params": {"fc.weight": torch.zeros(4, 3, dtype=torch.bfloat16)}, "buffers": {}, "step": 9}
    checkpoint.save(tmp_path / "s.ckpt", state, step=9, metrics={"loss": 0.5}, fsync=False)
    assert _run("inspect", str(tmp_path / "s.ckpt")) == 0
    out = capsys.readouterr().out
    assert "step: 9" in out and "format version: 1" in out and f"torch {torch.__version__}" in out
    assert '"loss": 0.5' in out
    line = next(x for x in out.splitlines() if "fc.weight" in x)
    assert "bfloat16" in line and "[4, 3]" in line and "24 B" in line


def test_export_writes_loadable_files(tmp_path, capsys):
    state = {"params": {"w": torch.randn(3)}, "buffers": {"b": torch.arange(2)}}
    checkpoint.save(tmp_path / "s.ckpt", state, fsync=False)
    assert _run("export", str(tmp_path / "s.ckpt"), "--format", "pt", "--output", str(tmp_path / "m.pt")) == 0
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["params"]["w"]) and torch.equal(loaded["b"], state["buffers"]["b"])
    assert (
        _run(
            "export", str(tmp_path / "s.ckpt"), "--format", "safetensors", "--output", str(tmp_path / "m.st")
        )
        == 0
    )
    assert torch.equal(checkpoint.load_state_dict(tmp_path / "m.st")["w"], state["params"]["w"])
    assert "wrote 2 tensors" in capsys.readouterr().out


def test_bad_checkpoint_is_an_error_message_and_status_1(tmp_path, capsys):
    (tmp_path / "bad.ckpt").write_bytes(b"nonsense")
    assert _run("inspect", str(tmp_path / "bad.ckpt")) == 1
    assert "not a functrain checkpoint" in capsys.readouterr().err
