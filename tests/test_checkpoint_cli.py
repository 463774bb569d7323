"""The ``inspect`` and ``export`` sub-commands, through a parser built as the main command builds it."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

import torch

from functrain import checkpoint
from functrain.checkpoint.cli import register
from functrain.cli import main


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


def test_bad_checkpoint_is_a_one_line_error_and_status_2(tmp_path, capsys):
    (tmp_path / "bad.ckpt").write_bytes(b"nonsense")
    assert main(["inspect", str(tmp_path / "bad.ckpt")]) == 2  # a user error, as for every command
    err = capsys.readouterr().err
    assert err.startswith("functrain inspect: ") and "not a functrain checkpoint" in err
    assert len(err.strip().splitlines()) == 1


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    """`functrain inspect CKPT | head -1`: no BrokenPipeError traceback, status 141 (128 + SIGPIPE)."""
    state = {f"layer{i}.weight": torch.zeros(1) for i in range(3000)}  # ~200 KiB of output: more than a pipe
    checkpoint.save(tmp_path / "s.ckpt", state, fsync=False)
    command = [sys.executable, "-m", "functrain", "inspect", str(tmp_path / "s.ckpt")]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout.readline().startswith(b"checkpoint: ")
    process.stdout.close()  # what head does after its first line
    errors = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, errors
    assert errors == ""


class _ClosedPipe(io.StringIO):
    """A stdout whose reader has gone: writing (``on="write"``) or flushing fails with EPIPE."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.on = on

    def write(self, text):
        if self.on == "write":
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)

    def flush(self):
        if self.on == "flush":
            raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_ends_main_with_141(monkeypatch, tmp_path):
    checkpoint.save(tmp_path / "s.ckpt", {"w": torch.ones(2)}, fsync=False)
    for on in ("write", "flush"):  # a long output fails while printing; a short one at the final flush
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(on))
        assert main(["inspect", str(tmp_path / "s.ckpt")]) == 141
