"""``TrainerConfig.sharding`` (ZeRO-1/2/3) through the Trainer, the YAML and ``torchrun -m functrain train``.

Fast here: the field (aliases, refusals), one process against ``sharding: none``, the CLI's early refusal.
Slow (torchrun, 2 CPU ranks, gloo): the Trainer at each level against ``none`` in float64, shards per rank,
resume, ``save``/``load`` (``sharding_worker.py trainer``), and ``torchrun -m functrain train run.yaml
sharding=params`` resumed by the same command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_sharding_torchrun import _free_port, _torchrun
from test_trainer import write_config
from trainer_fixtures import SmallNet, make_dataset, quiet_config

import functrain as ft
from functrain.checkpoint import sharded as ckpt
from functrain.cli import main as cli
from functrain.distributed.block_spec import block_names

HERE = Path(__file__).parent
F64 = 1e-12
# float64, sharded vs replicated over 15 AdamW steps: measured 5e-9. Not the reduction's error (1e-16) but
# its amplification: Adam divides gradients near zero (a bias before BatchNorm: pure rounding noise) by
# |g| + eps, and BatchNorm over a 1-example last batch divides by sqrt(eps). The levels agree bitwise.
REPLICATED = 1e-7


# ------------------------------------------------------------------------------------------- the field


@pytest.mark.parametrize(
    ("given", "level"),
    [
        ("none", "none"), ("optimizer", "optimizer"), ("grads", "grads"), ("params", "params"),
        ("full", "params"), ("FULL_SHARD", "params"), ("grad_op", "grads"), ("shard_grad_op", "grads"),
        ("no_shard", "none"), (0, "none"), (1, "optimizer"), (2, "grads"), (3, "params"), (False, "none"),
    ],
)  # fmt: skip
def test_sharding_levels_and_their_aliases(given: object, level: str) -> None:
    config = ft.TrainerConfig(max_steps=1, sharding=given)
    assert config.sharding == level
    assert ft.TrainerConfig.from_yaml(config.to_yaml()).sharding == level  # saved in functrain's spelling


def test_sharding_from_yaml_and_overrides_and_in_the_help() -> None:
    config = ft.TrainerConfig.from_yaml("max_steps: 1\nsharding: grad_op")
    assert config.sharding == "grads"
    assert config.with_overrides(["sharding=3"]).sharding == "params"
    from functrain.config import config_help

    help_text = config_help()
    assert "sharding: 'none' | 'optimizer' | 'grads' | 'params' = none" in help_text
    assert "full_shard/full = params" in help_text


@pytest.mark.parametrize("bad", ["zero9", True, [3], 4])
def test_a_bad_sharding_value_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ft.ConfigError) as caught:
        ft.TrainerConfig(max_steps=1, sharding=bad)
    (problem,) = caught.value.problems
    assert problem.path == "sharding" and "'optimizer', 'grads', 'params'" in str(caught.value)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"sweep": {"seed": [0, 1]}}, "sweep"),
        ({"mixed_precision": "fp16", "device": "cuda"}, "mixed_precision"),
    ],
)
def test_what_a_sharded_step_cannot_do_is_refused_by_the_config(fields: dict, named: str) -> None:
    ft.TrainerConfig(max_steps=1, sharding="none", **fields)  # fine without sharding
    with pytest.raises(ft.ConfigError) as caught:
        ft.TrainerConfig(max_steps=1, sharding="full", **fields)
    (problem,) = caught.value.problems
    assert problem.path == named
    assert "sharding='params'" in problem.message and "sharding=none" in problem.fix


def test_the_cli_refuses_a_bad_sharding_before_training(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    path = write_config(tmp_path)
    assert cli(["train", str(path), "sharding=zero9"]) != 0
    err = capsys.readouterr().err
    assert "sharding" in err and "zero9" in err
    assert not (tmp_path / "cli_run").exists()


# ------------------------------------------------------------------------------------------- one process


def _trained(tmp_path: Path, level: str, **fields: object) -> ft.Trainer:
    config = quiet_config(
        tmp_path / level, epochs=2, batch_size=8, seed=3, max_grad_norm=0.5, metrics=["accuracy"],
        sharding=level, **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = ft.Trainer(SmallNet(), config, make_dataset(60), make_dataset(20, seed=1))
    trainer.train()
    return trainer


def test_one_process_holds_every_shard_and_trains_as_replicated(tmp_path: Path) -> None:
    """World size 1: each level is a state whose one rank holds every row; the run is the replicated one."""
    plain = _trained(tmp_path, "none")
    for level in ("params", "grads"):
        trainer = _trained(tmp_path, level)
        assert trainer.state.layout.request.level == level
        torch.testing.assert_close(trainer.state.params, plain.state.params, rtol=1e-6, atol=1e-7)
        assert trainer.evaluate() == pytest.approx(plain.evaluate(), rel=1e-6)
        torch.testing.assert_close(trainer.predict(make_dataset(5)), plain.predict(make_dataset(5)))
        manager = trainer.checkpoint_manager()
        assert isinstance(manager, ckpt.ShardedCheckpointManager) and manager.all_steps() == [8, 16]
    config = trainer.config.replace(epochs=3, resume_from_checkpoint=True)
    more = ft.Trainer(SmallNet(), config, make_dataset(60), make_dataset(20, seed=1))
    assert int(more.train().state.step) == 24  # resumed from step 16 of the sharded checkpoints


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _Stack(torch.nn.Module):
    """Repeated blocks (``layers``) between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _trained_stack(directory: Path, rows: int, **fields: object) -> ft.Trainer:
    """``_Stack`` in float64, trained 2 epochs in batches of 8 on ``rows`` examples, no evaluation."""
    config = quiet_config(directory, epochs=2, batch_size=8, seed=3, eval_strategy="no", **fields)
    torch.manual_seed(0)
    trainer = ft.Trainer(_Stack().double(), config, _float64(make_dataset(rows)))
    trainer.train()
    return trainer


