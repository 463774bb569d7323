"""`functrain --help` and `--help-config` answer at once: importing functrain or its CLI loads no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import sys
import functrain
from functrain.cli import main
for argv in (["--help"], ["inspect", "--help"], ["plot", "--help"], ["train", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
main(["train", "--help-config"])
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("HEAVY", heavy[:5])
"""


def test_help_and_help_config_import_no_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-2000:]
    assert "optimizer.lr" in out.stdout and "--additional-epochs" in out.stdout
    assert "the config file's directory" in out.stdout  # where import specs are looked up


def test_lazy_names_resolve_to_the_same_objects():
    import functrain as ft
    import functrain.jit  # importing the sub-module must not replace the function ft.jit
    from functrain.jit import jit
    from functrain.loop import fit

    assert ft.jit is jit and ft.fit is fit and callable(ft.jit)
    assert all(hasattr(ft, name) for name in ft.__all__)
    assert all(hasattr(ft.checkpoint, name) for name in ft.checkpoint.__all__)
    assert all(hasattr(ft.logging, name) for name in ft.logging.__all__)
    assert {"fit", "optim", "Trainer"} <= set(dir(ft))


def test_a_torchrun_rank_exits_without_interpreter_teardown(monkeypatch, capsys):
    # The console entry: sys.exit(status) in one process; under torchrun os._exit(status) after flushing
    # (a gloo rank sometimes aborted in C++ teardown after finishing, failing a finished run).
    import importlib

    import pytest

    cli_main = importlib.import_module("functrain.cli.main")  # the module (functrain.cli.main is main())

    exits: list[int] = []

    def fake_exit(status: int) -> None:
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(cli_main.os, "_exit", fake_exit)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as one_process:
        cli_main.run(["inspect", "no-such.ckpt"])
    assert one_process.value.code == 2 and exits == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        cli_main.run(["inspect", "no-such.ckpt"])
    assert exits == [2]
    assert "no-such.ckpt" in capsys.readouterr().err  # the message was flushed before the exit
