"""The loop and the Trainer under faults (issue 22): no zero-step "finished" runs, nothing written into
an output_dir by a refused run, data errors that say where, non-finite steps skipped or stopped, a full
disk that names the file."""

from __future__ import annotations

import errno
import hashlib
import warnings
from pathlib import Path

import pytest
import torch
from trainer_fixtures import SmallNet, make_dataset, quiet_config

import functrain as ft
from functrain.callbacks import NonFiniteLossError


def linear_run(n: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
    data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(n)]
    return state, step, data


def folder_snapshot(folder: Path) -> dict[str, str]:
    """Every file's and folder's relative path -> the file's sha256 (``"dir"`` for a folder)."""
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


# ---------------------------------------------------------------- 1. zero batches per epoch is an error


@pytest.mark.parametrize(("n", "drop_last"), [(0, False), (5, True)])
def test_fit_refuses_an_epoch_without_batches_before_any_step(n: int, drop_last: bool):
    state, step, data = linear_run(n)
    calls = []

    def counting_step(s, batch):
        calls.append(1)
        return step(s, batch)

    loader = ft.data.Loader(data, 8, shuffle=False, drop_last=drop_last)
    with pytest.raises(ValueError, match="no batch") as err:
        ft.fit(state, counting_step, loader, epochs=2, progress_bar=False)
    message = str(err.value)
    assert f"{n} examples" in message and "batch_size=8" in message and f"drop_last={drop_last}" in message
    assert calls == []


def test_trainer_refuses_an_epoch_without_batches_before_writing(tmp_path: Path):
    config = quiet_config(tmp_path, epochs=1, drop_last=True, eval_strategy="no")
    trainer = ft.Trainer(SmallNet(), config, make_dataset(10))  # 10 < batch_size 16
    with pytest.raises(ValueError, match=r"10 examples, batch_size=16, drop_last=True"):
        trainer.train()
    assert not (tmp_path / "run").exists()
    assert int(trainer.state.step) == 0


# ---------------------------------------------------------------- 2. a refused run writes nothing


def test_refused_resume_leaves_the_other_run_byte_identical(tmp_path: Path):
    fields = dict(epochs=1, eval_strategy="no", tensorboard=True, csv=True)
    ft.Trainer(SmallNet(), quiet_config(tmp_path, **fields), make_dataset(32)).train()
    run = tmp_path / "run"
    before = folder_snapshot(run)
    assert "config.yaml" in before and any(k.startswith("checkpoints/") for k in before)

    other = quiet_config(tmp_path, **fields, resume_from_checkpoint=True, seed=7, batch_size=8)
    trainer = ft.Trainer(SmallNet(d_in=6, classes=5), other, make_dataset(32))  # another model
    with pytest.raises(ValueError, match="does not match"):
        trainer.train()
    assert folder_snapshot(run) == before


def test_refused_run_creates_no_log_folder(tmp_path: Path):
    # A run directory holding a checkpoint only: the refused resume must not add logs/ or config.yaml.
    ft.Trainer(
        SmallNet(), quiet_config(tmp_path, epochs=1, eval_strategy="no", jsonl=False), make_dataset(32)
    ).train()
    run = tmp_path / "run"
    (run / "config.yaml").unlink()
    before = folder_snapshot(run)
    cfg = quiet_config(tmp_path, epochs=1, eval_strategy="no", resume_from_checkpoint=True, csv=True)
    with pytest.raises(ValueError, match="does not match"):
        ft.Trainer(SmallNet(classes=4), cfg, make_dataset(32)).train()
    assert folder_snapshot(run) == before


# ---------------------------------------------------------------- 5. data errors say where


class BrokenAt(torch.utils.data.Dataset):
    """Raises OSError at ``index`` from its ``fail_from``-th read of that index on."""

    def __init__(self, n: int, index: int, fail_from: int = 1) -> None:
        self.data = make_dataset(n)
        self.index, self.fail_from, self.reads = index, fail_from, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i == self.index:
            self.reads += 1
            if self.reads >= self.fail_from:
                raise OSError(errno.EIO, "Input/output error", f"/data/shard_{i}.bin")
        return self.data[i]


