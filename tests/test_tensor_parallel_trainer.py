"""``TrainerConfig.tensor_parallel`` through the Trainer, the YAML and ``torchrun -m functrain train``.

Fast here: the fields (YAML, overrides, help), the refusals of the config and of the Trainer in one process,
the plan chosen for a model. Slow (torchrun, gloo, float64, eager): the Trainer with ``tensor_parallel: 2`` on
2 ranks (tp 2) and 4 ranks (dp 2 x tp 2) against one process (``tp_trainer_worker.py``), the batch check
refusing ranks of a tp group given different batches, and ``torchrun -m functrain train run.yaml`` against
the same YAML in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import tp_trainer_fixtures as fixtures
from test_sharding_torchrun import _torchrun
from test_sharding_trainer import _torchrun_cli
from trainer_fixtures import SmallNet

import functrain as ft
from functrain.cli import main as cli
from functrain.trainer import build

HERE = Path(__file__).parent
F64 = 1e-10  # float64, 12 AdamW steps with clipping: the split matmuls (and dp's mean) sum in another order
F32 = 1e-6  # evaluation's loss and metrics are float32


# ------------------------------------------------------------------------------------------- the fields


def test_tensor_parallel_fields_from_yaml_overrides_and_help() -> None:
    text = (
        "max_steps: 1\nsave_strategy: no\ntensor_parallel: 2\ntensor_parallel_plan:\n  '*attn.q': colwise\n"
    )
    config = ft.TrainerConfig.from_yaml(text)
    assert config.tensor_parallel == 2 and config.tensor_parallel_plan == {"*attn.q": "colwise"}
    assert ft.TrainerConfig.from_yaml(config.to_yaml()) == config
    assert config.with_overrides(["tensor_parallel=4"]).tensor_parallel == 4
    assert ft.TrainerConfig(max_steps=1).tensor_parallel == 1  # off by default
    from functrain.config import config_help

    assert "tensor_parallel: int = 1" in config_help()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"sharding": "params", "sharding_blocks": ["Block"]}, "sharding_blocks"),
        ({"sweep": {"seed": [0, 1]}}, "sweep"),
        ({"mixed_precision": "fp16", "device": "cuda"}, "mixed_precision"),
        ({"dp_l2_norm_clip": 1.0, "dp_noise_multiplier": 1.0}, "dp_l2_norm_clip"),
        ({"sam_rho": 0.05}, "sam_rho"),
    ],
)
def test_what_tensor_parallelism_cannot_do_is_refused_by_the_config(fields: dict, named: str) -> None:
    base = {"max_steps": 1, "save_strategy": "no", **fields}
    ft.TrainerConfig(**base)  # fine without tensor parallelism
    with pytest.raises(ft.ConfigError) as caught:
        ft.TrainerConfig(**base, tensor_parallel=2)
    problems = [p for p in caught.value.problems if "tensor_parallel" in p.message]
    assert [p.path for p in problems] == [named], caught.value
    assert "tensor_parallel=1" in problems[0].fix


@pytest.mark.parametrize("level", ["optimizer", "grads", "params"])
def test_sharding_over_the_dp_axis_is_accepted_beside_tensor_parallel(tmp_path: Path, level: str) -> None:
    config = ft.TrainerConfig.from_yaml(f"max_steps: 1\ntensor_parallel: 2\nsharding: {level}\n")
    assert (config.tensor_parallel, config.sharding) == (2, level)
    assert ft.TrainerConfig.from_yaml(config.to_yaml()) == config
    assert config.with_overrides(["sharding=full"]).sharding == "params"
    # the strategy carries ZeRO's request (over the mesh's dp axis); checkpoints are whole, not per rank
    assert build.sharding(config) is None
    assert type(build.manager(config.replace(output_dir=str(tmp_path)))) is ft.checkpoint.CheckpointManager


def test_sharding_blocks_with_tensor_parallel_is_refused_saying_why() -> None:
    with pytest.raises(ft.ConfigError) as caught:
        ft.TrainerConfig(max_steps=1, tensor_parallel=2, sharding="params", sharding_blocks="auto")
    (problem,) = caught.value.problems
    assert problem.path == "sharding_blocks" and "setup_context" in problem.message
    assert "remove sharding_blocks" in problem.fix


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tensor_parallel_plan": {"*attn.q": "colwise"}}, "tensor_parallel_plan"),
        ({"tensor_parallel_check_batches": "every"}, "tensor_parallel_check_batches"),
        ({"tensor_parallel": 0}, "tensor_parallel"),
        (
            {"tensor_parallel": 2, "tensor_parallel_plan": {"*attn.q": "columnwise"}},
            "tensor_parallel_plan.*attn.q",
        ),
        ({"tensor_parallel": 2, "tensor_parallel_plan": ["*attn.q"]}, "tensor_parallel_plan"),
    ],
)
def test_tensor_parallel_settings_that_mean_nothing_are_refused(fields: dict, named: str) -> None:
    with pytest.raises(ft.ConfigError) as caught:
        ft.TrainerConfig(max_steps=1, save_strategy="no", **fields)
    assert caught.value.paths == [named], caught.value


def _tp_config(tmp_path: Path, **fields: object) -> ft.TrainerConfig:
    return fixtures.config(tmp_path / "run", tensor_parallel=2, **fields)


def test_one_process_is_refused_naming_the_field_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ft.ConfigError) as caught:
        ft.Trainer(fixtures.gpt(), _tp_config(tmp_path), fixtures.tokens(8))
    (problem,) = caught.value.problems
    assert problem.path == "tensor_parallel" and "not under torchrun" in problem.message
    assert "torchrun --nproc-per-node 2" in problem.fix
    assert not (tmp_path / "run").exists()


def test_the_plan_is_chosen_for_the_model_or_refused_naming_the_field(tmp_path: Path) -> None:
    config = _tp_config(tmp_path)
    assert build.tensor_parallel_plan(config, fixtures.gpt()) is ft.distributed.GPT_PLAN
    with pytest.raises(ft.ConfigError) as caught:
        build.tensor_parallel_plan(config, SmallNet())
    (problem,) = caught.value.problems
    assert problem.path == "tensor_parallel_plan" and "no ready plan fits SmallNet" in problem.message
    assert "give tensor_parallel_plan:" in problem.fix
    own = {"*attn.q": "colwise", "*attn.proj": "rowwise"}  # a plan of one's own wins
    assert build.tensor_parallel_plan(config.replace(tensor_parallel_plan=own), fixtures.gpt()) == own


def test_the_hugging_face_plans_are_chosen_for_gpt2_and_llama(tmp_path: Path) -> None:
    tr = pytest.importorskip("transformers")
    small = {"vocab_size": 50, "num_hidden_layers": 1, "num_attention_heads": 2}
    gpt2 = tr.GPT2LMHeadModel(tr.GPT2Config(**small, n_positions=16, n_embd=16))
    llama = tr.LlamaForCausalLM(tr.LlamaConfig(**small, hidden_size=16, intermediate_size=32))
    config = _tp_config(tmp_path)
    assert build.tensor_parallel_plan(config, gpt2) is ft.distributed.GPT2_PLAN
    assert build.tensor_parallel_plan(config, llama) is ft.distributed.LLAMA_PLAN


def _write_yaml(tmp_path: Path, **extra: object) -> Path:
    config = fixtures.config(tmp_path / "cli_run", **extra).to_dict()
    config.update(
        model="tp_trainer_fixtures:gpt",
        train_dataset={"target": "tp_trainer_fixtures:tokens", "kwargs": {"n": 48}},
        eval_dataset={"target": "tp_trainer_fixtures:tokens", "kwargs": {"n": 20, "seed": 1}},
        test_dataset={"target": "tp_trainer_fixtures:tokens", "kwargs": {"n": 12, "seed": 2}},
    )
    path = tmp_path / "run.yaml"
    path.write_text(ft.TrainerConfig.from_dict(config).to_yaml())
    return path


def test_the_cli_in_one_process_refuses_tensor_parallel(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    path = _write_yaml(tmp_path)
    assert cli(["train", str(path), "tensor_parallel=2"]) != 0
    err = capsys.readouterr().err
    assert "tensor_parallel" in err and "torchrun --nproc-per-node 2" in err
    assert not (tmp_path / "cli_run").exists()


# ------------------------------------------------------------------------------------------- torchrun


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ft.Trainer:
    """The same config in one process (tensor_parallel: 1), batch 8."""
    trainer = ft.Trainer(
        fixtures.gpt(), fixtures.config(tmp_path_factory.mktemp("ref")), fixtures.tokens(48),
        fixtures.tokens(20, seed=1),
    )  # fmt: skip
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def applied_reference(tmp_path_factory: pytest.TempPathFactory) -> ft.TrainState:
    """``apply_gradients`` twice, in one process, on the run's first state (``tp_trainer_worker._applied``)."""
    t = ft.Trainer(fixtures.gpt(), fixtures.config(tmp_path_factory.mktemp("applied")), fixtures.tokens(48))
    shapes = {k: tuple(p.shape) for k, p in t.state.params.items()}
    return t.state.apply_gradients(fixtures.gradients(shapes, 0)).apply_gradients(
        fixtures.gradients(shapes, 1)
    )


