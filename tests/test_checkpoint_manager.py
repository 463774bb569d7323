"""CheckpointManager: retention, latest/best, atomic writes, async saves, writers, crash safety."""

from __future__ import annotations

import builtins
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from functrain.checkpoint import CheckpointError, CheckpointManager
from functrain.core import atomic


def _save_steps(manager, losses):
    for step, loss in losses.items():
        manager.save(step, {"w": torch.full((3,), float(step))}, metrics={"loss": loss})


def test_keep_last_n_every_k_and_best_independently(tmp_path):
    manager = CheckpointManager(
        tmp_path, max_to_keep=2, keep_every=4, best_metric="loss", keep_best=2, fsync=False
    )
    _save_steps(manager, {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.8, 5: 0.7, 6: 0.6, 7: 0.95})
    assert manager.all_steps() == [1, 3, 4, 6, 7]  # best two (1, 3), every 4th (4), last two (6, 7)
    assert manager.latest() == 7 and manager.best() == 1
    assert manager.best(mode="max") == 7
    assert manager.metrics(3) == {"loss": 0.2}
    assert torch.equal(manager.restore("best")["w"], torch.full((3,), 1.0))
    assert torch.equal(manager.restore(4)["w"], torch.full((3,), 4.0))


def test_best_rule_never_deletes_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=1, best_metric="acc", best_mode="max", fsync=False)
    _save_steps(manager, {})
    for step, acc in [(1, 0.9), (2, 0.5), (3, 0.4)]:
        manager.save(step, {"w": torch.ones(1)}, metrics={"acc": acc})
    assert manager.all_steps() == [1, 3]
    manager.save(4, {"w": torch.ones(1)})  # no metric at all
    assert manager.all_steps() == [1, 4] and manager.latest() == 4


def _both_managers(tmp_path, **retention):
    from functrain import distributed
    from functrain.checkpoint.sharded import ShardedCheckpointManager

    return [
        CheckpointManager(tmp_path / "plain", fsync=False, **retention),
        ShardedCheckpointManager(tmp_path / "sharded", distributed.fully_shard(), fsync=False, **retention),
    ]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_nan_is_never_best_nor_kept_as_best_by_either_manager(tmp_path, mode):
    for manager in _both_managers(tmp_path, max_to_keep=1, best_metric="loss", best_mode=mode):
        _save_steps(manager, {1: float("nan"), 2: 0.5, 3: float("nan"), 4: 0.7, 5: float("nan")})
        best = 2 if mode == "min" else 4
        assert manager.best() == best, type(manager).__name__
        assert manager.all_steps() == [best, 5], type(manager).__name__  # the newest, and the best number
        assert torch.equal(manager.restore("best")["w"], torch.full((3,), float(best)))


def test_best_of_another_metric_leaves_the_managers_own_unchanged(tmp_path):
    for manager in _both_managers(tmp_path, best_metric="loss"):
        for step, loss, acc in [(1, 0.2, 0.5), (2, 0.4, 0.9), (3, 0.3, 0.7)]:
            manager.save(step, {"w": torch.ones(1)}, metrics={"loss": loss, "acc": acc})
        assert manager.best(metric="acc", mode="max") == 2, type(manager).__name__
        assert (manager.best_metric, manager.best_mode) == ("loss", "min")
        assert manager.best() == 1 and manager.restore("best") is not None
        _save_steps(manager, {4: 0.9})  # retention still keeps the best by the manager's own metric
        assert 1 in manager.all_steps(), type(manager).__name__


def test_an_unreadable_header_is_skipped_by_latest_best_and_retention_of_either_manager(tmp_path):
    for manager in _both_managers(tmp_path, max_to_keep=1, best_metric="loss"):
        _save_steps(manager, {1: 0.1, 2: 0.5})
        with open(manager.path(2), "wb") as f:  # the step's file (plain) or its manifest (sharded)
            f.write(b"garbage")
        with pytest.warns(UserWarning, match="ignoring unreadable checkpoint"):
            assert manager.latest() == 1 and manager.best() == 1, type(manager).__name__
        _save_steps(manager, {3: 0.9})  # retention ranks the readable steps
        assert manager.all_steps() == [1, 3] and manager.latest() == 3 and manager.best() == 1


def test_metadata_and_header_without_loading(tmp_path):
    manager = CheckpointManager(tmp_path, fsync=False)
    manager.save(torch.tensor(5), {"w": torch.ones(2)}, metadata={"tied_parameters": {"b": "a"}})
    header = manager.header(5)
    assert header.step == 5 and header.metadata == {"tied_parameters": {"b": "a"}}
    with pytest.raises(CheckpointError, match="no checkpoint of step 6"):
        manager.restore(6)
    with pytest.raises(CheckpointError, match="step=-1"):
        manager.save(-1, {})