@pytest.mark.parametrize("blocks", [["auto"], ["_Layer"], ["layers.0", "layers.2"]])
def test_sharding_blocks_from_the_config_train_as_without_them(tmp_path: Path, blocks: list) -> None:
    def run(name: str, **fields: object) -> ft.Trainer:
        return _trained_stack(tmp_path / name, 40, max_grad_norm=0.5, sharding="params", **fields)

    plain, blocked = run("plain"), run("blocks", sharding_blocks=blocks)
    expected = ("layers.0", "layers.2") if "layers.0" in blocks else ("layers.0", "layers.1", "layers.2")
    assert block_names(_Stack(), blocked.sharding.blocks) == expected
    assert plain.sharding.blocks is None
    torch.testing.assert_close(blocked.state.params, plain.state.params, rtol=0, atol=1e-12)


def test_padded_train_batches_with_sharding_train_as_without(tmp_path: Path) -> None:
    # 37 rows in batches of 8: the last batch is padded to 8 (one compiled shape), its 3 masked rows
    # weigh nothing; the multi-rank case is tests/test_sharding_torchrun.py's padded parity
    plain = _trained_stack(tmp_path / "plain", 37, pad_train_batches=True)
    for name, fields in {"params": {}, "blocks": {"sharding_blocks": ["auto"]}}.items():
        sharded = _trained_stack(tmp_path / name, 37, pad_train_batches=True, sharding="params", **fields)
        assert int(sharded.state.step) == int(plain.state.step) == 10
        # the sharded step weighs the gradient by the 5 real rows and divides by them (g * 5 / 5 rounds
        # where 8 / 8 does not); Adam's |g| + eps normalisation made that 4e-11 after 10 steps
        torch.testing.assert_close(sharded.state.params, plain.state.params, rtol=0, atol=1e-9)


def _float64(dataset: torch.utils.data.TensorDataset) -> torch.utils.data.TensorDataset:
    x, y = dataset.tensors
    return torch.utils.data.TensorDataset(x.double(), y)


def test_sharding_blocks_are_refused_without_sharded_params_or_with_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ft.ConfigError) as caught:
        ft.TrainerConfig(max_steps=1, sharding="optimizer", sharding_blocks="auto")
    assert caught.value.problems[0].path == "sharding_blocks" and "sharding=params" in str(caught.value)
    with pytest.raises(ft.ConfigError, match="functrain calls this field 'sharding_blocks'"):
        ft.TrainerConfig(max_steps=1, sharding="params", transformer_layer_cls_to_wrap=["BertLayer"])
    config = quiet_config(
        tmp_path, max_steps=1, sharding="params", sharding_blocks=["BertLayer"], eval_strategy="no"
    )
    with pytest.raises(
        ft.ConfigError, match=r"sharding_blocks: \['BertLayer'\] name no class and no submodule"
    ):
        ft.Trainer(_Stack(), config, make_dataset(8))


# ------------------------------------------------------------------------------------------- torchrun


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("trainer_runs")
    state = ft.TrainState.create(SmallNet().double(), ft.optim.sgd(0.1), seed=1)  # every run's start
    ft.checkpoint.save(out / "init.ckpt", state)
    return _torchrun("trainer", str(out), 2, str(out))