def _assert_close_to(out: dict, ref: ft.TrainState, atol: float) -> None:
    """``out``'s gathered params and optimizer state against ``ref``'s (one process)."""
    for k, p in ref.params.items():
        torch.testing.assert_close(out["params"][k], p, rtol=0, atol=atol)
    for a, b in zip(out["opt_state"], ft.tree.leaves(ref.opt_state), strict=True):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "dp2xtp2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = str(tmp_path_factory.mktemp(f"tp_trainer{request.param}"))
    return _torchrun("trainer", out, request.param, script="tp_trainer_worker.py")


@pytest.mark.slow
def test_the_trainer_with_tensor_parallel_equals_one_process(runs: list[dict], reference: ft.Trainer) -> None:
    ref = reference.state
    moved = max(float((ref.params[k] - fixtures.gpt().state_dict()[k]).abs().max()) for k in ref.params)
    assert moved > 1e-2  # the run trained: parity below is not two untouched copies
    for out in runs:
        assert out["step"] == int(ref.step) == 12 and out["dtensor_params"]
        for k, p in ref.params.items():
            torch.testing.assert_close(out["params"][k], p, rtol=0, atol=F64)
        for a, b in zip(out["opt_state"], ft.tree.leaves(ref.opt_state)):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=F64)
        assert out["eval"] == pytest.approx(reference.evaluate(), abs=F32)  # counted once per tp group
        torch.testing.assert_close(out["loaded"], out["params"], rtol=0, atol=0)  # Trainer.save / load


