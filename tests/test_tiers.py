"""Tiered compilation (functrain.compile.tiers): the policy, the step's decision and its replay on resume,
the progress bar's text, the Trainer's ``compile: auto``.

The optimizing tier is a stand-in in the fast tests (an eager step whose loss is halved: a step taken on
the wrong tier changes the result grossly, not by rounding); one test marked ``compile`` switches to
inductor itself.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from models import classification_batch, mlp
from test_resume import assert_bitwise_equal

import functrain as ft
from functrain.compile import compile_times
from functrain.compile.tiers import (
    SwitchAt,
    TieredStep,
    TierEstimates,
    TierPlan,
    TierPolicy,
    cold_compile_seconds,
    tiered,
)


def dataset(n=40, seed=0):
    return list(zip(*classification_batch(n, seed=seed)))


LOSS = ft.supervised_loss(F.cross_entropy)


def halved_loss(model, batch):
    loss, aux = LOSS(model, batch)
    return 0.5 * loss, aux


class StandIn:
    """The optimizing tier's stand-in: another eager step (halved loss) that counts a 'compile' on its
    first call, taking ``compile_s`` on the fake clock (when given one)."""

    def __init__(self, model, clock=None, compile_s=0.0):
        self.step = ft.jit(ft.make_train_step(model, halved_loss), compile=False)
        self.num_compiles, self.calls, self.clock, self.compile_s = 0, 0, clock, compile_s

    def __call__(self, state, batch):
        if self.num_compiles == 0 and self.clock is not None:
            self.clock.now += self.compile_s
        self.num_compiles, self.calls = 1, self.calls + 1
        return self.step(state, batch)


class FakeClock:
    def __init__(self, step_s=0.01):
        self.now, self.step_s = 0.0, step_s

    def __call__(self):
        self.now += self.step_s  # a timed step reads it before and after
        return self.now


def setup(policy, dropout=0.5, **kwargs):
    torch.manual_seed(0)
    model = mlp(dropout=dropout)
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)
    stand_ins = []

    def build():
        stand_ins.append(StandIn(model))
        return stand_ins[-1]

    if isinstance(kwargs.get("clock"), FakeClock):  # CPU time as fast as wall time: an idle machine
        kwargs.setdefault("cpu_clock", FakeClock(kwargs["clock"].step_s))
    step = TieredStep(ft.make_train_step(model, LOSS), policy=policy, build=build, **kwargs)
    return state, step, stand_ins


def test_policy_weighs_the_saving_over_the_remaining_steps_against_the_compile():
    policy = TierPolicy(measure_steps=5, speedup=1.25)  # saves a fifth of each step
    stay = policy.decide(
        6, TierEstimates(remaining_steps=1000, eager_step_seconds=0.01, compile_seconds=20.0)
    )
    assert stay == TierPlan(decided_at=6, switch_at=None, cost=20.0, saving=2.0)
    assert stay.describe() == "tier: eager (inductor would cost ~20 s, saves ~2 s)"
    go = policy.decide(
        6, TierEstimates(remaining_steps=20_000, eager_step_seconds=0.01, compile_seconds=20.0)
    )
    assert (go.switch_at, go.saving) == (6, 40.0)
    assert go.describe() == "tier: inductor from step 6 (compiling costs ~20 s, saves ~40 s)"
    assert [go.tier_at(s) for s in (5, 6, 7)] == ["eager", "inductor", "inductor"]
    warm = policy.decide(6, TierEstimates(remaining_steps=1000, eager_step_seconds=0.01, compile_seconds=0.5))
    assert warm.switch_at == 6  # a warm cache makes inductor pay on a short run too


@pytest.mark.parametrize("bad", [dict(measure_steps=0), dict(speedup=1.0)])
def test_policy_refuses_settings_that_cannot_decide(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        TierPolicy(**bad)


def test_plan_round_trips_through_json_and_refuses_a_malformed_one():
    plan = TierPlan(decided_at=6, switch_at=9, cost=1.5, saving=3.25)
    assert TierPlan.from_json(plan.to_json()) == plan
    assert TierPlan.from_json("") == TierPlan()
    with pytest.raises(ValueError, match="tier plan is malformed"):
        TierPlan.from_json('{"switch_at": 3}')


def test_the_step_times_eager_steps_then_decides_once_and_logs_one_line(caplog):
    clock = FakeClock(step_s=0.01)
    costs = []

    def cost(state, args, kwargs):
        costs.append(state.step)
        return 20.0

    state, step, stand_ins = setup(TierPolicy(measure_steps=3), clock=clock, compile_cost=cost)
    batches = [(x[None], y[None]) for x, y in dataset(8)]
    with caplog.at_level(logging.INFO, logger="functrain.jit"):
        for i, batch in enumerate(batches):
            assert step.at_step(i, total=100_000) == ("eager" if i < 4 else "inductor")
            state, _ = step(state, batch)
    # one warm-up call, three timed; then the plan, with the steps left from where it was taken
    assert step.eager_seconds == pytest.approx([0.01] * 3)
    saving = (100_000 - 4) * 0.01 * (1 - 1 / 1.2)
    assert step.plan == TierPlan(decided_at=4, switch_at=4, cost=20.0, saving=round(saving, 3))
    assert len(costs) == 1 and stand_ins[0].calls == 4
    lines = [r.getMessage() for r in caplog.records if "tier:" in r.getMessage()]
    assert lines == ["train_step: tier: inductor from step 4 (compiling costs ~20 s, saves ~167 s)"]


def test_a_short_run_stays_eager_and_never_builds_the_inductor_step(tmp_path, monkeypatch):
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path))  # no compile of this step recorded: cold
    state, step, stand_ins = setup(TierPolicy(measure_steps=2), clock=FakeClock(0.01))
    result = ft.fit(state, step, dataset(40), batch_size=8, epochs=3, progress_bar=False)
    assert int(result.state.step) == 15
    assert step.plan.decided_at == 3 and step.plan.switch_at is None
    assert step.plan.cost == cold_compile_seconds(step.step.model, torch.device("cpu"))
    assert stand_ins == []


def test_a_busy_machine_slows_the_prior_compile_as_much_as_the_steps(tmp_path, monkeypatch):
    """Steps at 8x their CPU time (other work on the cores): a cold compile takes 8x the idle prior too, so
    5,000 steps left save ~6.7 s of ~146 s, not of ~18 s. A recorded compile was timed as it ran: as it is."""
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path))
    state, step, _ = setup(TierPolicy(measure_steps=2), clock=FakeClock(0.008), cpu_clock=FakeClock(0.001))
    batch = dataset(8)[0]
    batch = (batch[0][None], batch[1][None])
    for i in range(3):
        step.at_step(i, total=5003)
        state, _ = step(state, batch)
    assert step.at_step(3, total=5003) == "eager"
    assert step.slowdown == pytest.approx(8.0)
    prior = cold_compile_seconds(step.step.model, torch.device("cpu"))
    assert step.plan.cost == pytest.approx(8 * prior) and step.plan.saving == pytest.approx(6.667, abs=1e-3)
    from functrain.compile import tiers

    on_cpu = tiers.device_of
    monkeypatch.setattr(tiers, "device_of", lambda state: torch.device("cuda"))  # the host waits on a GPU
    assert step._estimated_cost(state, (batch,), {}) == cold_compile_seconds(
        step.step.model, torch.device("cuda")
    )
    monkeypatch.setattr(tiers, "device_of", on_cpu)
    options = {"fullgraph": True, "dynamic": False, "mode": None, "options": None}
    key = compile_times.compile_key("train_step", step.step.model, (state, (batch,), {}), options)
    compile_times.record(key, 30.0)
    assert step._estimated_cost(state, (batch,), {}) == 30.0


def test_under_torchrun_every_rank_takes_rank_zeros_plan(monkeypatch):
    """Each rank times its own steps; replicas on different tiers would drift apart by rounding."""
    import importlib

    from functrain.distributed import env

    replicate = importlib.import_module("functrain.distributed.replicate")  # the module (the package
    # exports its function under the same name)

    rank0 = torch.tensor([2.0, 2.0, 20.0, 167.0], dtype=torch.float64)  # rank 0 switches at once
    sent = []
    monkeypatch.setattr(env, "is_distributed", lambda: True)
    monkeypatch.setattr(replicate, "replicate", lambda t: sent.append(t) or rank0)
    state, step, _ = setup(TierPolicy(measure_steps=1), clock=FakeClock(1e-9), compile_cost=lambda *a: 20.0)
    batch = dataset(8)[0]
    batch = (batch[0][None], batch[1][None])
    for i in range(2):
        step.at_step(i, total=100)
        state, _ = step(state, batch)
    assert step.at_step(2, total=100) == "inductor"  # this rank alone would stay eager (saves ~0 s)
    assert step.plan == TierPlan(decided_at=2, switch_at=2, cost=20.0, saving=167.0)
    assert len(sent) == 1 and sent[0].tolist() == [2.0, -1.0, 20.0, 0.0]  # its own plan, offered once


def test_the_cost_is_the_last_recorded_compile_of_this_step_else_the_cold_prior(tmp_path, monkeypatch):
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path))
    state, step, _ = setup(TierPolicy(measure_steps=1))
    batch = dataset(8)[0]
    batch = (batch[0][None], batch[1][None])
    prior = cold_compile_seconds(step.step.model, torch.device("cpu"))
    assert prior == 15.0 + 0.8 * 4  # the CPU prior: two Linear layers' weights and biases
    assert step._estimated_cost(state, (batch,), {}) == prior
    options = {"fullgraph": True, "dynamic": False, "mode": None, "options": None}  # jit's CompiledStep's
    key = compile_times.compile_key("train_step", step.step.model, (state, (batch,), {}), options)
    compile_times.record(key, 0.7)  # what jit records after a (warm) compile of the same step
    assert step._estimated_cost(state, (batch,), {}) == 0.7


def test_cold_prior_grows_with_the_model_and_differs_by_device():
    small, big = torch.nn.Linear(2, 2), torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(10)])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cold_compile_seconds(small, cpu) < cold_compile_seconds(big, cpu)
    assert cold_compile_seconds(small, cpu) != cold_compile_seconds(small, cuda)


def arrays(state):
    """What a state holds, without its static fields (the optimizer's functions differ by identity)."""
    return {"params": state.params, "buffers": state.buffers, "opt": state.opt_state, "rng": state.rng}


def _fit(state, step, tmp_path, *, stop_at=None, resume=False, eval_step=None):
    class Stop(ft.callbacks.Callback):
        def on_step_end(self, state, ctx):
            if ctx.step == stop_at:
                ctx.control.stop("killed", final=False)
            return state

    return ft.fit(
        state, step, dataset(40), batch_size=8, epochs=3, checkpoints=tmp_path / "ckpt", save_every=2,
        resume_from_checkpoint=resume, progress_bar=False, callbacks=[Stop()],
        eval_step=eval_step, eval_data=dataset(16, seed=1) if eval_step is not None else None,
    )  # fmt: skip


@pytest.mark.parametrize("stop_at", [4, 5, 6, 7])  # the switch takes step 6 (5 done): before, at, after
def test_resume_across_a_tier_switch_is_bitwise_at_every_kill_point(tmp_path, stop_at):
    state, step, stand_ins = setup(SwitchAt(5))
    full = _fit(state, step, tmp_path / "full")
    assert stand_ins[0].calls == 15 - 5
    state, eager_only, _ = setup(SwitchAt(None))
    eager = _fit(state, eager_only, tmp_path / "eager").state
    assert not torch.equal(eager.params["0.weight"], full.state.params["0.weight"])  # the tier shows

    state, step, first = setup(SwitchAt(5))
    stopped = _fit(state, step, tmp_path / "part", stop_at=stop_at)
    assert int(stopped.state.step) == stop_at
    saved = ft.checkpoint.CheckpointManager(tmp_path / "part" / "ckpt").restore(stop_at)
    assert TierPlan.from_json(saved["loop"]["tiers"]) == TierPlan(decided_at=0, switch_at=5)

    state, step, second = setup(SwitchAt(None))  # replays the checkpoint's plan, not its own
    resumed = _fit(state, step, tmp_path / "part", resume=True)
    assert step.plan.switch_at == 5
    assert sum(s.calls for s in first + second) == 15 - 5  # every step after 5 on the optimizing tier
    assert_bitwise_equal(arrays(full.state), arrays(resumed.state))


def test_a_resume_before_the_decision_decides_again(tmp_path):
    state, step, _ = setup(TierPolicy(measure_steps=2), clock=FakeClock(0.01))
    _fit(state, step, tmp_path, stop_at=2)
    saved = ft.checkpoint.CheckpointManager(tmp_path / "ckpt").restore(2)
    assert saved["loop"]["tiers"] == TierPlan().to_json()  # not decided yet: measured 1 of 2 steps
    state, step, _ = setup(TierPolicy(measure_steps=2), clock=FakeClock(0.01))
    _fit(state, step, tmp_path, resume=True)
    assert step.plan.decided_at == 5  # 2 + warm-up + 2 timed


def test_the_eval_step_follows_the_train_steps_tier_and_its_compile_counts_in_the_cost():
    state, step, _ = setup(SwitchAt(5))
    built = []

    def build_eval():
        built.append(ft.jit(ft.make_eval_step(step.step.model, LOSS), compile=False))
        return built[-1]

    evaluator = TieredStep(ft.make_eval_step(step.step.model, LOSS), policy=SwitchAt(None), build=build_eval)
    ft.fit(
        state, step, dataset(40), batch_size=8, epochs=3, eval_step=evaluator, eval_data=dataset(16, seed=1),
        eval_every=2, progress_bar=False,
    )  # fmt: skip
    assert evaluator.leader is step and step.followers == [evaluator]
    assert len(built) == 1  # built at the first evaluation after the switch (step 6), not before
    _, leader, _ = setup(TierPolicy(measure_steps=1), compile_cost=lambda *a: 10.0)
    leader.followers.append(evaluator)
    leader._last_call = ("state", (), {})
    assert leader._cost() == 15.0  # 10 s and half of it for the follower's forward-only graph


def test_progress_bar_names_the_tier_and_leaves_the_compile_out_of_its_rate(monkeypatch):
    import tqdm.std

    fake = FakeClock(step_s=0.0)
    monkeypatch.setattr(tqdm.std, "time", lambda: fake.now)  # the bar's clock
    torch.manual_seed(0)
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)
    step = TieredStep(
        ft.make_train_step(model, LOSS),
        policy=SwitchAt(5),
        build=lambda: StandIn(model, fake, compile_s=100.0),
    )
    bar = ft.callbacks.ProgressBar()
    seen = []

    class Look(ft.callbacks.Callback):
        def on_train_begin(self, state, ctx):
            seen.append(("begin", bar._bar.desc))
            return state

        def on_step_begin(self, state, ctx):
            seen.append((ctx.step, bar._bar.desc))
            return state

        def on_step_end(self, state, ctx):
            fake.now += 0.01
            if ctx.step == 15:
                seen.append(("elapsed", bar._bar.format_dict["elapsed"]))
            return state

    ft.fit(state, step, dataset(40), batch_size=8, epochs=3, callbacks=[bar, Look()])
    descriptions = dict(seen)
    assert descriptions["begin"] == descriptions[0] == descriptions[4] == "eager"  # never "compiling"
    assert descriptions[5] == "inductor: compiling"
    assert descriptions[6] == descriptions[14] == "inductor"
    assert descriptions["elapsed"] < 1.0  # the 100 s compile left out: 15 steps of 0.01 s


