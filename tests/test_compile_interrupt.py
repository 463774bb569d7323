"""Ctrl-C during a compile, and inductor's compile workers (functrain.compile.interrupt).

On the old code a SIGINT under :class:`functrain.callbacks.Preemption` waited for the compile to finish
(72 s for a small MLP on the loaded 2-core machine) before the run saved and stopped, and a plain
``KeyboardInterrupt`` left inductor's worker threads running ``g++`` on every queued kernel, which the
interpreter waits for at exit. Inductor's thread pool also stayed up after the compile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import functrain as ft
from functrain.compile import interrupt

_CHILD = textwrap.dedent(
    """
    import importlib
    import sys
    import torch
    import functrain as ft
    from functrain.callbacks import Preemption

    jit_module = importlib.import_module("functrain.jit")  # the module (ft.jit is the function)

    compile_graph = jit_module.compile_graph

    def announcing(*args, **kwargs):  # the signal is sent once inductor has the graph
        print("COMPILING", flush=True)
        out = compile_graph(*args, **kwargs)
        print("COMPILED", flush=True)
        return out

    jit_module.compile_graph = announcing
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    xs, ys = torch.randn(64, 16), torch.randint(0, 4, (64,))
    state = ft.TrainState.create(model, ft.optim.adamw(1e-3))
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)))
    result = ft.fit(state, step, torch.utils.data.TensorDataset(xs, ys), batch_size=16, epochs=2,
                    checkpoints=sys.argv[1], callbacks=[Preemption()], progress_bar=False)
    print("RESULT", result.stop_reason, int(result.state.step), step.num_compiles, flush=True)
    """
)


@pytest.mark.compile
@pytest.mark.slow
def test_sigint_during_a_compile_stops_the_compile_and_saves_the_step(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1")
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        lines = []
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("COMPILING"):
                time.sleep(0.5)  # inside inductor: lowering, code generation or waiting for g++
                child.send_signal(signal.SIGINT)
                break
        lines += [line.strip() for line in child.stdout]
        err = child.stderr.read()
        assert child.wait(timeout=300) == 0, err[-3000:]
    finally:
        child.kill()
    # The compile never finished: the step ran eagerly, the run saved it and stopped as preempted.
    assert "COMPILED" not in lines, lines
    assert lines[-1] == "RESULT preempted by SIGINT 1 0", lines
    assert "compile interrupted by SIGINT; this step runs eagerly" in err
    saved = ft.checkpoint.CheckpointManager(tmp_path / "ckpt")
    assert saved.latest() == 1


def test_killing_the_compile_workers_spares_the_callers_own_processes():
    from torch._inductor.async_compile import AsyncCompile

    pool = AsyncCompile.pool()
    compiler = pool.submit(subprocess.run, ["sleep", "60"])  # a compiler run by inductor's worker thread
    mine = subprocess.Popen(["sleep", "60"])  # e.g. a data loader worker
    try:
        for _ in range(200):  # until the worker thread has started its process
            if any(interrupt._children(os.getpid(), t.native_id) for t in pool._threads):
                break
            time.sleep(0.05)
        interrupt.close_compile_workers(kill=True)
        assert compiler.result(timeout=30).returncode == -signal.SIGKILL
        assert mine.poll() is None
        assert AsyncCompile.pool.cache_info().currsize == 0  # the next compile starts a new pool
    finally:
        mine.kill()
        mine.wait()


def test_a_keyboard_interrupt_while_compiling_kills_the_compilers_before_it_propagates():
    from torch._inductor.async_compile import AsyncCompile

    pool = AsyncCompile.pool()
    compiler = pool.submit(subprocess.run, ["sleep", "60"])
    queued = [pool.submit(subprocess.run, ["sleep", "60"]) for _ in range(4)]  # kernels not started yet
    with pytest.raises(KeyboardInterrupt), interrupt.compiling():
        assert interrupt.under_way()
        for _ in range(200):
            if any(interrupt._children(os.getpid(), t.native_id) for t in pool._threads):
                break
            time.sleep(0.05)
        raise KeyboardInterrupt  # Ctrl-C while the main thread waits for the kernels
    assert not interrupt.under_way()
    assert compiler.result(timeout=30).returncode == -signal.SIGKILL
    for future in queued:  # cancelled, or killed if a thread had taken it already
        assert future.cancelled() or future.result(timeout=30).returncode == -signal.SIGKILL


@pytest.mark.compile
def test_the_compile_workers_are_closed_after_a_compile(tmp_path, monkeypatch):
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold compile: C++ kernels to build
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss)))
    torch._inductor.config.compile_threads, threads = 2, torch._inductor.config.compile_threads
    try:
        step(state, (torch.randn(4, 3), torch.randn(4, 2)))
    finally:
        torch._inductor.config.compile_threads = threads
    assert step.num_compiles == 1
    assert AsyncCompile.pool.cache_info().currsize == 0


def test_a_compile_is_abandoned_only_before_its_graph_runs():
    # After the backend returns, the graph may write a donating step's inputs: the step is then finished,
    # not rerun eagerly; a donating step's later calls (an existing graph may run) are never abandoned.
    assert not interrupt.under_way()
    with interrupt.compiling():
        assert interrupt.under_way()
        interrupt.compiled()
        assert not interrupt.under_way()
    with interrupt.compiling(abandonable=False):
        assert not interrupt.under_way()
    assert not interrupt.under_way()
