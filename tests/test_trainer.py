"""The Trainer facade and the functrain command: config to run, outputs, resume, CLI, demo."""

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
import yaml
from test_checkpoint_helpers import assert_bit_equal
from test_resume import jsonl
from trainer_fixtures import SmallNet, make_dataset

import functrain as ft
from functrain import checkpoint
from functrain.cli import main as cli

HERE = Path(__file__).parent


def small_config(tmp_path: Path, **overrides) -> ft.TrainerConfig:
    fields = dict(
        output_dir=str(tmp_path / "run"),
        epochs=2,
        batch_size=16,
        metrics=["accuracy", {"name": "F1Score", "task": "multiclass", "num_classes": 3, "average": "macro"}],
        progress_bar=False,
        compile=False,
        device="cpu",
        tensorboard=True,
        csv=True,
    )
    fields.update(overrides)
    metrics = fields.pop("metrics")
    fields["metrics"] = {m: {} for m in metrics if isinstance(m, str)} | {
        m["name"]: {k: v for k, v in m.items() if k != "name"} for m in metrics if isinstance(m, dict)
    }
    return ft.TrainerConfig(**fields)


def test_trainer_runs_and_writes_a_run_directory(tmp_path: Path):
    torch.manual_seed(0)
    trainer = ft.Trainer(SmallNet(), small_config(tmp_path), make_dataset(96), make_dataset(40, seed=1))
    result = trainer.train()
    run = tmp_path / "run"
    assert int(result.state.step) == 2 * 6
    assert (run / "config.yaml").exists()
    assert ft.TrainerConfig.from_yaml(run / "config.yaml") == trainer.config
    records = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in r and "eval/F1Score" in r for r in records)
    assert (run / "logs" / "metrics.csv").exists() and list((run / "logs" / "tensorboard").iterdir())
    assert checkpoint.CheckpointManager(run / "checkpoints").all_steps()[-1] == 12
    metrics = trainer.evaluate(make_dataset(40, seed=1))
    assert metrics == pytest.approx(result.eval_metrics)
    preds = trainer.predict(make_dataset(10, seed=2))
    assert preds.shape == (10, 3)
    trainer.save(tmp_path / "model.ckpt")
    fresh = ft.Trainer(
        SmallNet(),
        small_config(tmp_path, output_dir=str(tmp_path / "other")),
        make_dataset(96),
        make_dataset(40),
    )
    fresh.load(tmp_path / "model.ckpt")
    for k in trainer.state.params:
        assert torch.equal(fresh.state.params[k], trainer.state.params[k])


def test_a_rerun_writes_a_new_version_and_never_refuses_or_overwrites(tmp_path: Path, capsys):
    cfg = small_config(tmp_path, epochs=1)
    ft.Trainer(SmallNet(), cfg, make_dataset(32), make_dataset(16)).train()
    first = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    capsys.readouterr()
    for version in (1, 2):
        again = ft.Trainer(SmallNet(), cfg, make_dataset(32), make_dataset(16))
        assert int(again.train().state.step) == 2  # before: FileExistsError
        out = tmp_path / f"run-{version}"
        assert again.config.output_dir == str(out)
        assert f"this run writes '{out}'" in capsys.readouterr().err
        assert ft.TrainerConfig.from_yaml(out / "config.yaml").output_dir == str(out)
        assert checkpoint.CheckpointManager(out / "checkpoints").latest() == 2
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == first
    replaced = ft.Trainer(
        SmallNet(), cfg.replace(overwrite_output_dir=True), make_dataset(32), make_dataset(16)
    )
    assert int(replaced.train().state.step) == 2 and replaced.config.output_dir == cfg.output_dir
    assert not (tmp_path / "run-3").exists()
    resumed = ft.Trainer(SmallNet(), cfg.replace(resume_from_checkpoint=True, epochs=2), make_dataset(32))
    assert int(resumed.train().state.step) == 4 and resumed.config.output_dir == cfg.output_dir


def test_a_resume_says_once_from_which_step_and_file(tmp_path: Path, capsys):
    cfg = small_config(tmp_path, epochs=1)
    ft.Trainer(SmallNet(), cfg, make_dataset(32), make_dataset(16)).train()
    assert "resumed from" not in capsys.readouterr().err
    resumed = ft.Trainer(SmallNet(), cfg.replace(epochs=2, resume_from_checkpoint=True), make_dataset(32))
    assert int(resumed.train().state.step) == 4
    path = tmp_path / "run" / "checkpoints" / "step_0000000002.ckpt"
    assert capsys.readouterr().err.count(f"resumed from step 2 ({path})") == 1