def test_empty_folder_has_no_latest(tmp_path):
    manager = CheckpointManager(tmp_path / "new")
    assert manager.latest() is None and manager.all_steps() == []
    with pytest.raises(CheckpointError, match="no checkpoint to restore as 'latest'"):
        manager.restore("latest")


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _leftover(manager, step: int, owner: str, *, age: float = 0.0):
    """A temporary file of ``step`` as a writer described by ``owner`` (host-boot-pid) left it."""
    path = manager.path(step) + f".tmp-{owner}-0123abcd"
    with open(path, "wb") as f:
        f.write(b"partial")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_leftover_temporary_files_are_never_latest_and_survive_readers(tmp_path):
    manager = CheckpointManager(tmp_path, fsync=False)
    manager.save(1, {"w": torch.ones(2)})
    leftover = _leftover(manager, 2, f"{atomic._host()}-{atomic._boot()}-{_dead_pid()}")
    assert manager.latest() == 1
    reader = CheckpointManager(tmp_path)
    assert reader.latest() == 1 and torch.equal(reader.restore("latest")["w"], torch.ones(2))
    assert os.path.exists(leftover), "a reader removed a file"
    CheckpointManager(tmp_path, fsync=False).save(3, {"w": torch.ones(2)})  # a writer's first save
    assert not os.path.exists(leftover) and os.path.exists(manager.path(1))


def test_a_writer_removes_only_provably_abandoned_temporary_files(tmp_path):
    manager = CheckpointManager(tmp_path, fsync=False, max_to_keep=None)
    here, boot = atomic._host(), atomic._boot()
    old = atomic.ABANDONED_AFTER_SECONDS + 60
    other_host = "0" * 8 if here != "0" * 8 else "1" * 8
    removed = [
        _leftover(manager, 1, f"{here}-{boot}-{_dead_pid()}"),  # this host, its writer has exited
        _leftover(
            manager, 2, f"{other_host}-{boot}-{os.getpid()}", age=old
        ),  # another host, untouched for long
        _leftover(manager, 3, "abc123", age=old),  # a name without a writer, untouched for long
    ]
    if boot != "0" * 8:
        earlier_boot = "f" * 8 if boot != "f" * 8 else "e" * 8
        removed.append(_leftover(manager, 4, f"{here}-{earlier_boot}-{os.getpid()}"))  # before a reboot
    kept = [
        _leftover(manager, 5, f"{here}-{boot}-{os.getppid()}"),  # its writer is alive: a save in progress
        _leftover(
            manager, 6, f"{other_host}-{boot}-{_dead_pid()}"
        ),  # another host: its pids mean nothing here
        _leftover(manager, 7, "abc123"),  # no writer named, written recently
    ]
    foreign = tmp_path / "notes.txt.tmp-abc123"  # not a checkpoint's temporary file: never touched
    foreign.write_bytes(b"x")
    os.utime(foreign, (time.time() - old, time.time() - old))
    manager.save(10, {"w": torch.ones(2)})
    assert [p for p in removed if os.path.exists(p)] == []
    assert [p for p in kept if not os.path.exists(p)] == [] and foreign.exists()
    assert manager.all_steps() == [10]


def test_a_leftover_that_cannot_be_removed_does_not_stop_a_save(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, fsync=False)
    leftover = _leftover(manager, 1, f"{atomic._host()}-{atomic._boot()}-{_dead_pid()}")

    def refuse(path, *args, **kwargs):
        if ".tmp-" in os.fspath(path) and "0123abcd" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_remove(path, *args, **kwargs)

    real_remove = os.remove
    monkeypatch.setattr(os, "remove", refuse)
    manager.save(2, {"w": torch.ones(2)})
    assert manager.latest() == 2 and os.path.exists(leftover)


class _Modified(AssertionError):
    pass


def _forbid_modifications(monkeypatch) -> None:
    """Make every call that creates, removes or renames a file, or opens one for writing, fail loudly
    (a read-only folder that even root cannot write to)."""

    def refuse(name):
        def call(*args, **kwargs):
            raise _Modified(f"a reader called {name}{args}")

        return call

    for name in (
        "remove",
        "unlink",
        "rmdir",
        "removedirs",
        "rename",
        "renames",
        "replace",
        "mkdir",
        "makedirs",
    ):
        monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    monkeypatch.setattr(shutil, "rmtree", refuse("shutil.rmtree"))
    monkeypatch.setattr(pathlib.Path, "unlink", refuse("Path.unlink"))
    real_open = builtins.open

    def read_only_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            raise _Modified(f"a reader opened {file!r} with mode {mode!r}")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_open)