@pytest.mark.slow
def test_a_run_stopped_and_resumed_from_its_checkpoint_is_the_uninterrupted_run(runs: list[dict]) -> None:
    for out in runs:
        resumed = out["resumed"]
        assert resumed["step"] == out["step"] == 12, resumed  # epoch 1 saved at step 6, resumed to 12
        torch.testing.assert_close(resumed["params"], out["params"], rtol=0, atol=0)  # bitwise
        for a, b in zip(resumed["opt_state"], out["opt_state"]):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_in_one_process(runs: list[dict], tmp_path: Path) -> None:
    for out in runs:
        saved = out["resumed"]["checkpoints"][6]  # the epoch-1 checkpoint of the tp run
        t = ft.Trainer(
            fixtures.gpt(seed=3), fixtures.config(tmp_path / str(out["world_size"]), resume_from_checkpoint=saved),
            fixtures.tokens(48), fixtures.tokens(20, seed=1),
        )  # fmt: skip
        t.train()
        assert int(t.state.step) == 12
        for k, p in t.state.params.items():  # the split matmuls sum in another order
            torch.testing.assert_close(p, out["params"][k], rtol=0, atol=F64)


@pytest.mark.slow
def test_a_sum_type_train_metric_counts_each_tp_group_once(runs: list[dict]) -> None:
    for out in runs:
        dp = out["world_size"] // 2
        # 2 steps per log of 4 examples per dp group (a tp group's ranks computed the same count)
        assert [value for _, value in out["train_seen"]] == [2.0 * 4 * dp] * 2, out["train_seen"]