def test_the_version_folder_is_chosen_by_rank_0_and_broadcast(tmp_path: Path, monkeypatch):
    """torchrun: rank 0 looks at the folder, every rank takes its answer (a rank that sees another
    filesystem state agrees all the same)."""
    from functrain import distributed
    from functrain.trainer import run_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("a run\n")
    cfg = small_config(tmp_path)
    sent = []
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "replicate", lambda x: sent.append(int(x)) or torch.tensor(5))
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    assert run_dir.resolve(cfg) == tmp_path / "run-5"  # rank 0's answer, not its own look
    assert sent == [0]
    monkeypatch.setattr(distributed, "is_main_process", lambda: True)
    monkeypatch.setattr(distributed, "replicate", lambda x: sent.append(int(x)) or x)
    assert run_dir.resolve(cfg) == tmp_path / "run-1" and sent == [0, 1]


def test_no_eval_dataset_trains_without_evaluating(tmp_path: Path):
    trainer = ft.Trainer(SmallNet(), small_config(tmp_path, metrics=[]), make_dataset(32))  # before: refused
    result = trainer.train()
    assert int(result.state.step) == 4 and not result.eval_metrics
    assert trainer.config.eval_strategy == "no"
    assert "eval/" not in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text()
    evaluated = ft.Trainer(SmallNet(), small_config(tmp_path / "e"), make_dataset(32), make_dataset(16))
    assert evaluated.config.eval_strategy == "epoch"  # auto: every epoch when there is an eval set
    assert set(evaluated.train().eval_metrics) >= {"eval/loss", "eval/accuracy"}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"eval_strategy": "epoch"}, "eval_strategy"),
        ({"eval_strategy": "steps", "eval_steps": 2}, "eval_strategy"),
        ({"early_stopping": {"monitor": "loss"}}, "early_stopping"),
        ({"load_best_model_at_end": True}, "load_best_model_at_end"),
    ],
)
def test_evaluation_asked_without_eval_dataset_names_the_argument(tmp_path: Path, fields, field):
    with pytest.raises(ft.ConfigError, match=f"{field}: .*no eval_dataset was given") as err:
        ft.Trainer(SmallNet(), small_config(tmp_path, **fields), make_dataset(32))
    assert "Trainer(eval_dataset=...)" in str(err.value) and "eval_dataset: module:attr" in str(err.value)


def test_save_strategy_no_writes_no_checkpoint(tmp_path: Path):
    trainer = ft.Trainer(SmallNet(), small_config(tmp_path, save_strategy="no"), make_dataset(32))
    assert int(trainer.train().state.step) == 4
    assert not (tmp_path / "run" / "checkpoints").exists()  # before: the final state was saved


def test_save_strategy_no_still_saves_where_a_preempted_run_stopped(tmp_path: Path):
    class Preempt(ft.callbacks.Callback):  # SIGTERM as step 1 ends: the run stops after step 2
        def on_step_end(self, state, ctx):
            if ctx.step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return state

    cfg = small_config(tmp_path, save_strategy="no")
    result = ft.Trainer(SmallNet(), cfg, make_dataset(32), callbacks=[Preempt()]).train()
    assert result.preempted and int(result.state.step) == 2
    assert checkpoint.CheckpointManager(tmp_path / "run" / "checkpoints").all_steps() == [2]  # to resume from


def test_freeze_and_init_weights_from(tmp_path: Path):
    torch.manual_seed(0)
    base = ft.Trainer(SmallNet(), small_config(tmp_path, epochs=1), make_dataset(64), make_dataset(16))
    base.train()
    base.save(tmp_path / "pretrained.ckpt")
    # a new head (4 classes): body weights load, the head stays at its initial value and body is frozen
    model = SmallNet(classes=4)
    cfg = small_config(
        tmp_path,
        output_dir=str(tmp_path / "finetune"),
        metrics=["accuracy"],
        epochs=1,
        init_weights_from=str(tmp_path / "pretrained.ckpt"),
        freeze={"patterns": ["body.*"]},
    )
    ds = torch.utils.data.TensorDataset(make_dataset(64).tensors[0], make_dataset(64).tensors[1] % 4)
    tuned = ft.Trainer(model, cfg, ds, ds)
    assert set(tuned.init_report.loaded) >= {"body.0.weight", "body.0.bias"}
    assert "head.weight" in tuned.init_report.initial
    start = tuned.state
    assert torch.equal(start.params["body.0.weight"], base.state.params["body.0.weight"])
    end = tuned.train().state
    assert torch.equal(end.params["body.0.weight"], start.params["body.0.weight"]), "frozen by pattern"
    assert not torch.equal(end.params["head.weight"], start.params["head.weight"])