def test_reading_a_read_only_folder_with_a_stale_temporary_file(tmp_path, monkeypatch):
    """Opening, latest(), best(), restore() and `functrain eval`'s checkpoint lookup never modify the folder."""
    from functrain.cli.main import _latest_checkpoint

    folder = tmp_path / "run"
    writer = CheckpointManager(folder, fsync=False, best_metric="loss")
    _save_steps(writer, {1: 0.5, 2: 0.7})
    stale = _leftover(writer, 3, f"{atomic._host()}-{atomic._boot()}-{_dead_pid()}", age=10 * 86400)
    before = sorted(os.listdir(folder))
    folder.chmod(0o555)  # read-only for everyone but root (the tests may run as root: hence the patches)
    try:
        _forbid_modifications(monkeypatch)
        manager = CheckpointManager(folder, best_metric="loss")
        assert manager.all_steps() == [1, 2] and manager.latest() == 2 and manager.best() == 1
        assert torch.equal(manager.restore("latest")["w"], torch.full((3,), 2.0))
        assert torch.equal(manager.restore("best")["w"], torch.full((3,), 1.0))
        assert manager.metrics(1) == {"loss": 0.5} and manager.header(2).step == 2
        manager.close()
        for best_at_end, expected in ((False, 2), (True, 1)):  # the best by loss (min) is step 1
            trainer = types.SimpleNamespace(
                config=types.SimpleNamespace(load_best_model_at_end=best_at_end),
                checkpoint_manager=lambda: CheckpointManager(folder, best_metric="loss"),
            )
            assert _latest_checkpoint(trainer) == manager.path(expected)
        assert CheckpointManager(tmp_path / "missing").latest() is None
        monkeypatch.undo()
    finally:
        folder.chmod(0o755)
    assert sorted(os.listdir(folder)) == before and os.path.exists(stale)
    assert not (tmp_path / "missing").exists()


def test_unreadable_checkpoint_is_not_latest(tmp_path):
    manager = CheckpointManager(tmp_path, fsync=False)
    manager.save(1, {"w": torch.ones(2)})
    with open(manager.path(2), "wb") as f:
        f.write(b"garbage")
    with pytest.warns(UserWarning, match="ignoring unreadable checkpoint"):
        assert manager.latest() == 1


def test_an_unreadable_checkpoint_is_warned_about_once_per_process(tmp_path):
    import warnings

    manager = CheckpointManager(tmp_path, fsync=False, best_metric="loss")
    manager.save(1, {"w": torch.ones(2)}, metrics={"loss": 0.5})
    with open(manager.path(2), "wb") as f:
        f.write(b"garbage")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # Python's own once-per-place filter off: ours alone decides
        another = CheckpointManager(tmp_path, fsync=False, best_metric="loss")  # the CLI opens several
        assert manager.latest() == 1 and manager.best() == 1 and another.latest() == 1
        warned = [str(w.message) for w in seen if "unreadable" in str(w.message)]
        assert len(warned) == 1 and manager.path(2) in warned[0]
        with open(manager.path(2), "wb") as f:  # another bad version of the file: news again
            f.write(b"other garbage")
        assert manager.latest() == 1
    assert sum("unreadable" in str(w.message) for w in seen) == 2


