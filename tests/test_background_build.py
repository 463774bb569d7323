"""The background build (functrain.compile.background): whether a child process is started, that it never
outlives the run, that a failing one leaves the run on its tier with one log line, and (marked ``compile``)
a run whose child warms the caches, then switches with one compile of its own and resumes bitwise."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from background_recipe import LOSS, dataset, model_and_state
from test_resume import assert_bitwise_equal
from test_tiers import arrays

import functrain as ft
from functrain.compile.background import (
    RUNNING,
    BackgroundBuild,
    BuildResult,
    idle_cores,
    remove_orphaned_dirs,
    wanted,
)
from functrain.compile.tiers import TieredStep, TierEstimates, TierPlan, TierPolicy

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_idle_cores_leave_out_the_runs_threads_and_the_machines_load():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert idle_cores(cpu, cores=2, threads=2, load=0.0) == 0  # this machine: nothing to spare
    assert idle_cores(cpu, cores=16, threads=4, load=2.0) == 12
    assert idle_cores(cpu, cores=16, threads=4, load=14.2) == 1  # others' work counts
    assert idle_cores(cuda, cores=16, threads=16, load=1.0) == 15  # the GPU runs the steps
    assert idle_cores(cpu, cores=2, threads=1, load=30.0) == 0


def test_wanted_is_forced_by_true_and_false_and_measured_on_auto(monkeypatch):
    assert wanted(True) == (True, "asked for")
    assert wanted(False) == (False, "turned off")
    from functrain.compile import background

    monkeypatch.setattr(background, "idle_cores", lambda device=None: 0)
    assert wanted("auto") == (False, "0 idle cores")
    monkeypatch.setattr(background, "idle_cores", lambda device=None: 3)
    assert wanted("auto") == (True, "3 idle cores")


class FakeBuild:
    """A background build that reports ``result`` after ``polls`` polls (duck-typed BackgroundBuild)."""

    def __init__(self, result, polls=2):
        self.result, self.polls, self.started, self.stopped, self.pid, self.failure = (
            result,
            polls,
            False,
            0,
            1,
            "",
        )

    def start(self):
        self.started = True

    def poll(self):
        self.polls -= 1
        return RUNNING if self.polls >= 0 else self.result

    def stop(self):
        self.stopped += 1


class Recording:
    """Switch where the compile costs under ``limit`` s; record what it was asked."""

    measure_steps = 2

    def __init__(self, limit=100.0):
        self.limit, self.asked = limit, []

    def decide(self, step, estimates: TierEstimates) -> TierPlan:
        self.asked.append((step, estimates.compile_seconds))
        switch = step if estimates.compile_seconds < self.limit else None
        return TierPlan(step, switch, estimates.compile_seconds, 0.0)


def _tiered(policy, build, cold=1000.0):
    model, state = model_and_state()
    cost = lambda *call: cold  # noqa: E731  (the cold compile never pays here)
    return state, TieredStep(
        ft.make_train_step(model, LOSS), policy=policy, background=build, compile_cost=cost
    )


def _run(state, step, steps=12, build=None):
    batches = [torch.utils.data.default_collate(dataset(8, seed=i)) for i in range(steps)]
    for i, batch in enumerate(batches):
        step.at_step(i, steps)
        state, _ = step(state, batch)
    return state


def test_an_undecided_run_starts_the_build_waits_for_it_and_weighs_the_warm_cost(monkeypatch):
    policy = Recording()
    state, step = _tiered(policy, None)
    step.background = build = FakeBuild(None)
    _model, call_state = model_and_state()
    build.result = BuildResult(
        step.compile_key(call_state, (torch.utils.data.default_collate(dataset(8)),), {}), 4.0, 30.0
    )
    built = []
    monkeypatch.setattr(step, "_inductor_step", lambda: built.append(1) or step._eager)
    step._build = step._inductor_step
    _run(state, step)
    assert build.started
    assert policy.asked[0][1] == 1000.0  # cold: stays eager, waits for the build
    assert policy.asked[1][1] == 4.0  # warm: switches
    assert step.plan.switch_at == policy.asked[1][0] > policy.asked[0][0]
    assert built == [1] and build.stopped


def test_a_decided_run_starts_no_build_and_a_build_of_another_step_is_not_trusted(caplog):
    state, step = _tiered(Recording(), build := FakeBuild(BuildResult("another-key", 4.0, 30.0)))
    step.restore(TierPlan(decided_at=3, switch_at=None))  # a resumed run replays its plan
    _run(state, step)
    assert not build.started

    policy = Recording()
    state, step = _tiered(policy, build := FakeBuild(BuildResult("another-key", 4.0, 30.0)))
    with caplog.at_level(logging.INFO, logger="functrain.jit"):
        _run(state, step)
    assert [cost for _, cost in policy.asked] == [1000.0, 1000.0] and step.plan.switch_at is None
    assert "compiled another step" in caplog.text


def test_a_run_that_ends_while_the_child_builds_stays_eager_and_stops_it():
    policy = Recording()
    state, step = _tiered(policy, build := FakeBuild(None, polls=10**6))
    _run(state, step, steps=6)
    assert step.plan.switch_at is None and step.plan.decided_at == 5 and build.stopped


def test_a_failing_child_leaves_the_run_eager_with_one_log_line(caplog):
    policy = TierPolicy(measure_steps=1)
    state, step = _tiered(policy, BackgroundBuild("background_recipe:broken"))
    batches = [torch.utils.data.default_collate(dataset(8, seed=i)) for i in range(3)]
    with caplog.at_level(logging.INFO, logger="functrain.jit"):
        for i in range(3):
            step.at_step(i, 1000)
            state, _ = step(state, batches[i])
        deadline = time.monotonic() + 120
        while step.plan.decided_at is None and time.monotonic() < deadline:
            step.at_step(3, 1000)
            time.sleep(0.2)
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "RuntimeError: the recipe broke" in failed[0].getMessage()
    assert "Traceback" not in caplog.text
    assert step.plan.switch_at is None and step.tier == "eager" and step.num_compiles == 0


PARENT = """
import os, signal, sys, time
sys.path[:0] = {path!r}
from functrain.compile.background import BackgroundBuild
build = BackgroundBuild("background_recipe:forever")
build.start()
print(build.pid, flush=True)
time.sleep(3)  # the child is past its start
{end}
"""


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):  # exited, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_child_never_outlives_its_parent():
    """Exit, Ctrl-C (a KeyboardInterrupt out of the script) and SIGKILL (no Python cleanup: the kernel's
    parent-death signal) all end the child. The three parents run at once."""
    ends = ["sys.exit(0)", "raise KeyboardInterrupt", "os.kill(os.getpid(), signal.SIGKILL)"]
    parents = [
        subprocess.Popen(
            [sys.executable, "-c", PARENT.format(path=[TESTS, *sys.path], end=end)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for end in ends
    ]
    children = [int(p.stdout.readline()) for p in parents]
    try:
        for p in parents:
            p.wait(timeout=120)
        assert [p.returncode for p in parents] == [0, -signal.SIGINT, -signal.SIGKILL]
        assert [_gone(pid) for pid in children] == [True] * 3
    finally:
        for pid in children:
            if not _gone(pid, 0):
                os.kill(pid, signal.SIGKILL)


def test_stop_kills_a_running_child():
    build = BackgroundBuild("background_recipe:forever")
    build.start()
    assert build.poll() == RUNNING
    build.stop()
    assert _gone(build.pid) and build.poll() == "failed" and build.failure == "stopped"


def test_a_recipe_must_name_module_and_function():
    with pytest.raises(ValueError, match="module:function"):
        BackgroundBuild("background_recipe")


@pytest.mark.compile
def test_the_child_warms_the_caches_and_the_run_switches_with_one_compile_and_resumes_bitwise(
    tmp_path, monkeypatch
):
    """A real child compiles the step into an empty inductor cache; the run, waiting for it on the eager
    tier, switches at step 4 and compiles once itself from that cache (no FX graph cache miss); a run
    killed after the switch resumes on its recorded plan (no child) and ends bitwise as the whole run."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # shared with the child
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "functrain"))

    class WaitForTheBuild(ft.callbacks.Callback):  # the run would outpace the child: make the timing fixed
        def __init__(self, step, stop_at=None):
            self.step, self.stop_at = step, stop_at

        def on_step_end(self, state, ctx):
            deadline = time.monotonic() + 600
            while ctx.step == 4 and self.step.background.poll() == RUNNING and time.monotonic() < deadline:
                time.sleep(0.2)
            if ctx.step == self.stop_at:
                ctx.control.stop("killed", final=False)
            return state

    def run(out, stop_at=None, resume=False):
        model, state = model_and_state()
        build = BackgroundBuild("background_recipe:warmups")
        cost = lambda *call: 1e6  # noqa: E731  (cold: only the warm cost can switch)
        step = TieredStep(
            ft.make_train_step(model, LOSS), policy=Recording(), background=build, compile_cost=cost
        )
        result = ft.fit(
            state, step, dataset(40), batch_size=8, epochs=3, checkpoints=out, save_every=2,
            resume_from_checkpoint=resume, progress_bar=False, callbacks=[WaitForTheBuild(step, stop_at)],
        )  # fmt: skip
        return result, step, build

    misses, hits = counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]
    full, step, build = run(tmp_path / "full")
    assert isinstance(build.poll(), BuildResult), build.failure
    assert step.plan.decided_at == step.plan.switch_at == 4 and step.num_compiles == 1
    assert counters["inductor"]["fxgraph_cache_miss"] == misses  # the child compiled it, not this process
    assert counters["inductor"]["fxgraph_cache_hit"] > hits

    run(tmp_path / "part", stop_at=6)
    resumed, step, build = run(tmp_path / "part", resume=True)
    assert not build.started and step.plan.switch_at == 4 and step.num_compiles == 1
    assert_bitwise_equal(arrays(full.state), arrays(resumed.state))


