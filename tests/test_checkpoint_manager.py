"""CheckpointManager: retention, latest/best, atomic writes, async saves, writers, crash safety."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from functrain.checkpoint import CheckpointError, CheckpointManager


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


def test_leftover_temporary_files_are_removed_and_never_latest(tmp_path):
    manager = CheckpointManager(tmp_path, fsync=False)
    manager.save(1, {"w": torch.ones(2)})
    leftover = tmp_path / (os.path.basename(manager.path(2)) + ".tmp-abc123")
    leftover.write_bytes(b"partial")
    assert manager.latest() == 1
    CheckpointManager(tmp_path)
    assert not leftover.exists() and (tmp_path / os.path.basename(manager.path(1))).exists()


def test_unreadable_checkpoint_is_not_latest(tmp_path):
    manager = CheckpointManager(tmp_path, fsync=False)
    manager.save(1, {"w": torch.ones(2)})
    with open(manager.path(2), "wb") as f:
        f.write(b"garbage")
    with pytest.warns(UserWarning, match="ignoring unreadable checkpoint"):
        assert manager.latest() == 1


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
        for _kill in range(20):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            child = int(_read_until(zygote.stdout, "child", errors)[1])
            _read_until(zygote.stdout, "step", errors)  # at least one checkpoint of this round is complete
            time.sleep(rng.uniform(0.0, 0.8))
            os.kill(child, signal.SIGKILL)
            _read_until(zygote.stdout, "reaped", errors)
            killed_mid_save += any(".tmp-" in name for name in os.listdir(folder))
            manager = CheckpointManager(folder)
            latest = manager.latest()
            assert latest is not None and latest > last
            restored = manager.restore("latest")
            assert restored["step"] == latest and restored["big"].shape == (50 << 20,)
            assert bool((restored["big"] == float(latest)).all())
            assert not [name for name in os.listdir(folder) if ".tmp-" in name]
            last = latest
        assert killed_mid_save >= 3, "too few kills landed while a checkpoint was being written"
    finally:
        zygote.kill()
        zygote.wait()
