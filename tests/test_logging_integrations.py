"""W&B and MLflow writers: the writer protocol, resume into the same run, clear errors without the package.

W&B is checked for real in offline mode when it is installed (it is not a dev dependency); both are
checked against fake modules that record the calls, so the call sequence is tested everywhere.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

from functrain import logging as flog
from functrain.logging.mlflow import MLflowWriter
from functrain.logging.wandb import WandbWriter

# ---------------------------------------------------------------------------------------- fakes


class FakeWandbRun:
    def __init__(self, calls: list[tuple[Any, ...]], run_id: str) -> None:
        self.calls, self.id = calls, run_id

    def log(self, values: dict[str, float], step: int) -> None:
        self.calls.append(("log", dict(values), step))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> FakeWandbRun:
        calls.append(("init", kwargs))
        return FakeWandbRun(calls, kwargs.get("id", f"run{len(calls)}"))

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


@pytest.fixture
def fake_mlflow(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    class Metric:
        def __init__(self, key: str, value: float, timestamp: int, step: int) -> None:
            self.key, self.value, self.timestamp, self.step = key, value, timestamp, step

    class Param:
        def __init__(self, key: str, value: str) -> None:
            self.key, self.value = key, value

    class MlflowClient:
        experiments: ClassVar[dict[str, str]] = {}

        def __init__(self, tracking_uri: str | None = None) -> None:
            calls.append(("client", tracking_uri))

        def get_experiment_by_name(self, name: str) -> Any:
            eid = self.experiments.get(name)
            return None if eid is None else types.SimpleNamespace(experiment_id=eid)

        def create_experiment(self, name: str) -> str:
            calls.append(("create_experiment", name))
            self.experiments[name] = "7"
            return "7"

        def create_run(self, experiment_id: str, run_name: str | None = None, tags: Any = None) -> Any:
            calls.append(("create_run", experiment_id, run_name, tags))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="abc123"))

        def update_run(self, run_id: str, status: str | None = None) -> None:
            calls.append(("update_run", run_id, status))

        def log_batch(self, run_id: str, metrics: Any = (), params: Any = ()) -> None:
            calls.append(
                (
                    "log_batch",
                    run_id,
                    [(m.key, m.value, m.step) for m in metrics],
                    [(p.key, p.value) for p in params],
                )
            )

        def set_terminated(self, run_id: str) -> None:
            calls.append(("set_terminated", run_id))

    module = types.ModuleType("mlflow")
    module.tracking = types.SimpleNamespace(MlflowClient=MlflowClient)  # type: ignore[attr-defined]
    module.entities = types.SimpleNamespace(Metric=Metric, Param=Param)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlflow", module)
    return calls


# ---------------------------------------------------------------------------------------- W&B


def test_wandb_writer_logs_each_write_and_finishes(fake_wandb: list, tmp_path: Path) -> None:
    writer = WandbWriter(tmp_path, project="proj", mode="offline", config={"lr": 0.1})
    assert isinstance(writer, flog.Writer)
    assert fake_wandb == []  # nothing starts before the first write
    writer.write(1, {"train/loss": 0.5})
    writer.write(3, {"train/loss": 0.25, "eval/accuracy": 0.9})
    writer.close()
    init = fake_wandb[0]
    assert init[0] == "init"
    assert init[1] == {"project": "proj", "mode": "offline", "config": {"lr": 0.1}, "dir": str(tmp_path)}
    assert fake_wandb[1:] == [
        ("log", {"train/loss": 0.5}, 1),
        ("log", {"train/loss": 0.25, "eval/accuracy": 0.9}, 3),
        ("finish",),
    ]
    assert (tmp_path / "wandb_run_id").read_text() == "run1"


def test_wandb_writer_resumes_the_same_run(fake_wandb: list, tmp_path: Path) -> None:
    (tmp_path / "wandb_run_id").write_text("abc")
    writer = WandbWriter(tmp_path, project="proj")
    writer.resume_from(10)
    writer.write(11, {"loss": 1.0})
    assert fake_wandb[0][1]["id"] == "abc" and fake_wandb[0][1]["resume"] == "allow"

    fresh = WandbWriter(tmp_path / "other", project="proj")
    fresh.resume_from(None)
    fresh.write(1, {"loss": 1.0})
    assert "id" not in fake_wandb[2][1] and "resume" not in fake_wandb[2][1]


def test_wandb_writer_checks_scalars_like_every_writer(fake_wandb: list, tmp_path: Path) -> None:
    writer = WandbWriter(tmp_path)
    with pytest.raises(TypeError, match="scalar 'loss' is a str"):
        writer.write(1, {"loss": "high"})
    assert fake_wandb == []


def test_wandb_offline_run_for_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'functrain[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.chdir(tmp_path)
    with WandbWriter(tmp_path / "logs", project="functrain-test", mode="offline") as writer:
        writer.write(1, {"train/loss": 0.5})
        writer.write(2, {"train/loss": 0.125, "eval/accuracy": 0.75})
    run_id = (tmp_path / "logs" / "wandb_run_id").read_text()
    files = list((tmp_path / "logs" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1
    # run.finish() returns before W&B's service process has written the records: wait for it
    deadline = time.monotonic() + 30
    while b"0.125" not in files[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    data = files[0].read_bytes()
    assert b"train/loss" in data and b"eval/accuracy" in data and b"0.125" in data


# ---------------------------------------------------------------------------------------- MLflow


def test_mlflow_writer_creates_a_run_logs_batches_and_terminates(fake_mlflow: list, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/mlruns"
    writer = MLflowWriter(tmp_path, tracking_uri=uri, experiment="exp", run_name="r1", params={"lr": 0.1})
    assert isinstance(writer, flog.Writer)
    writer.write(1, {"train/loss": 0.5, "train/grad_norm": 2})
    writer.write(5, {"eval/accuracy": 0.75})
    writer.close()
    assert fake_mlflow == [
        ("client", uri),
        ("create_experiment", "exp"),
        ("create_run", "7", "r1", {}),
        ("log_batch", "abc123", [], [("lr", "0.1")]),
        ("log_batch", "abc123", [("train/loss", 0.5, 1), ("train/grad_norm", 2.0, 1)], []),
        ("log_batch", "abc123", [("eval/accuracy", 0.75, 5)], []),
        ("set_terminated", "abc123"),
    ]
    assert (tmp_path / "mlflow_run_id").read_text() == "abc123"


def test_mlflow_writer_resumes_the_same_run(fake_mlflow: list, tmp_path: Path) -> None:
    (tmp_path / "mlflow_run_id").write_text("abc123")
    writer = MLflowWriter(tmp_path)
    writer.resume_from(4)
    writer.write(5, {"loss": 1.0})
    assert fake_mlflow[:3] == [
        ("client", None),
        ("update_run", "abc123", "RUNNING"),
        ("log_batch", "abc123", [("loss", 1.0, 5)], []),
    ]


# ---------------------------------------------------------------------------------------- missing


@pytest.mark.parametrize(
    ("cls", "module", "extra"), [(WandbWriter, "wandb", "wandb"), (MLflowWriter, "mlflow", "mlflow")]
)
def test_missing_package_names_the_extra(
    cls: Any, module: str, extra: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=rf'needs the {module} package: pip install "functrain\[{extra}\]"'):
        cls(tmp_path)


# ---------------------------------------------------------------------------------------- Trainer


def test_trainer_report_to_wandb_and_mlflow(
    fake_wandb: list, fake_mlflow: list, tmp_path: Path, monkeypatch
) -> None:
    import functrain as ft

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from trainer_fixtures import SmallNet, make_dataset, quiet_config

    cfg = quiet_config(
        tmp_path,
        output_dir=str(tmp_path / "myrun"),
        max_steps=4,
        log_steps=2,
        eval_strategy="no",
        save_strategy="no",
        report_to=["wandb", "mlflow"],
    )
    ft.Trainer(SmallNet(), cfg, train_dataset=make_dataset(64)).train()
    init = fake_wandb[0]
    assert init[1]["name"] == "myrun" and init[1]["config"]["max_steps"] == 4
    assert init[1]["dir"] == str(tmp_path / "myrun" / "logs")
    logged = [c for c in fake_wandb if c[0] == "log"]
    assert [c[2] for c in logged] == [2, 4] and all("train/loss" in c[1] for c in logged)
    assert fake_wandb[-1] == ("finish",)
    batches = [c for c in fake_mlflow if c[0] == "log_batch"]
    assert [sorted({m[2] for m in c[2]}) for c in batches] == [[2], [4]]
    assert ("train/loss", logged[0][1]["train/loss"], 2) in batches[0][2]
    assert fake_mlflow[-1] == ("set_terminated", "abc123")