def _trainer(tmp_path, **fields):
    from functrain.cli.main import trainer_from_config

    config = {
        "output_dir": str(tmp_path), "epochs": 1, "batch_size": 8, "model": "models:mlp",
        "train_dataset": "background_recipe:dataset", "eval_dataset": "background_recipe:dataset",
        "progress_bar": False, "compile_background": True, **fields,
    }  # fmt: skip
    return trainer_from_config(ft.TrainerConfig.from_dict(config))


def test_the_trainer_gives_a_run_its_config_rebuilds_a_child_that_builds_the_same_steps(tmp_path):
    from functrain.trainer.from_config import warmups

    trainer = _trainer(tmp_path)
    step = trainer._jit("train")
    assert isinstance(step.background, BackgroundBuild) and not step.background.started
    assert step.background.kwargs["config"]["compile_background"] is False  # the child builds no child
    train, evaluate = warmups(step.background.kwargs["config"])  # what the child compiles
    rows = trainer.config.batch_size
    batch = next(trainer._loader(trainer.train_dataset, rows, train=True).epoch(0))  # what fit gives the step
    assert train.step.compile_key(train.state, train.args, {}) == step.compile_key(
        trainer.state, (batch,), {}
    )
    assert evaluate.step.__name__ == trainer._jit("eval").__name__


