"""A compile is announced: a log line when the first compile of a step starts, with the last compile's time
of the same step on this machine (functrain's per-user cache), and a progress bar saying "compiling"."""

from __future__ import annotations

import logging

import pytest
import torch

import functrain as ft
from functrain.callbacks import Context, ProgressBar
from functrain.compile import compile_times as _compile_times

ANNOUNCE = "compiling doubled: first call"


def doubled(state, x):
    return state, x * 2


def test_compile_key_changes_with_what_decides_the_graph():
    model = torch.nn.Linear(3, 2)
    call = (None, (torch.zeros(4, 3),), {})
    key = _compile_times.compile_key("train_step", model, call, {"mode": None})
    assert key == _compile_times.compile_key("train_step", torch.nn.Linear(3, 2), call, {"mode": None})
    others = [
        _compile_times.compile_key("eval_step", model, call, {"mode": None}),
        _compile_times.compile_key("train_step", torch.nn.Linear(3, 5), call, {"mode": None}),
        _compile_times.compile_key("train_step", model, (None, (torch.zeros(5, 3),), {}), {"mode": None}),
        _compile_times.compile_key("train_step", model, (None, (torch.zeros(4, 3).double(),), {}), {}),
        _compile_times.compile_key("train_step", model, call, {"mode": "max-autotune"}),
    ]
    assert len({key, *others}) == 6


def test_estimates_are_kept_per_key_and_a_broken_cache_only_loses_them(tmp_path, monkeypatch):
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    assert _compile_times.estimate("a") is None
    _compile_times.record("a", 12.345)
    _compile_times.record("b", 3.0)
    assert _compile_times.estimate("a") == 12.35 and _compile_times.estimate("b") == 3.0
    (tmp_path / "cache" / "compile-seconds.json").write_text("{not json")
    assert _compile_times.estimate("a") is None
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(blocked))  # not a directory: nothing can be written
    _compile_times.record("a", 1.0)
    assert _compile_times.estimate("a") is None


@pytest.mark.compile
def test_first_compile_is_announced_with_the_last_compile_time_on_this_machine(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path))
    x = torch.arange(6.0)
    with caplog.at_level(logging.INFO, logger="functrain.jit"):
        step = ft.jit(doubled, seed=False)
        step(None, x)
        step(None, x)
    announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
    assert announced == [ANNOUNCE], announced  # once, before the first compile only
    assert step.num_compiles == 1

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="functrain.jit"):
        again = ft.jit(doubled, seed=False)  # the same step in a new process would read the same record
        again(None, x)
        ft.jit(doubled, seed=False)(None, torch.arange(7.0))  # another shape: another graph, no estimate
    announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
    assert len(announced) == 2, announced
    assert (
        announced[0].startswith(ANNOUNCE + " (~")
        and "the last compile of this step on this machine" in announced[0]
    )
    assert announced[1] == ANNOUNCE


@pytest.mark.compile
def test_an_unwritable_cache_only_loses_the_estimate(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(blocked))
    with caplog.at_level(logging.INFO, logger="functrain.jit"):
        for _ in range(2):
            out = ft.jit(doubled, seed=False)(None, torch.ones(3))[1]
    assert torch.equal(out, torch.full((3,), 2.0))
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")] == [
        ANNOUNCE
    ] * 2


def test_progress_bar_says_compiling_until_the_first_step_returns():
    bar = ProgressBar(leave=False)
    ctx = Context(max_steps=3, step=0, compiles=0, logs={})
    bar.on_train_begin(None, ctx)
    assert bar._bar.desc == "compiling"
    bar.on_step_end(None, ctx)
    assert bar._bar.desc == "" and bar._bar.n == 1
    bar.on_train_end(None, ctx)

    bar.on_train_begin(None, Context(max_steps=3, step=1, compiles=1, logs={}))  # compiled before
    assert bar._bar.desc == ""
    bar.on_train_end(None, ctx)
