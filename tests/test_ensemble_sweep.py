"""Sweeps: the config field, the Trainer training the grid as one ensemble, its results, and the CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from sweep_fixtures import DigitsMLP, digits

import functrain as ft
from functrain.cli import main as cli
from functrain.config import ConfigError
from functrain.ensemble.grid import grid
from functrain.logging import History
from functrain.trainer import sweep as trainer_sweep

HERE = Path(__file__).parent


# ------------------------------------------------------------------------------------ the config field


def test_sweep_field_accepts_lists_comma_strings_and_nested_keys():
    cfg = ft.TrainerConfig(epochs=1, sweep={"optimizer": {"lr": "1e-3, 3e-3"}, "seed": [0, 1]})
    assert cfg.sweep == {"optimizer.lr": [1e-3, 3e-3], "seed": [0, 1]}
    assert ft.TrainerConfig.from_yaml(cfg.to_yaml()) == cfg
    over = cfg.with_overrides(["sweep.optimizer.lr=1e-2,1e-1"])
    assert over.sweep["optimizer.lr"] == [1e-2, 1e-1]
    assert ft.TrainerConfig(epochs=1).sweep == {}


@pytest.mark.parametrize(
    ("sweep", "path", "words"),
    [
        ({"batch_size": [16, 32]}, "sweep.batch_size", "cannot be swept in one ensemble"),
        ({"optimizer.lrr": [0.1]}, "sweep.optimizer.lrr", "did you mean 'optimizer.lr'"),
        # each value is checked as the field itself checks it (its type, bounds, finiteness)
        ({"optimizer.lr": [0.1, 0]}, "sweep.optimizer.lr[1]", "must be > 0"),
        ({"optimizer.lr": "1e-3,nan"}, "sweep.optimizer.lr[1]", "must be a finite number"),
        ({"seed": ["a"]}, "sweep.seed[0]", "expected an integer"),
        ({"seed": [1, 1]}, "sweep.seed", "twice"),
    ],
)
def test_bad_sweeps_name_the_field(sweep, path, words):
    with pytest.raises(ConfigError) as info:
        ft.TrainerConfig(epochs=1, sweep=sweep)
    assert path in info.value.paths and words in str(info.value)


def test_grid_orders_members_with_the_last_key_fastest():
    members = grid({"optimizer.lr": [1, 2], "seed": [0, 1, 2]})
    assert len(members) == 6 and members[1] == {"optimizer.lr": 1, "seed": 1}
    assert members[3] == {"optimizer.lr": 2, "seed": 0}


# ------------------------------------------------------------------------------------ the Trainer


def _config(tmp_path, **extra):
    fields = {
        "output_dir": str(tmp_path / "run"),
        "epochs": 2,
        "batch_size": 64,
        "metrics": ["accuracy"],
        "metric_for_best_model": "accuracy",
        "compile": False,
        "progress_bar": False,
        "device": "cpu",
    }
    return ft.TrainerConfig(**{**fields, **extra})


def test_trainer_trains_the_grid_as_one_ensemble_and_reports_it(tmp_path, caplog):
    sweep = {"optimizer.lr": [1e-3, 1e-2], "seed": [0, 1]}
    model = DigitsMLP()
    trainer = ft.Trainer(model, _config(tmp_path, sweep=sweep), digits("train", 256), digits("val"))
    assert ft.ensemble.size(trainer.state) == 4
    # member 2 is (lr=1e-2, seed=0): its own initialisation and learning rate (a scale of the schedule)
    assert torch.equal(
        trainer.state.params["net.1.weight"][2], ft.ensemble.initialise(model, 0).net[1].weight
    )
    assert torch.equal(trainer.state.rng[3], ft.random.key(1))
    scales = ft.optim.hyperparams(trainer.state.opt_state)["learning_rate_scale"]
    assert torch.allclose(scales, torch.tensor([1.0, 1.0, 10.0, 10.0]))

    result = trainer.train()
    out = tmp_path / "run"
    rows = list(csv.DictReader((out / "sweep_results.csv").open()))
    assert [int(r["member"]) for r in rows] == [0, 1, 2, 3]
    assert float(rows[2]["optimizer.lr"]) == 1e-2 and int(rows[2]["seed"]) == 0
    finals = [result.eval_metrics[f"eval/accuracy/member_{i}"] for i in range(4)]
    assert [float(r["eval/accuracy (final)"]) for r in rows] == pytest.approx(finals)
    best = max(range(4), key=lambda i: finals[i])
    assert trainer.sweep_best == best
    assert f"| {best} (best) |" in (out / "sweep_results.md").read_text()
    assert (out / "sweep_curves.png").stat().st_size > 1000
    # best_member() is that member's state: evaluated alone it scores what the ensemble reported
    winner = trainer.best_member()
    assert not ft.ensemble.is_ensemble(winner)
    single_eval = ft.make_eval_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
    alone = ft.evaluate(winner, single_eval, digits("val"), batch_size=64)
    assert alone["eval/loss"] == pytest.approx(result.eval_metrics[f"eval/loss/member_{best}"], abs=1e-5)
    # logs carry every member
    first = json.loads((out / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert "train/loss/member_3" in first


def test_sweep_without_matplotlib_skips_the_plot_with_a_log_line(tmp_path, hide_import, caplog):
    import torchmetrics  # noqa: F401  # imports matplotlib if it can: load it first, as any earlier test would

    hide_import("matplotlib")
    cfg = _config(tmp_path, sweep={"optimizer.lr": [1e-3, 1e-2]}, epochs=1)
    with caplog.at_level("WARNING", logger="functrain.ensemble"):
        ft.Trainer(DigitsMLP(), cfg, digits("train", 128), digits("val", 64)).train()
    assert not (tmp_path / "run" / "sweep_curves.png").exists()
    assert (tmp_path / "run" / "sweep_results.csv").exists()
    assert "matplotlib is not installed" in caplog.text


def test_plot_sweep_draws_every_member_and_leaves_the_backend_alone(tmp_path):
    import matplotlib

    history = History()
    for step in (1, 2, 3):
        for i in range(2):
            history.put(f"train/loss/member_{i}", 1.0 / (step + i), step)
            history.put(f"eval/accuracy/member_{i}", 0.1 * step + i, step)
    backend = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # e.g. a notebook's inline backend: plotting must not switch it to Agg
        png = trainer_sweep.plot_sweep(history, [{"seed": 0}, {"seed": 1}], tmp_path / "curves.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    assert (
        png == tmp_path / "curves.png"
        and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and png.stat().st_size > 1000
    )


def test_weight_decay_sweep_needs_an_optimizer_that_keeps_it(tmp_path):
    cfg = _config(tmp_path, sweep={"optimizer.weight_decay": [0.0, 0.1]}, optimizer={"name": "sgd"})
    with pytest.raises(ConfigError, match="keeps no 'weight_decay'"):
        ft.Trainer(DigitsMLP(), cfg, digits("train", 64), digits("val", 64))
    cfg = _config(tmp_path, sweep={"optimizer.weight_decay": [0.0, 0.1]}, optimizer={"name": "adamw"})
    trainer = ft.Trainer(DigitsMLP(), cfg, digits("train", 64), digits("val", 64))
    assert torch.equal(
        ft.optim.hyperparams(trainer.state.opt_state)["weight_decay"], torch.tensor([0.0, 0.1])
    )


def test_cli_runs_a_3x3_digits_sweep_in_one_process_and_picks_the_best(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    cfg = _config(
        tmp_path,
        model="sweep_fixtures:DigitsMLP",
        train_dataset={"target": "sweep_fixtures:digits", "kwargs": {"split": "train"}},
        eval_dataset={"target": "sweep_fixtures:digits", "kwargs": {"split": "val"}},
    )
    path = tmp_path / "run.yaml"
    path.write_text(cfg.to_yaml())
    argv = ["train", str(path), "--sweep", "optimizer.lr=1e-3,3e-3,1e-2", "--sweep", "seed=0,1,2"]
    assert cli(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    out = tmp_path / "run"
    rows = list(csv.DictReader((out / "sweep_results.csv").open()))
    assert len(rows) == 9 and (out / "sweep_curves.png").exists()
    finals = [float(r["eval/accuracy (final)"]) for r in rows]
    assert summary["best_member"] == finals.index(max(finals))
    assert summary["optimizer.lr"] == float(rows[summary["best_member"]]["optimizer.lr"])
    assert max(finals) > 0.8  # digits learn within 2 epochs at the best learning rate
    saved = ft.TrainerConfig.from_yaml(out / "config.yaml")
    assert saved.sweep == {"optimizer.lr": [1e-3, 3e-3, 1e-2], "seed": [0, 1, 2]}
    # predictions of every member from the run's checkpoint (its step: the members' shared count)
    preds = tmp_path / "preds.ckpt"
    assert cli(["predict", str(out / "config.yaml"), "--split", "eval", "--output", str(preds)]) == 0
    assert ft.checkpoint.restore(preds)["preds"]["members"].shape[1] == 9


def test_cli_refuses_a_sweep_of_a_field_outside_the_state(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    cfg = _config(tmp_path, model="sweep_fixtures:DigitsMLP", train_dataset="sweep_fixtures:digits")
    path = tmp_path / "run.yaml"
    path.write_text(cfg.to_yaml())
    assert cli(["train", str(path), "--sweep", "batch_size=16,32"]) == 2
    err = capsys.readouterr().err
    assert "sweep.batch_size" in err and "cannot be swept" in err


@pytest.mark.slow
def test_sweep_notebook_executes_headless(tmp_path, monkeypatch):
    """examples/05_sweep.ipynb, small and eager (FUNCTRAIN_SMALL=1), as tests/test_examples.py runs the other."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    monkeypatch.setenv("FUNCTRAIN_SMALL", "1")
    monkeypatch.setenv("FUNCTRAIN_PLOT", str(tmp_path / "curves.png"))
    nb = nbformat.read(HERE.parent / "examples" / "05_sweep.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert (tmp_path / "curves.png").stat().st_size > 1000  # execute() raised on any error cell