def test_progress_bar_says_a_compiled_step_compiles_and_a_plain_function_too(capsys):
    bar = ft.callbacks.ProgressBar()
    compiled = ft.callbacks.Context(max_steps=3, tier="inductor", compiling=True)
    bar.on_train_begin(None, compiled)
    bar.on_step_begin(None, compiled)
    assert bar._bar.desc == "inductor: compiling"
    compiled.compiling = False
    bar.on_step_end(None, compiled)
    assert bar._bar.desc == "inductor"
    bar.on_train_end(None, compiled)
    plain = ft.callbacks.Context(max_steps=3)  # tier "": a step functrain did not build
    bar.on_train_begin(None, plain)
    assert bar._bar.desc == "compiling"
    bar.on_step_end(None, plain)
    assert bar._bar.desc == ""
    bar.on_train_end(None, plain)
    assert "inductor: compiling" in capsys.readouterr().err


def test_the_trainer_defaults_to_auto_and_builds_tiered_steps(tmp_path):
    assert ft.TrainerConfig(epochs=1).compile == "auto"
    for text, value in [("auto", "auto"), ("true", True), (False, False)]:
        assert ft.TrainerConfig.from_dict({"epochs": 1, "compile": text}).compile == value
    with pytest.raises(ft.ConfigError, match="compile"):
        ft.TrainerConfig.from_dict({"epochs": 1, "compile": "sometimes"})
    torch.manual_seed(0)
    x, y = classification_batch(40)
    trainer = ft.Trainer(
        mlp(), {"output_dir": str(tmp_path / "run"), "epochs": 2, "batch_size": 8, "progress_bar": False},
        train_dataset=torch.utils.data.TensorDataset(x, y), eval_dataset=torch.utils.data.TensorDataset(x, y),
    )  # fmt: skip
    result = trainer.train()
    train, evaluator = trainer._jitted["train"], trainer._jitted["eval"]
    assert isinstance(train, TieredStep) and isinstance(evaluator, TieredStep)
    assert evaluator.leader is train
    assert train.plan.decided_at == 6 and train.plan.switch_at is None  # 10 steps: eager throughout
    assert train.num_compiles == 0 and int(result.state.step) == 10


