"""Exact resume: a run stopped anywhere and restarted in a new process ends bit-identical.

Each run is a fresh process (tests/resume_job.py) with dropout, shuffling, BatchNorm, a schedule, early
stopping (restore_best) and gradient accumulation active.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from functrain import checkpoint, tree

JOB = str(Path(__file__).with_name("resume_job.py"))


def run_job(run_dir: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, JOB, str(run_dir), *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def load_final(run_dir: Path):
    return checkpoint.restore(run_dir / "final.ckpt")


def assert_bitwise_equal(a, b) -> None:
    la, sa = tree.flatten(a)
    lb, sb = tree.flatten(b)
    assert sa == sb, f"structures differ:\n{sa}\n{sb}"
    paths = tree.paths(a)
    for path, x, y in zip(paths, la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (
                f"differs at {path}"
            )
        else:
            assert x == y, f"differs at {path}: {x!r} != {y!r}"


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_job(run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop_at",
    [
        7,  # mid-epoch (9 batches per epoch)
        10,  # just after an evaluation (eval_every=5)
        18,  # at an epoch boundary
    ],
)
def test_resume_is_bit_identical(reference: Path, tmp_path: Path, stop_at: int):
    first = run_job(tmp_path, "--stop-at", str(stop_at))
    assert f"DONE {stop_at} test interruption" in first
    run_job(tmp_path, "--resume")
    assert_bitwise_equal(load_final(reference), load_final(tmp_path))
    assert jsonl(reference) == jsonl(tmp_path)


@pytest.mark.slow
def test_sigterm_then_resume_is_bit_identical(reference: Path, tmp_path: Path):
    proc = subprocess.Popen(
        [sys.executable, JOB, str(tmp_path), "--sleep", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.startswith("STEP 13") or time.time() > deadline:
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "preempted by SIGTERM" in out
    stopped = int(out.split("DONE ")[1].split()[0])
    assert 13 <= stopped < 36
    assert os.listdir(tmp_path / "checkpoints")
    run_job(tmp_path, "--resume")
    assert_bitwise_equal(load_final(reference), load_final(tmp_path))


@pytest.mark.compile
def test_compiled_resume_is_bit_identical(tmp_path: Path):
    full = tmp_path / "full"
    part = tmp_path / "part"
    full.mkdir()
    part.mkdir()
    run_job(full, "--compile")
    run_job(part, "--compile", "--stop-at", "11")
    run_job(part, "--compile", "--resume")
    # bitwise: every process compiles the same graphs into the same kernels on this machine
    assert_bitwise_equal(load_final(full), load_final(part))