@pytest.mark.slow
def test_each_rank_holds_its_half_of_the_split_layers(runs: list[dict]) -> None:
    for out in runs:
        shapes = out["local_shapes"]
        assert shapes["blocks.0.attn.q.weight"] == (4, 8) and shapes["blocks.0.attn.proj.weight"] == (8, 4)
        assert shapes["blocks.1.mlp.fc.bias"] == (16,) and shapes["head.weight"] == (13, 8)  # replicated


@pytest.mark.slow
def test_prediction_covers_each_dp_slice_once(runs: list[dict], reference: ft.Trainer) -> None:
    _assert_predicts_each_dp_slice_once(runs, reference.predict(fixtures.tokens(6, seed=2)))


def _assert_predicts_each_dp_slice_once(runs: list[dict], expected: torch.Tensor) -> None:
    tp = 2
    leaders = [out["predict"] for out in runs[::tp]]  # one per tp group: its dp slice
    for out in runs:
        group = runs[out["rank"] - out["rank"] % tp]
        torch.testing.assert_close(out["predict"], group["predict"], rtol=0, atol=0)  # the group agrees
    got = torch.cat(leaders)
    assert got.shape == expected.shape
    for row in expected:  # every example predicted by exactly one group, as one process does
        assert int(((got - row).abs().amax(-1) <= F64).sum()) == 1


@pytest.mark.slow
def test_ranks_of_a_tp_group_given_other_batches_are_refused_naming_them(runs: list[dict]) -> None:
    for out in runs:
        message = out["mismatched"]
        assert "tp group were given different batches for training step 13" in message, message
        group = out["rank"] - out["rank"] % 2
        assert f"ranks [{group}] got batch" in message and f"ranks [{group + 1}] got batch" in message
        # a second batch that differs: seen on every step with check_batches="every", not by default
        assert out["second_batch"]["first"] == "", out["second_batch"]
        assert "different batches for training step 14" in out["second_batch"]["every"], out["second_batch"]


@pytest.mark.slow
def test_apply_gradients_on_a_tensor_parallel_state_equals_one_process(
    runs: list[dict], applied_reference: ft.TrainState
) -> None:
    for out in runs:  # whole plain gradients, then replicated DTensors; clipping over the mesh acts
        assert out["applied"]["step"] == 2
        _assert_close_to(out["applied"], applied_reference, 1e-12)


# ---------------------------------------------------------------- ZeRO over dp (sharding:) beside tp


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """4 ranks, dp 2 x tp 2, ``sharding: optimizer`` then ``params`` (one launch for both)."""
    return _torchrun(
        "zero", str(tmp_path_factory.mktemp("tp_zero_trainer")), 4, script="tp_trainer_worker.py"
    )


LEVELS = ("optimizer", "params")  # ZeRO-1, ZeRO-3


@pytest.mark.slow
def test_the_trainer_with_tensor_parallel_and_zero_equals_one_process(
    zero_runs: list[dict], reference: ft.Trainer
) -> None:
    expected = reference.evaluate()
    for out in zero_runs:
        for level in LEVELS:
            run = out[level]
            assert run["step"] == int(reference.state.step) == 12
            _assert_close_to(run, reference.state, F64)
            assert run["eval"] == pytest.approx(expected, abs=F32), level  # counted once per tp group
            # a sum-type train metric: 2 steps per log of 4 examples per dp group, each tp group once
            assert [value for _, value in run["train_seen"]] == [2.0 * 4 * 2] * 2, run["train_seen"]