def test_header_of_an_unreadable_checkpoint_raises_its_error_once_without_a_warning(tmp_path):
    import warnings

    manager = CheckpointManager(tmp_path, fsync=False)
    with open(manager.path(2), "wb") as f:
        f.write(b"garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a query that raises does not also warn
        for _ in range(2):  # the second answer comes from the cache
            with pytest.raises(CheckpointError, match=r"step_0000000002\.ckpt"):
                manager.header(2)


def test_non_writer_writes_nothing(tmp_path):
    calls = []
    manager = CheckpointManager(tmp_path / "x", is_writer=lambda: calls.append(1) or False)
    manager.save(1, {"w": torch.ones(2)})
    assert calls and not (tmp_path / "x").exists()


def test_async_save_snapshots_state_and_surfaces_failures(tmp_path):
    with CheckpointManager(tmp_path, async_save=True, fsync=False) as manager:
        state = {"w": torch.zeros(1000)}
        manager.save(1, state)
        state["w"].fill_(7.0)  # a donating step overwrites the tensor right after save returns
        manager.wait_until_finished()
        assert torch.equal(manager.restore(1)["w"], torch.zeros(1000))
        manager.save(2, {"w": torch.ones(2)}, metrics={"loss": object()})
        with pytest.raises(CheckpointError, match="metrics"):
            manager.save(3, {"w": torch.ones(2)})
        manager.save(3, {"w": torch.ones(2)})
    assert manager.all_steps() == [1, 3]
    with pytest.raises(CheckpointError, match="closed"):
        manager.save(4, {})


# Importing torch and functrain takes seconds on a busy machine, so one "zygote" process imports once and
# forks a fresh writer for every kill. The writer saves ~200 MB in a loop (real fsyncs) and reports steps.
_ZYGOTE = textwrap.dedent(
    """
    import os, sys, torch
    from functrain.checkpoint import CheckpointManager
    folder = sys.argv[1]
    for command in sys.stdin:
        pid = os.fork()
        if pid == 0:
            manager = CheckpointManager(folder, max_to_keep=2, chunk_bytes=8 << 20)
            start = (manager.latest() or 0) + 1
            state = {"big": torch.empty(50 << 20, dtype=torch.float32), "step": 0}
            for step in range(start, start + 10_000):
                state["big"].fill_(float(step))
                state["step"] = step
                manager.save(step, state, metrics={"step": step})
                print("step", step, flush=True)
            os._exit(0)
        print("child", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("reaped", pid, status, flush=True)
    """
)


def _read_until(stream, word: str, errors) -> list[str]:
    """The zygote's next line starting with ``word``. A child that ends before saving once (the
    zygote reports it reaped while ``step`` is awaited) fails the test with the child's stderr,
    instead of leaving both processes waiting on each other."""
    while True:
        line = stream.readline().split()
        assert line, f"the zygote process ended while waiting for {word!r}; stderr:\n{errors.read_text()}"
        assert not (line[0] == "reaped" and word == "step"), (
            f"a child ended before saving once ({line}); stderr:\n{errors.read_text()}"
        )
        if line[0] == word:
            return line


@pytest.mark.slow
def test_latest_survives_sigkill_at_random_moments(tmp_path):
    """~200 MB saved in a loop, SIGKILLed 20 times: the latest checkpoint always restores completely."""
    rng = random.Random(0)
    folder = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    errors = tmp_path / "zygote-stderr.txt"
    with errors.open("w") as stderr:
        zygote = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, folder],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
        )
    try:
        last = killed_mid_save = 0
        previous = None
        for _kill in range(20):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            child = int(_read_until(zygote.stdout, "child", errors)[1])
            _read_until(zygote.stdout, "step", errors)  # at least one checkpoint of this round is complete
            # The new writer's first save removed what the killed one left; nothing else is temporary.
            left = [name for name in os.listdir(folder) if ".tmp-" in name]
            assert not [name for name in left if f"-{previous}-" in name], left
            time.sleep(rng.uniform(0.0, 0.8))
            os.kill(child, signal.SIGKILL)
            _read_until(zygote.stdout, "reaped", errors)
            left = [name for name in os.listdir(folder) if ".tmp-" in name]
            killed_mid_save += bool(left)
            manager = CheckpointManager(folder)
            latest = manager.latest()
            assert latest is not None and latest > last
            restored = manager.restore("latest")
            assert restored["step"] == latest and restored["big"].shape == (50 << 20,)
            assert bool((restored["big"] == float(latest)).all())
            assert [name for name in os.listdir(folder) if ".tmp-" in name] == left  # readers delete nothing
            last, previous = latest, child
        assert killed_mid_save >= 3, "too few kills landed while a checkpoint was being written"
    finally:
        zygote.kill()
        zygote.wait()


# A reader that opens the folder as `functrain eval` does, as fast as it can, until told to stop.
_READER = textwrap.dedent(
    """
    import os, sys, torch
    from functrain.checkpoint import CheckpointManager
    folder, stop = sys.argv[1], sys.argv[2]
    opened = restored = 0
    print("ready", flush=True)
    while not os.path.exists(stop):
        manager = CheckpointManager(folder)
        opened += 1
        if opened % 10 == 0 and (step := manager.latest()) is not None:
            state = manager.restore(step)
            assert bool((state["w"] == float(step)).all()), step
            restored += 1
    print("opened", opened, "restored", restored, flush=True)
    """
)


def test_readers_never_break_a_running_writer(tmp_path):
    """A process opening the manager in a loop while this one saves 20 times: every save lands."""
    folder, stop = tmp_path / "run", tmp_path / "stop"
    folder.mkdir()
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(folder), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        text=True,
    )
    try:
        assert reader.stdout.readline().split() == ["ready"], reader.stderr.read()
        manager = CheckpointManager(folder, max_to_keep=None)  # fsync: each save's temp file lives longer
        for step in range(1, 21):
            manager.save(step, {"w": torch.full((1 << 20,), float(step))})
    finally:
        stop.touch()
        out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    assert manager.all_steps() == list(range(1, 21))
    opened = int(out.split()[1])
    assert opened >= 20, out