@pytest.mark.slow
@pytest.mark.parametrize("level", ["optimizer", "params"])
def test_trainer_on_two_ranks_equals_sharding_none(trainer_runs: list[dict], level: str) -> None:
    for out in trainer_runs:
        plain, sharded = out["none"], out[level]
        torch.testing.assert_close(sharded["params"], plain["params"], rtol=0, atol=REPLICATED)
        for a, b in zip(sharded["opt_state"], plain["opt_state"]):
            torch.testing.assert_close(a, b, rtol=0, atol=REPLICATED)
        assert sharded["eval"] == pytest.approx(plain["eval"], abs=1e-6)  # float32 metrics
        torch.testing.assert_close(sharded["predict"], plain["predict"], rtol=0, atol=REPLICATED)
        torch.testing.assert_close(sharded["params"], out["optimizer"]["params"], rtol=0, atol=F64)
        assert sharded["checkpoints"] == plain["checkpoints"] == [5, 10, 15]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["optimizer", "params"])
def test_a_sharded_trainer_keeps_and_evaluates_an_ema(trainer_runs: list[dict], level: str) -> None:
    # the average is kept in the optimizer's rows; ZeRO-1's evaluation got those rows as its params
    for out in trainer_runs:
        plain, sharded = out["ema/none"], out[f"ema/{level}"]
        torch.testing.assert_close(sharded["average"], plain["average"], rtol=0, atol=REPLICATED)
        gap = max(float((plain["average"][k] - plain["params"][k]).abs().max()) for k in plain["params"])
        assert gap > 1e-3  # the average is not the weights: evaluating one for the other would show
        assert sharded["eval"] == pytest.approx(plain["eval"], abs=1e-6)


@pytest.mark.slow
def test_each_rank_holds_a_shard(trainer_runs: list[dict]) -> None:
    full = {k: tuple(v.shape) for k, v in trainer_runs[0]["none"]["params"].items()}
    half = {k: (-(-shape[0] // 2), *shape[1:]) for k, shape in full.items()}
    for out in trainer_runs:
        assert out["none"]["local_params"] == full
        assert out["optimizer"]["local_params"] == full  # ZeRO-1: params replicated ...
        assert out["params"]["local_params"] == half  # ZeRO-3: 1/2 of every param's rows
        for level in ("optimizer", "params"):  # ... and Adam's moments sharded at both levels
            assert sorted(out[level]["local_opt"]) == sorted(list(half.values()) * 2)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["optimizer", "params"])
def test_a_sharded_trainer_resumes_saves_and_loads(trainer_runs: list[dict], level: str) -> None:
    for out in trainer_runs:
        final = out[level]["params"]
        torch.testing.assert_close(out[level]["resumed"], final, rtol=0, atol=0)  # 2 epochs + 1 == 3
        torch.testing.assert_close(out[level]["loaded_whole"], final, rtol=0, atol=0)  # Trainer.save/load
        step, params = out[level]["loaded_shards"]  # Trainer.load(the run's step_15.shards manifest)
        assert step == 15
        torch.testing.assert_close(params, final, rtol=0, atol=0)


def _torchrun_cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    root = os.path.dirname(os.path.dirname(ft.__file__))  # the functrain under test
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, str(HERE), env.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
        "-m", "functrain", "train", *argv,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_torchrun_functrain_train_yaml_sharded_and_resumed(tmp_path: Path, capsys, monkeypatch) -> None:
    path = write_config(tmp_path, epochs=2, batch_size=8)
    first = _torchrun_cli(tmp_path, str(path), "sharding=params")
    (summary,) = [json.loads(line) for line in first.stdout.splitlines() if line.startswith("{")]
    assert summary["step"] == 2 * 64 // (8 * 2) and "test/accuracy" in summary
    checkpoints = tmp_path / "cli_run" / "checkpoints"
    assert ckpt.sharded_steps(checkpoints) == [4, 8]
    assert ckpt._Source(checkpoints, 8).world_size == 2  # one file per rank
    saved = ft.TrainerConfig.from_yaml(tmp_path / "cli_run" / "config.yaml")
    assert saved.sharding == "params"

    again = _torchrun_cli(tmp_path, str(path), "sharding=params", "epochs=3", "resume_from_checkpoint=true")
    (summary,) = [json.loads(line) for line in again.stdout.splitlines() if line.startswith("{")]
    assert summary["step"] == 12 and ckpt.sharded_steps(checkpoints) == [4, 8, 12]
    whole = ckpt.restore_sharded(checkpoints)["state"]  # no process group: the whole state
    assert whole["params"]["head.weight"].shape == (3, 16)

    # eval in one process reads the 2-rank sharded checkpoint (any world size restores it)
    monkeypatch.syspath_prepend(str(HERE))
    capsys.readouterr()
    assert cli(["eval", str(path), "sharding=params", "epochs=3"]) == 0
    assert "eval/accuracy" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