@pytest.mark.slow
def test_tensor_parallel_and_zero_stopped_and_resumed_is_the_uninterrupted_run(zero_runs: list[dict]) -> None:
    for out in zero_runs:
        for level in LEVELS:
            run, resumed = out[level], out[level]["resumed"]
            assert resumed["step"] == run["step"] == 12, (level, resumed)
            torch.testing.assert_close(resumed["params"], run["params"], rtol=0, atol=0)  # bitwise
            for a, b in zip(resumed["opt_state"], run["opt_state"], strict=True):
                if isinstance(a, torch.Tensor):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_a_tensor_parallel_zero3_checkpoint_resumes_in_one_process(
    zero_runs: list[dict], tmp_path: Path
) -> None:
    run = zero_runs[0]["params"]
    t = ft.Trainer(
        fixtures.gpt(seed=3), fixtures.config(tmp_path / "one", resume_from_checkpoint=run["resumed"]["checkpoints"][6]),
        fixtures.tokens(48), fixtures.tokens(20, seed=1),
    )  # fmt: skip
    t.train()
    assert int(t.state.step) == 12
    for k, p in t.state.params.items():
        torch.testing.assert_close(p, run["params"][k], rtol=0, atol=F64)


@pytest.mark.slow
def test_each_rank_keeps_a_quarter_of_the_state_at_zero3(zero_runs: list[dict]) -> None:
    for out in zero_runs:  # params + optimizer state at rest, against the whole (one process's)
        assert out["params"]["at_rest"] <= 1.1 / 4, out["params"]["at_rest"]
        assert out["optimizer"]["at_rest"] > out["params"]["at_rest"]  # ZeRO-1 keeps the params' tp parts


@pytest.mark.slow
def test_tensor_parallel_zero_predicts_and_applies_gradients_as_one_process(
    zero_runs: list[dict], reference: ft.Trainer, applied_reference: ft.TrainState
) -> None:
    expected = reference.predict(fixtures.tokens(6, seed=2))
    for level in LEVELS:
        _assert_predicts_each_dp_slice_once(
            [out[level] | {"rank": out["rank"]} for out in zero_runs], expected
        )
        for out in zero_runs:
            assert out[level]["applied"]["step"] == 2
            _assert_close_to(out[level]["applied"], applied_reference, 1e-12)


@pytest.mark.slow
def test_weights_from_a_file_onto_a_tensor_parallel_state(runs: list[dict], zero_runs: list[dict]) -> None:
    weights = fixtures.gpt(seed=11).state_dict()  # the file's; each rank's model started from its own seed
    loaded = [out["initialized"] for out in runs] + [
        out[level]["initialized"] for out in zero_runs for level in LEVELS
    ]
    for initialized in loaded:  # init_weights_from, and load_best_model_at_end's restore of the best
        assert initialized["best_placed"]  # still DTensors: the state stays placed by its strategy
        for got in (initialized["init_weights_from"], initialized["best"]):
            assert got.keys() == weights.keys()
            for k, w in weights.items():
                torch.testing.assert_close(got[k], w, rtol=0, atol=0)


@pytest.mark.slow
def test_torchrun_functrain_train_yaml_with_tensor_parallel(tmp_path: Path, capsys, monkeypatch) -> None:
    # 2 ranks: tp 2 with ZeRO-3 over a dp axis of one (the 4-rank Trainer runs above shard over dp 2)
    path = _write_yaml(tmp_path, tensor_parallel=2, sharding="params")
    proc = _torchrun_cli(tmp_path, str(path))
    (summary,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    saved = ft.TrainerConfig.from_yaml(tmp_path / "cli_run" / "config.yaml")
    assert saved.tensor_parallel == 2 and saved.sharding == "params"
    # the same YAML in one process: the same steps and the same test metrics (float32)
    monkeypatch.syspath_prepend(str(HERE))
    capsys.readouterr()
    assert cli(["train", str(path), "tensor_parallel=1", f"output_dir={tmp_path / 'one'}"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == one["step"] == 12
    for key in ("test/loss", "test/accuracy"):
        assert summary[key] == pytest.approx(one[key], abs=F32), key