def notes_of(err: BaseException) -> str:
    return "\n".join(getattr(err, "__notes__", []))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_data_error_names_the_example_epoch_and_step(prefetch: int):
    state, step, _ = linear_run()
    model = torch.nn.Linear(6, 3)
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
    data = BrokenAt(64, index=57, fail_from=2)  # epoch 1, not epoch 0
    loader = ft.data.Loader(data, 8, shuffle=False, prefetch=prefetch)
    with pytest.raises(OSError) as err:
        ft.fit(state, step, loader, epochs=3, progress_bar=False)
    assert type(err.value) is OSError and err.value.filename == "/data/shard_57.bin"  # the original error
    notes = notes_of(err.value)
    # 64 examples, batch 8: index 57 is in batch 7 of each epoch; epoch 1's batch 7 feeds step 8 + 8 = 16
    assert "example index 57" in notes
    assert "batch 7 of epoch 1" in notes and "56, 57" in notes
    assert "training step 16" in notes


def test_a_data_error_in_a_worker_process_names_the_example_epoch_and_step(tmp_path: Path):
    config = quiet_config(tmp_path, epochs=1, eval_strategy="no", num_workers=1, shuffle=False)
    trainer = ft.Trainer(SmallNet(), config, BrokenAt(64, index=41))
    with pytest.raises(OSError) as err:
        trainer.train()
    text = str(err.value) + notes_of(err.value)
    # torch re-raises a worker's error as the same type with the worker's traceback (and our note) as text
    assert "example index 41" in text and "batch 2 of epoch 0" in text and "training step 3" in text


# ---------------------------------------------------------------- 6. non-finite steps


def nan_dataset(n: int = 64, bad: tuple[int, ...] = (5,)) -> torch.utils.data.TensorDataset:
    x, y = make_dataset(n).tensors
    x = x.clone()
    x[list(bad)] = float("nan")
    return torch.utils.data.TensorDataset(x, y)


def all_finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors.values())


def test_skip_nonfinite_leaves_the_state_as_it_was():
    from functrain.callbacks.nonfinite import skip_nonfinite

    torch.manual_seed(0)
    model = SmallNet()  # BatchNorm: a NaN batch would poison its running statistics
    state = ft.TrainState.create(model, ft.optim.adamw(1e-2))
    step = skip_nonfinite(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)))
    x, y = make_dataset(16).tensors
    good, metrics = step(state, (x, y))
    assert float(metrics["skipped"]) == 0.0 and not torch.equal(
        good.params["head.weight"], state.params["head.weight"]
    )
    x_bad = x.clone()
    x_bad[3] = float("nan")
    new, metrics = step(good, (x_bad, y))
    assert float(metrics["skipped"]) == 1.0 and not torch.isfinite(metrics["loss"])
    assert int(new.step) == 2
    for name in ("params", "buffers"):
        for k, v in getattr(good, name).items():
            assert torch.equal(getattr(new, name)[k], v), f"{name}.{k} changed by a skipped step"
    for a, b in zip(ft.tree.leaves(new.opt_state), ft.tree.leaves(good.opt_state)):
        assert torch.equal(a, b)


def test_trainer_skips_nonfinite_steps_by_default_and_counts_them(tmp_path: Path):
    torch.manual_seed(0)
    config = quiet_config(tmp_path, epochs=2, eval_strategy="no", log_steps=1)
    assert config.nonfinite == "skip" and config.resolved_max_consecutive_nonfinite == 10
    trainer = ft.Trainer(SmallNet(), config, nan_dataset())
    with pytest.warns(RuntimeWarning, match="skipped 1 training step"):
        result = trainer.train()
    assert all_finite(result.state.params) and all_finite(result.state.buffers)
    skipped = result.history.series("train/skipped_steps")
    assert skipped[-1][1] == 2  # the NaN example's batch, once per epoch
    assert sum(v for _, v in result.history.series("train/skipped")) == 2


