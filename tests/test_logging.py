"""functrain.logging: History, writers (console, JSONL, CSV, TensorBoard), plot_run and the plot command."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from typing import ClassVar

import pytest
import torch

from functrain import logging as flog
from functrain.logging.cli import main, register


class CountingTensor(torch.Tensor):
    """Records every host conversion made on it or on tensors derived from it."""

    conversions: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in {"item", "tolist", "__float__", "__int__", "numpy", "cpu"}:
            cls.conversions.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_history_put_does_not_convert_until_flush_and_flush_syncs_once() -> None:
    CountingTensor.conversions = []
    history = flog.History()
    for step in range(5):
        history.put("loss", torch.tensor(1.0 / (step + 1)).as_subclass(CountingTensor), step=step)
        history.put("lr", 0.1, step=step)
    assert CountingTensor.conversions == []
    assert len(history._pending) == 10
    history.flush()
    assert CountingTensor.conversions == ["tolist"]  # one stacked transfer for all pending tensors
    assert history.series("loss") == [(s, pytest.approx(1.0 / (s + 1))) for s in range(5)]
    assert history.latest("lr") == 0.1


def test_history_tensor_steps_round_trip_and_errors() -> None:
    history = flog.History()
    history.put("loss", torch.tensor(2.0), step=torch.tensor(7))
    assert history.series("loss") == [(7, 2.0)]
    with pytest.raises(KeyError, match="did you mean loss"):
        history.latest("los")
    with pytest.raises(ValueError, match="one-element tensor"):
        history.put("loss", torch.ones(3), step=1)
    with pytest.raises(TypeError, match="non-empty string"):
        history.put("", 1.0, step=1)


def test_history_as_dict_is_plain_data_and_restores() -> None:
    history = flog.History()
    history.put_scalars({"loss": torch.tensor(0.5), "accuracy": 0.75}, step=10)
    history.put("loss", 0.25, step=20)
    data = history.as_dict()
    assert json.loads(json.dumps(data)) == data  # plain lists of numbers, no tensors
    restored = flog.History.from_dict(data)
    assert restored.series("loss") == [(10, 0.5), (20, 0.25)]
    restored.truncate(after_step=10)
    assert restored.series("loss") == [(10, 0.5)] and restored.names() == ["accuracy", "loss"]


def test_console_writer_one_readable_line() -> None:
    out = io.StringIO()
    flog.ConsoleWriter(out).write(12, {"loss": 0.123456789, "epoch": 2})
    assert out.getvalue() == "step 12 | loss 0.12346 | epoch 2\n"
    with pytest.raises(TypeError, match=r"scalar 'loss' is a Tensor.*to_floats"):
        flog.ConsoleWriter(out).write(1, {"loss": torch.tensor(1.0)})


def test_jsonl_lines_parse_and_resume_drops_later_steps(tmp_path) -> None:
    with flog.JSONLWriter(tmp_path) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": 1.0 / step})
        writer.write(5, {"eval/accuracy": 0.5, "loss_nan": math.nan})
    path = tmp_path / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5]
    assert records[2]["loss"] == pytest.approx(1 / 3) and math.isnan(records[5]["loss_nan"])
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # a crash mid-line
    with flog.JSONLWriter(tmp_path, resume_step=3) as writer:
        writer.write(4, {"loss": 0.0})
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    with flog.JSONLWriter(tmp_path) as writer:  # a fresh run starts the file anew at its first write
        writer.write(1, {"loss": 2.0})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
    writer = flog.JSONLWriter(tmp_path)  # fit() tells a writer where a resumed run restarts
    writer.resume_from(1)
    writer.write(2, {"loss": 1.5})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    with pytest.raises(RuntimeError, match="already"):
        writer.resume_from(1)


def test_csv_new_columns_rewrite_header_and_resume(tmp_path) -> None:
    with flog.CSVWriter(tmp_path) as writer:
        writer.write(1, {"loss": 0.5})
        writer.write(2, {"loss": 0.25, "eval/accuracy": 0.9})
        writer.write(3, {"loss": 0.125})
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "loss", "eval/accuracy"]
    assert [(r["step"], r["loss"], r["eval/accuracy"]) for r in rows] == [
        ("1", "0.5", ""),
        ("2", "0.25", "0.9"),
        ("3", "0.125", ""),
    ]
    with flog.CSVWriter(tmp_path, resume_step=2) as writer:
        writer.write(3, {"loss": 0.2})
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["loss"]) for r in rows] == [("1", "0.5"), ("2", "0.25"), ("3", "0.2")]


def test_tensorboard_events_read_back_by_tensorboard(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with flog.TensorBoardWriter(tmp_path) as writer:
        for step in range(1, 4):
            writer.write(step, {"train/loss": 1.0 / step})
        writer.write(3, {"eval/accuracy": 0.75})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "eval/accuracy"}
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert events.Scalars("eval/accuracy")[0].value == pytest.approx(0.75)


def test_tensorboard_resume_purges_later_steps(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with flog.TensorBoardWriter(tmp_path) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": float(step)})
    with flog.TensorBoardWriter(tmp_path, resume_step=2) as writer:
        writer.write(3, {"loss": 30.0})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_plot_run_writes_png_and_cli(tmp_path, capsys) -> None:
    with flog.JSONLWriter(tmp_path) as writer:
        for step in range(1, 6):
            writer.write(step, {"train/loss": 1.0 / step, "eval/loss": 1.2 / step, "eval/accuracy": step / 5})
    png = flog.plot_run(tmp_path, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    with pytest.raises(ValueError, match=r"no scalars named \['eval/acc'\].*eval/accuracy"):
        flog.plot_run(tmp_path, tmp_path / "x.png", names=["eval/acc"])

    parser = argparse.ArgumentParser(prog="functrain")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", str(tmp_path), "--names", "train/loss"])
    assert args.func(args) == 0
    assert (tmp_path / "metrics.png").stat().st_size > 0
    assert main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_plot_takes_the_run_directory_and_leaves_eta_and_the_backend_alone(tmp_path, capsys) -> None:
    import matplotlib

    run = tmp_path / "runs" / "x"
    with flog.JSONLWriter(run / "logs") as writer:
        for step in range(1, 4):
            writer.write(step, {"time/eta_s": 900.0 / step})
        writer.write(4, {"train/loss": 0.5})
    assert flog.find_metrics(run) == run / "logs" / "metrics.jsonl"
    assert main([str(run)]) == 0  # what the help says: the run directory
    assert (run / "metrics.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no scalars named"):
        flog.plot_run(run, tmp_path / "eta.png", names=["train/loss", "time/eta"])
    assert flog.plot_run(run, tmp_path / "eta.png", names=["time/eta_s"]).exists()  # when asked for

    backend = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # e.g. a notebook's inline backend: plotting must not switch it to Agg
        flog.plot_run(run, tmp_path / "again.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    capsys.readouterr()


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch) -> None:
    with flog.JSONLWriter(tmp_path) as writer:
        writer.write(1, {"train/loss": 1.0})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(
        ImportError, match=r'plot_run needs the matplotlib package: pip install "functrain\[plot\]"'
    ):
        flog.plot_run(tmp_path, tmp_path / "x.png")


def test_plot_skips_eta_by_default(tmp_path) -> None:
    with flog.JSONLWriter(tmp_path) as writer:
        writer.write(1, {"time/eta_s": 500.0})
    with pytest.raises(ValueError, match="holds no scalars to plot"):
        flog.plot_run(tmp_path, tmp_path / "x.png")