class Recorder(ft.callbacks.Callback):
    def __init__(self):
        self.events = []

    def on_epoch_end(self, state, ctx):
        self.events.append(("epoch_end", ctx.epoch))
        return state


def test_subclass_extension_points_compile_into_the_step(tmp_path: Path):
    calls = {"preprocess": 0, "augment": 0}

    class Custom(ft.Trainer):
        def preprocess(self, batch):
            calls["preprocess"] += 1
            x, y = batch
            return x * 2.0, y

        def augment(self, batch):
            calls["augment"] += 1
            x, y = batch
            return x + 0.01 * torch.randn_like(x), y

    rec = Recorder()
    trainer = Custom(
        SmallNet(), small_config(tmp_path, epochs=2), make_dataset(32), make_dataset(16), callbacks=[rec]
    )
    trainer.train()
    assert calls["augment"] > 0 and calls["preprocess"] > calls["augment"]
    assert rec.events == [("epoch_end", 0), ("epoch_end", 1)]


@pytest.mark.slow
def test_trainer_killed_and_resumed_is_bit_identical(tmp_path: Path):
    job = [sys.executable, str(HERE / "trainer_job.py")]
    full = tmp_path / "full"
    out = subprocess.run([*job, str(full)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [*job, str(killed), "--sleep", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + 300
    manager = None
    while time.time() < deadline and proc.poll() is None:
        if manager is None and (killed / "checkpoints").exists():
            manager = checkpoint.CheckpointManager(killed / "checkpoints", is_writer=False)  # a reader only
        if manager is not None and (manager.latest() or 0) >= 14:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert 14 <= manager.latest() < 30
    out = subprocess.run([*job, str(killed), "--resume"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    a = checkpoint.restore(full / "final.ckpt")
    b = checkpoint.restore(killed / "final.ckpt")
    assert_bit_equal(b, a)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rs]  # noqa: E731
    assert strip(jsonl(full / "logs")) == strip(jsonl(killed / "logs"))


# ------------------------------------------------------------------------------------------ CLI


def write_config(tmp_path: Path, **extra) -> Path:
    cfg = {
        "output_dir": str(tmp_path / "cli_run"),
        "model": "trainer_fixtures:SmallNet",
        "train_dataset": {"target": "trainer_fixtures:make_dataset", "kwargs": {"n": 64}},
        "eval_dataset": {"target": "trainer_fixtures:make_dataset", "kwargs": {"n": 32, "seed": 1}},
        "test_dataset": {"target": "trainer_fixtures:make_dataset", "kwargs": {"n": 16, "seed": 2}},
        "epochs": 1,
        "batch_size": 16,
        "metrics": ["accuracy"],
        "compile": False,
        "progress_bar": False,
        "device": "cpu",
        **extra,
    }
    path = tmp_path / "run.yaml"
    path.write_text(ft.TrainerConfig.from_dict(cfg).to_yaml())
    return path


def test_cli_train_eval_predict(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    path = write_config(tmp_path)
    assert cli(["train", str(path), "optimizer.lr=3e-3", "epochs=2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 8 and "test/accuracy" in summary
    assert cli(["eval", str(path)]) == 0
    assert "eval/accuracy" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli(["predict", str(path), "--output", str(tmp_path / "preds.ckpt")]) == 0
    assert "functrain.checkpoint.restore(" in capsys.readouterr().out  # says how to read the file
    assert checkpoint.restore(tmp_path / "preds.ckpt")["preds"].shape == (16, 3)
    assert cli(["inspect", str(tmp_path / "preds.ckpt")]) == 0


def test_cli_eval_with_load_best_model_at_end_uses_the_best_checkpoint(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    path = write_config(tmp_path, epochs=3, load_best_model_at_end=True, metric_for_best_model="loss")
    assert cli(["train", str(path)]) == 0
    capsys.readouterr()
    manager = checkpoint.CheckpointManager(tmp_path / "cli_run" / "checkpoints", best_metric="eval/loss")
    best = manager.best()
    assert best is not None
    assert cli(["eval", str(path)]) == 0  # before: ValueError, best() needs a metric
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["eval/loss"] == pytest.approx(manager.metrics(best)["eval/loss"], rel=1e-6)


def test_cli_resume_of_an_early_stopped_run_stays_finished(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    early = {"monitor": "loss", "patience": 1, "min_delta": 1e9}  # nothing counts as an improvement
    path = write_config(tmp_path, epochs=10, early_stopping=early, test_dataset=None)
    assert cli(["train", str(path)]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["step"] == 8 and first["stop_reason"].startswith("early stopping")
    logs = (tmp_path / "cli_run" / "logs" / "metrics.jsonl").read_text()
    with pytest.warns(ft.RunFinishedWarning, match="stopped for good at step 8: early stopping"):
        assert cli(["train", str(path), "resume_from_checkpoint=true"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["step"] == 8 and again["stop_reason"] == first["stop_reason"]
    assert (tmp_path / "cli_run" / "logs" / "metrics.jsonl").read_text() == logs
    assert cli(["train", str(path), "resume_from_checkpoint=true", "--additional-epochs", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 12


_MYTASK = """
import torch
from trainer_fixtures import SmallNet, make_dataset


class Net(SmallNet):
    pass


def train_set():
    return make_dataset(48)


def needs_args(n):
    return make_dataset(n)
"""


def _user_project(tmp_path: Path, monkeypatch, module: str, **fields) -> Path:
    """A user's directory: ``<module>.py`` beside ``run.yaml``; the CLI runs from elsewhere, no PYTHONPATH."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(HERE)])  # trainer_fixtures only; restored after
    project = tmp_path / "project"
    project.mkdir()
    (project / f"{module}.py").write_text(_MYTASK)
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "model": f"{module}:Net",
        "train_dataset": f"{module}:train_set",
        "epochs": 1,
        "batch_size": 16,
        "compile": False,
        "progress_bar": False,
        "eval_strategy": "no",
        "device": "cpu",
        **fields,
    }
    (project / "run.yaml").write_text(yaml.safe_dump(cfg))
    return project


def test_cli_imports_a_module_beside_the_config_and_calls_a_function_spec(tmp_path, capsys, monkeypatch):
    project = _user_project(tmp_path, monkeypatch, "mytask_beside")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli(["train", str(project / "run.yaml")]) == 0, capsys.readouterr().err
    # train_set is a function: called, its 48 examples give 3 steps (not "the dataset has no length")
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3


def test_cli_imports_a_module_from_the_current_directory(tmp_path, capsys, monkeypatch):
    project = _user_project(tmp_path, monkeypatch, "mytask_cwd")
    (tmp_path / "configs").mkdir()
    (project / "run.yaml").rename(tmp_path / "configs" / "run.yaml")
    monkeypatch.chdir(project)
    assert cli(["train", str(tmp_path / "configs" / "run.yaml")]) == 0, capsys.readouterr().err


def test_cli_missing_module_and_function_needing_arguments_are_explained(tmp_path, capsys, monkeypatch):
    project = _user_project(tmp_path, monkeypatch, "mytask_errors", model="nosuchmodule_xyz:Net")
    monkeypatch.chdir(tmp_path)
    assert cli(["train", str(project / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert "no module named 'nosuchmodule_xyz'" in err
    assert f"the config's directory ({project})" in err and f"the current directory ({tmp_path})" in err
    assert "PYTHONPATH" in err
    path = project / "run.yaml"
    path.write_text(path.read_text().replace("nosuchmodule_xyz:Net", "mytask_errors:Net"))
    assert cli(["train", str(path), "train_dataset=mytask_errors:needs_args"]) == 2
    err = capsys.readouterr().err
    assert "train_dataset" in err and "called with no arguments" in err and "kwargs" in err


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optimizer.lrr=0.1", "optimizer.lrr"),
        ("epochs=-1", "epochs"),
        ("model=trainer_fixtures:NoSuchNet", "model"),
        ("eval_strategy=steps", "eval_steps"),
    ],
)
def test_cli_bad_config_names_the_field(tmp_path: Path, capsys, monkeypatch, override, field):
    monkeypatch.syspath_prepend(str(HERE))
    path = write_config(tmp_path)
    assert cli(["train", str(path), override]) == 2
    err = capsys.readouterr().err
    assert field in err and "Fix:" in err


def test_cli_help_config_lists_fields(capsys):
    assert cli(["train", "--help-config"]) == 0
    text = capsys.readouterr().out
    for name in ("optimizer.lr", "gradient_accumulation_steps", "mixed_precision", "freeze.patterns"):
        assert name in text


def test_demo_runs_small(tmp_path: Path):
    from functrain.trainer import demo

    results = demo.run(str(tmp_path / "demo"), epochs=1, compile=False, progress_bar=False, tensorboard=False)
    assert results["eval/accuracy"] > 0.6
    assert os.path.exists(tmp_path / "demo" / "logs" / "metrics.jsonl")


@pytest.mark.slow
def test_cli_under_torchrun_two_processes(tmp_path: Path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = write_config(tmp_path, epochs=2, batch_size=8)
    root = os.path.dirname(os.path.dirname(ft.__file__))  # the functrain under test, not the installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={port}",
            "-m",
            "functrain",
            "train",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout[-2000:]}\nstderr:\n{out.stderr[-4000:]}"
    summaries = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1, "only rank 0 prints"
    assert summaries[0]["step"] == 2 * 64 // (8 * 2) and "test/accuracy" in summaries[0]
    steps = checkpoint.CheckpointManager(tmp_path / "cli_run" / "checkpoints", is_writer=False).all_steps()
    assert steps == [4, 8]


def test_every_config_field_is_consumed():
    """No field is accepted and ignored: each one is read by the Trainer or the command line."""
    import re

    from functrain.config.section import leaf_paths

    package = HERE.parent / "functrain"  # the Trainer package (its builders, the demo) and the CLI
    sources = "".join(
        f.read_text()
        for f in [*sorted((package / "trainer").glob("*.py")), *sorted((package / "cli").glob("*.py"))]
    )
    unread = []
    for path in leaf_paths(ft.TrainerConfig):  # sections expanded, optional ones (early_stopping) too
        name = path.rsplit(".", 1)[-1]
        if not re.search(rf"\.(resolved_)?{name}\b", sources):
            unread.append(path)
    assert not unread, f"config fields never read: {unread}"


def test_compile_cache_in_the_run_directory_is_opt_in(tmp_path: Path):
    # The cache folder alone does not make output_dir "hold a run" (it may come from evaluate()).
    from functrain.trainer import COMPILE_CACHE_DIR, run_dir

    default = ft.Trainer(
        SmallNet(), small_config(tmp_path, compile=True, eval_strategy="no"), make_dataset(32)
    )
    assert default._jit("train").cache_dir is None  # opt-in: the files are pickles
    trainer = ft.Trainer(
        SmallNet(),
        small_config(tmp_path, compile=True, compile_cache=True, eval_strategy="no"),
        make_dataset(32),
    )
    step = trainer._jit("train")  # wrapping compiles nothing yet
    assert Path(step.cache_dir) == tmp_path / "run" / COMPILE_CACHE_DIR
    (tmp_path / "run" / COMPILE_CACHE_DIR).mkdir(parents=True)
    assert run_dir.resolve(trainer.config) == tmp_path / "run"  # not a run: no new version for it
    eager = ft.Trainer(SmallNet(), small_config(tmp_path / "e", eval_strategy="no"), make_dataset(32))
    assert eager._jit("train").cache_dir is None


def test_train_closes_its_loggers_when_training_fails(tmp_path: Path, monkeypatch):
    class Failing(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int):
            if i >= 32:
                raise RuntimeError("broken example")
            return make_dataset(64)[i]

    closed: list[str] = []
    made = ft.Trainer._loggers

    def recording(self, log_dir):
        loggers = made(self, log_dir)
        for lg in loggers:
            monkeypatch.setattr(lg, "close", lambda lg=lg: closed.append(type(lg).__name__))
        return loggers

    monkeypatch.setattr(ft.Trainer, "_loggers", recording)
    trainer = ft.Trainer(SmallNet(), small_config(tmp_path), Failing(), make_dataset(40, seed=1))
    with pytest.raises(RuntimeError, match="broken example"):
        trainer.train()
    assert sorted(closed) == ["CSVWriter", "JSONLWriter", "TensorBoardWriter"]