def test_tiered_passes_jit_options_to_the_inductor_tier_only():
    model = mlp()
    step = tiered(ft.make_train_step(model, LOSS), donate=True, mode="max-autotune", dynamic=None)
    assert step.donate and step._jit_args == dict(donate=True, seed=True, rank=None)
    assert step._jit_options == dict(mode="max-autotune", dynamic=None)
    assert math.isnan(TierEstimates(1, math.nan, 0.0).eager_step_seconds)


@pytest.mark.compile
def test_a_switch_to_inductor_resumes_bitwise(tmp_path):
    """The real optimizing tier: eager for 5 steps, inductor from step 6; killed after step 7."""

    def make():
        torch.manual_seed(0)
        model = mlp(dropout=0.5)
        state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)
        return state, tiered(ft.make_train_step(model, LOSS), policy=SwitchAt(5))

    state, step = make()
    full = _fit(state, step, tmp_path / "full")
    assert step.num_compiles == 1
    state, step = make()
    _fit(state, step, tmp_path / "part", stop_at=7)
    state, step = make()
    resumed = _fit(state, step, tmp_path / "part", resume=True)
    assert step.num_compiles == 1 and step.tier == "inductor"
    assert_bitwise_equal(arrays(full.state), arrays(resumed.state))


def test_on_the_inductor_tier_a_short_last_batch_runs_on_the_eager_step(tmp_path):
    # 36 examples in batches of 8: each epoch ends with a batch of 4, which would compile a second graph
    state, step, stand_ins = setup(SwitchAt(1), rows=8)
    ft.fit(state, step, dataset(36), batch_size=8, epochs=3, progress_bar=False)
    assert step.plan.switch_at == 1
    # 15 steps: 1 eager, then 14 on the inductor tier but for the 3 short batches (eager, no 2nd shape)
    assert stand_ins[0].calls == 15 - 1 - 3
    state, step, stand_ins = setup(SwitchAt(1))  # without rows: every batch on the switched tier
    ft.fit(state, step, dataset(36), batch_size=8, epochs=3, progress_bar=False)
    assert stand_ins[0].calls == 15 - 1
