"""`functrain train --resume RUN_DIR`: a run continues from its own folder and saved config, and the hint an
interrupted run prints is that command; `functrain eval` says which step (and file) it evaluated. Run as a
user runs it (subprocesses), eager only."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_errors import _MYTASK, ROOT, assert_one_line_refusal
from test_cli_errors import _RUN as _RUN_TEMPLATE

_RUN = _RUN_TEMPLATE.format(out="runs/reg")  # the errors tests' project, run in runs/reg


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """run.yaml and mytask.py in conf/, the command run from the project folder (mytask is found beside
    the config only)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mytask.py").write_text(_MYTASK)
    (tmp_path / "conf" / "run.yaml").write_text(_RUN)
    return tmp_path


def _env() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "FUNCTRAIN_DEBUG"}
    environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return environ


def functrain(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "functrain", *argv]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=_env(), timeout=300)


def _params(run: Path, step: int) -> dict:
    from functrain import checkpoint  # torch: only here

    return checkpoint.restore(run / "checkpoints" / f"step_{step:010d}.ckpt")["state"]["params"]


def _interrupted(cwd: Path, argv: list[str]) -> str:
    """Run ``functrain`` with ``argv``, SIGINT once training is under way; its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "functrain", *argv],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    deadline = time.time() + 240
    assert proc.stdout is not None
    for line in proc.stdout:  # step 1's scalars are printed as step 2 begins: training is under way
        if line.startswith("step ") or time.time() > deadline:
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    return err


@pytest.mark.slow
def test_the_printed_hint_resumes_the_interrupted_run_and_no_other(project: Path):
    """Before: the hint was `functrain train run.yaml resume_from_checkpoint=true`, which dropped the
    overrides and resumed runs/reg (the YAML's own output_dir), finished: RunFinishedWarning, exit 0."""
    first = functrain(project, "train", "conf/run.yaml")  # the YAML's own run, finished
    assert first.returncode == 0, first.stderr[-3000:]
    reg = {p: p.read_bytes() for p in (project / "runs" / "reg").rglob("*") if p.is_file()}
    overrides = ["output_dir=runs/my sig", "epochs=3", "seed=5", "train_dataset=mytask:Slow"]
    err = _interrupted(project, ["train", "conf/run.yaml", *overrides, "log_steps=1", "print_steps=1"])
    hint = err.strip().splitlines()[-1].partition("continue with: ")[2]
    assert hint == "functrain train --resume 'runs/my sig'", err[-3000:]
    sig = project / "runs" / "my sig"
    steps = sorted(int(f[5:15]) for f in os.listdir(sig / "checkpoints"))
    assert steps and steps[-1] < 12  # stopped before the end (3 epochs of 4 steps)

    elsewhere = project / "elsewhere"  # the hint works from another folder too: the run names its imports
    elsewhere.mkdir()
    (elsewhere / "runs").symlink_to(project / "runs")
    resumed = subprocess.run(
        [sys.executable, "-m", *shlex.split(hint)], cwd=elsewhere, capture_output=True, text=True, env=_env()
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["step"] == 12  # its epochs=3, not the YAML's 1
    assert (
        f"resumed from step {steps[-1]} (runs/my sig/checkpoints/step_{steps[-1]:010d}.ckpt)"
        in resumed.stderr
    )
    assert "RunFinishedWarning" not in resumed.stderr
    assert {p: p.read_bytes() for p in (project / "runs" / "reg").rglob("*") if p.is_file()} == reg

    whole = functrain(project, "train", "conf/run.yaml", *overrides[1:], "output_dir=runs/whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected, got = _params(project / "runs" / "whole", 12), _params(sig, 12)
    assert expected.keys() == got.keys()
    for name in expected:  # bitwise the uninterrupted run
        assert expected[name].equal(got[name]), name


@pytest.mark.slow
def test_resume_takes_overrides_and_additional_steps(project: Path):
    out = functrain(project, "train", "conf/run.yaml", "output_dir=runs/a", "epochs=2")
    assert out.returncode == 0, out.stderr[-3000:]
    more = functrain(project, "train", "--resume", "runs/a", "epochs=3", "--additional-steps", "2")
    assert more.returncode == 0, more.stderr[-3000:]
    assert json.loads(more.stdout.strip().splitlines()[-1])["step"] == 10  # 8 + 2
    longer = functrain(project, "train", "--resume", "runs/a", "epochs=3")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert json.loads(longer.stdout.strip().splitlines()[-1])["step"] == 12
    assert "epochs: 3" in (project / "runs" / "a" / "config.yaml").read_text()  # the next --resume's too


@pytest.mark.slow
def test_the_hint_of_an_interrupted_additional_run_trains_what_was_left(project: Path):
    out = functrain(project, "train", "conf/run.yaml", "output_dir=runs/x", "train_dataset=mytask:Slow")
    assert out.returncode == 0, out.stderr[-3000:]  # 1 epoch: 4 steps
    err = _interrupted(project, ["train", "--resume", "runs/x", "--additional-epochs", "4", "print_steps=1"])
    stopped = int(err.partition(" at step ")[2].split(",")[0])
    hint = err.strip().splitlines()[-1].partition("continue with: ")[2]
    assert 4 < stopped < 20 and hint == f"functrain train --resume runs/x --additional-steps {20 - stopped}"
    resumed = subprocess.run(
        [sys.executable, "-m", *shlex.split(hint)], cwd=project, capture_output=True, text=True, env=_env()
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["step"] == 20  # the 4 more epochs, no more


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["train", "--resume", "runs/none"], ["--resume", "runs/none: no such folder", "--resume runs/sig"]),
        (["train", "--resume", "conf"], ["conf: holds no config.yaml", "not a run directory"]),
        (["train", "--resume", "runs/b", "output_dir=runs/c"], ["output_dir", "continues runs/b in place"]),
        (["train", "runs/b"], ["runs/b: is a directory", "--resume runs/b"]),
    ],
)
def test_resume_refusals_are_one_line(project: Path, argv, needles):
    (project / "runs" / "b").mkdir(parents=True)
    (project / "runs" / "b" / "config.yaml").write_text(_RUN)
    assert_one_line_refusal(functrain(project, *argv), "train", *needles)


def test_resume_with_a_config_file_too_is_refused(project: Path):
    out = functrain(project, "train", "conf/run.yaml", "--resume", "runs/reg")
    assert out.returncode == 2 and "not both" in out.stderr


def test_eval_says_its_step_and_that_it_skipped_an_unreadable_newest_checkpoint(project: Path):
    evaluated = ["eval_dataset=mytask:train_set", "output_dir=runs/e"]
    out = functrain(project, "train", "conf/run.yaml", "epochs=2", *evaluated)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = Path("runs/e/checkpoints")
    out = functrain(project, "eval", "conf/run.yaml", *evaluated)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 8 and result["checkpoint"] == str(folder / "step_0000000008.ckpt")
    assert "eval/loss" in result and "cannot be read" not in out.stderr

    newest = project / folder / "step_0000000008.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    out = functrain(project, "eval", "conf/run.yaml", *evaluated)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])  # before: step 4 evaluated, silently
    assert result["step"] == 4 and result["checkpoint"] == str(folder / "step_0000000004.ckpt")
    assert (
        f"functrain eval: the newest checkpoint, {folder / 'step_0000000008.ckpt'}, cannot be read; using "
        f"step 4 ({folder / 'step_0000000004.ckpt'})"
    ) in out.stderr
    assert out.stderr.count("ignoring unreadable checkpoint") == 1, out.stderr  # before: three times


@pytest.mark.slow
def test_torchrun_ranks_write_the_same_new_version(tmp_path: Path):
    """Sharded checkpoints are written by every rank: all of them must take rank 0's folder."""
    from test_sharding_trainer import _torchrun_cli
    from test_trainer import write_config

    from functrain.checkpoint import sharded

    path = write_config(tmp_path, epochs=1, batch_size=8, test_dataset=None)
    _torchrun_cli(tmp_path, str(path), "sharding=params")
    first = {p: p.read_bytes() for p in (tmp_path / "cli_run").rglob("*") if p.is_file()}
    again = _torchrun_cli(tmp_path, str(path), "sharding=params")
    version = tmp_path / "cli_run-1"
    assert again.stderr.count(f"this run writes '{version}'") == 1  # rank 0 says it
    assert sharded.sharded_steps(version / "checkpoints") == [4]
    assert sharded._Source(version / "checkpoints", 4).world_size == 2  # both ranks' files are there
    assert {p: p.read_bytes() for p in (tmp_path / "cli_run").rglob("*") if p.is_file()} == first