def test_trainer_nonfinite_stop_raises_at_the_bad_step(tmp_path: Path):
    torch.manual_seed(0)
    config = quiet_config(tmp_path, epochs=2, eval_strategy="no", shuffle=False, nonfinite="stop")
    with pytest.raises(NonFiniteLossError, match=r"step 2\b"):  # index 20 is in batch 1 of epoch 0
        ft.Trainer(SmallNet(), config, nan_dataset(bad=(20,))).train()


def test_trainer_stops_after_max_consecutive_skips(tmp_path: Path):
    torch.manual_seed(0)
    config = quiet_config(tmp_path, epochs=3, eval_strategy="no", max_consecutive_nonfinite=3, log_steps=2)
    trainer = ft.Trainer(SmallNet(), config, nan_dataset(bad=tuple(range(64))))  # every step is NaN
    with pytest.raises(NonFiniteLossError, match="4 training steps in a row") as err:
        trainer.train()
    assert "max_consecutive_nonfinite" in str(err.value)


def test_trainer_nonfinite_ignore_applies_the_update(tmp_path: Path):
    torch.manual_seed(0)
    config = quiet_config(tmp_path, epochs=1, eval_strategy="no", nonfinite="ignore")
    result = ft.Trainer(SmallNet(), config, nan_dataset()).train()
    assert not all_finite(result.state.params)  # what nonfinite=skip (the default) prevents


def test_max_consecutive_nonfinite_needs_skip():
    with pytest.raises(ft.ConfigError, match="max_consecutive_nonfinite"):
        ft.TrainerConfig(epochs=1, nonfinite="stop", max_consecutive_nonfinite=3)


# ---------------------------------------------------------------- 7. a full disk names the file


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # TensorBoard's thread
def test_tensorboard_full_disk_names_the_event_file(tmp_path: Path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    writer = ft.logging.TensorBoardWriter(tmp_path / "tb")
    writer.write(1, {"loss": 1.0})
    writer.flush()
    event_file = writer.event_file
    assert Path(event_file).parent == tmp_path / "tb"

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    with pytest.raises(OSError) as err:  # raised in TensorBoard's writer thread, surfacing at a later call
        writer.write(2, {"loss": 0.5})
        writer.flush()
    assert err.value.errno == errno.ENOSPC and err.value.filename == event_file
    assert event_file in str(err.value)
    with warnings.catch_warnings(), pytest.raises(OSError, match="No space left"):
        writer.close()


def test_jsonl_write_error_names_the_file(tmp_path: Path, monkeypatch):
    writer = ft.logging.JSONLWriter(tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # nothing before the first write
    writer.write(1, {"loss": 1.0})

    class FullFile:
        closed = False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def fileno(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.closed = True

    writer._file.close()
    monkeypatch.setattr(writer, "_file", FullFile())
    with pytest.raises(OSError, match=r"metrics\.jsonl"):
        writer.write(2, {"loss": 0.5})


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_trainer_skips_a_nan_step_in_its_one_graph(tmp_path: Path):
    torch.manual_seed(0)
    # drop_last: every batch has the compiled shape (a short last batch would compile a second graph)
    config = quiet_config(tmp_path, epochs=2, eval_strategy="no", compile=True, drop_last=True)
    trainer = ft.Trainer(SmallNet(), config, nan_dataset(bad=(5,)))
    with pytest.warns(RuntimeWarning, match="skipped"):
        result = trainer.train()
    assert trainer._jit("train").num_compiles == 1  # the skip is in the graph
    assert result.history.series("train/skipped_steps")[-1][1] == 2
    assert all_finite(result.state.params) and all_finite(result.state.buffers)
