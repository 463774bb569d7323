"""Profiler callback: a Chrome trace of exactly the window's steps, nothing outside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import functrain as ft


def _run(callbacks: list, steps: int) -> ft.FitResult:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss)), compile=False)
    data = torch.utils.data.TensorDataset(torch.randn(8 * steps, 4), torch.randn(8 * steps, 1))
    return ft.fit(state, step, data, batch_size=8, epochs=1, callbacks=callbacks, progress_bar=False)


def _profiler_steps(trace: dict) -> list[str]:
    return sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})


def test_trace_covers_the_active_steps_only(tmp_path: Path) -> None:
    profiler = ft.callbacks.Profiler(tmp_path / "profile", wait=2, warmup=1, active=2)
    # at each step's end: (is a torch profiler recording, does the callback hold a profiler at all)
    seen: list[tuple[bool, bool]] = []
    probe = ft.callbacks.LambdaCallback(
        on_step_end=lambda s, ctx: (
            seen.append((torch.autograd.profiler._is_profiler_enabled, profiler._prof is not None)) or s
        )
    )
    _run([probe, profiler], steps=8)  # the probe first: it sees the step as the profiler ran it
    files = sorted((tmp_path / "profile").iterdir())
    assert files == [tmp_path / "profile" / "trace_rank0_step3.json"] == [profiler.trace_path]
    trace = json.loads(files[0].read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names and "aten::mm" in names  # the step's forward and backward ops
    assert len(_profiler_steps(trace)) == 2  # the two active steps, not the warm-up one
    # a profiler exists during the warm-up and active steps (2, 3, 4) only, and records the active ones
    assert [held for _, held in seen] == [False, False, True, True, True, False, False, False]
    assert [on for on, _ in seen] == [False, False, False, True, True, False, False, False]


def test_run_ending_inside_the_window_still_writes_the_trace(tmp_path: Path) -> None:
    profiler = ft.callbacks.Profiler(tmp_path, wait=0, warmup=1, active=5, tensorboard=True)
    _run([profiler], steps=3)
    assert profiler.trace_path is not None and profiler.trace_path.exists()
    assert json.loads(profiler.trace_path.read_text())["traceEvents"]
    assert [p.name for p in tmp_path.glob("*.pt.trace.json")] == ["rank0.step1.pt.trace.json"]


def test_window_after_the_run_writes_nothing(tmp_path: Path) -> None:
    profiler = ft.callbacks.Profiler(tmp_path / "p", wait=10)
    _run([profiler], steps=3)
    assert profiler.trace_path is None and not (tmp_path / "p").exists()


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="Profiler: active must be an int >= 1"):
        ft.callbacks.Profiler("x", active=0)
    with pytest.raises(ValueError, match="enable one to write a trace"):
        ft.callbacks.Profiler("x", chrome=False)