def test_the_trainer_builds_no_child_where_turned_off_or_not_rebuildable(tmp_path, caplog):
    assert _trainer(tmp_path / "a", compile_background=False)._jit("train").background is None
    assert _trainer(tmp_path / "b", compile_background="auto", compile=True)._jit("train").num_compiles == 0
    with pytest.raises(ft.ConfigError, match="compile_background"):
        ft.TrainerConfig.from_dict({"epochs": 1, "compile": True, "compile_background": True})
    rebuilt = _trainer(tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="functrain.jit"):
        loss = lambda model, batch: LOSS(model, batch)  # noqa: E731
        given = ft.Trainer(
            rebuilt.model, rebuilt.config, rebuilt.train_dataset, rebuilt.eval_dataset, loss_fn=loss
        )
        assert given._jit("train").background is None
    assert "cannot be rebuilt" in caplog.text and "loss_fn" in caplog.text


def test_a_build_removes_the_folders_of_builds_whose_parent_was_killed(tmp_path):
    """A parent killed with SIGKILL leaves its build's folder (no Python ran to remove it): the next build
    removes it; a folder whose parent runs, or whose spec is not written yet, stays."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folders = {}
    for name, parent in (("orphan", gone.pid), ("running", os.getppid()), ("ours", os.getpid())):
        folder = tmp_path / f"functrain-background-{name}"
        folder.mkdir()
        (folder / "spec.json").write_text(json.dumps({"parent": parent}))
        folders[name] = folder
    (tmp_path / "functrain-background-unwritten").mkdir()
    (tmp_path / "other-orphan").mkdir()
    assert remove_orphaned_dirs(str(tmp_path)) == [str(folders["orphan"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "functrain-background-ours", "functrain-background-running", "functrain-background-unwritten",
        "other-orphan",
    ]  # fmt: skip
