"""The `functrain` command under user errors and preemption, run as a user runs it (a subprocess).

Every refusal is one line on stderr, ``functrain COMMAND: ...``, status 2, no traceback (``--debug`` or
``FUNCTRAIN_DEBUG=1`` asks for one); the cheap ones answer before torch is imported (checked with
``python -X importtime``). A run stopped by SIGTERM/SIGINT exits 143/130 with its checkpoint saved, and
resumes. Eager runs only (no compile).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_MYTASK = """
import time
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


def train_set(n=32):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return list(zip(x, (x[:, 0] > 0).long()))


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        time.sleep(0.03)
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, (x[0] > 0).long()


class Indexing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x["x"])


def tuple_inputs(n=32):
    return [((x,), y) for x, y in train_set(n)]


def broken():
    raise RuntimeError("my dataset is broken")


def configured():
    from functrain import TrainerConfig

    return TrainerConfig(epochs=0)


def not_a_model():
    return 3


class Unreadable(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        if i == 17:
            raise OSError("cannot read image 17")
        return torch.zeros(4), torch.tensor(0)
"""

_RUN = """\
output_dir: {out}
model: mytask:Net
train_dataset: mytask:train_set
eval_strategy: "no"
epochs: 1
batch_size: 8
compile: false
device: cpu
progress_bar: false
print_summary: false
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "mytask.py").write_text(_MYTASK)
    (tmp_path / "run.yaml").write_text(_RUN.format(out=tmp_path / "out"))
    return tmp_path


def functrain(project: Path, *argv: str, importtime: bool = False, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "functrain", *argv]
    environ = {k: v for k, v in os.environ.items() if k != "FUNCTRAIN_DEBUG"}
    environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return subprocess.run(command, cwd=project, capture_output=True, text=True, env=environ, timeout=300)


def _imported_torch(stderr: str) -> bool:
    return any(re.search(r"\|\s*torch$", line) for line in stderr.splitlines())


def assert_one_line_refusal(out: subprocess.CompletedProcess, command: str, *needles: str) -> str:
    """Status 2 and exactly one line (``-X importtime`` lines aside), naming the command, no traceback."""
    lines = [ln for ln in out.stderr.splitlines() if not ln.startswith("import time:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"functrain {command}: "), lines
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "command", "needles"),
    [
        (["train", "missing.yaml"], "train", ["missing.yaml: no such file"]),
        (["summary", "bad.yaml"], "summary", ["invalid YAML"]),
        (
            ["predict", "run.yaml", "--output", "p.ckpt"],
            "predict",
            ["test_dataset", "pass test_dataset=mytask:test_set on the command line", "add 'test_dataset:"],
        ),
        (["eval", "run.yaml", "--checkpoint", "nope.ckpt"], "eval", ["nope.ckpt: no such file"]),
        (
            ["eval", "run.yaml", "eval_strategy=epoch"],
            "eval",
            ["eval_dataset=mytask:eval_set", "no checkpoint"],
        ),
        (
            ["train", "run.yaml", "epochs=zero", "optimizer.lrr=1"],
            "train",
            ["epochs", "optimizer.lrr", "did you mean 'optimizer.lr'"],
        ),
        (["train", "run.yaml", "resume_from_checkpoint=gone.ckpt"], "train", ["gone.ckpt"]),
    ],
)
def test_refusals_are_one_line_before_torch_is_imported(project: Path, argv, command, needles):
    (project / "bad.yaml").write_text("epochs: [1,\nmodel: x\n")
    out = functrain(project, *argv, importtime=True)
    assert_one_line_refusal(out, command, *needles)
    assert not _imported_torch(out.stderr), "refused only after importing torch"


def test_a_run_in_output_dir_is_left_as_it_was_and_the_rerun_writes_a_new_version(project: Path):
    (project / "out").mkdir()
    (project / "out" / "config.yaml").write_text("another run\n")
    out = functrain(project, "train", "run.yaml")  # before: refused, "already holds a run"
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"this run writes '{project / 'out-1'}'" in out.stderr
    assert os.listdir(project / "out") == ["config.yaml"]
    assert (project / "out" / "config.yaml").read_text() == "another run\n"
    assert sorted(os.listdir(project / "out-1")) == ["checkpoints", "config.yaml", "launch.json", "logs"]


def test_an_exception_in_the_users_code_names_their_file_and_line(project: Path):
    out = functrain(project, "train", "run.yaml", "train_dataset=mytask:broken")
    line = assert_one_line_refusal(out, "train", "RuntimeError: my dataset is broken", "--debug")
    raise_line = next(i for i, ln in enumerate(_MYTASK.splitlines(), 1) if "raise RuntimeError" in ln)
    assert f"{project / 'mytask.py'}:{raise_line}" in line
    for debug in ({"FUNCTRAIN_DEBUG": "1"}, {}):
        argv = ["train", "run.yaml", "train_dataset=mytask:broken", *([] if debug else ["--debug"])]
        out = functrain(project, *argv, **debug)
        assert out.returncode == 2 and "Traceback" in out.stderr and 'raise RuntimeError("my' in out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith("functrain train: ")


def test_a_config_error_names_the_users_file_and_line_never_functrains(project: Path):
    # the YAML's line, and no Python frame: the user wrote no code that raised it
    (project / "bad_lr.yaml").write_text(_RUN.format(out=project / "out") + "optimizer:\n  lr: -1\n")
    out = functrain(project, "train", "bad_lr.yaml")
    line = assert_one_line_refusal(out, "train", "bad_lr.yaml: optimizer.lr (line 12): must be > 0")
    assert "(at " not in line, line
    # a config built by the user's Python: their line, not functrain/config/section.py's
    out = functrain(project, "train", "run.yaml", "model=mytask:configured")
    line = assert_one_line_refusal(out, "train", "epochs")
    config_line = next(i for i, ln in enumerate(_MYTASK.splitlines(), 1) if "TrainerConfig(epochs=0)" in ln)
    assert f"(at {project / 'mytask.py'}:{config_line})" in line, line
    assert str(ROOT / "functrain") not in line, line


def test_objects_the_trainer_cannot_take_and_bad_checkpoints_are_one_line(project: Path):
    out = functrain(project, "train", "run.yaml", "model=mytask:not_a_model")
    assert_one_line_refusal(
        out, "train", "model: built mytask.not_a_model(...) returned int, expected an nn.Module"
    )
    (project / "bad.ckpt").write_bytes(b"not a checkpoint")
    out = functrain(project, "eval", "run.yaml", "--checkpoint", "bad.ckpt", "eval_dataset=mytask:train_set")
    assert_one_line_refusal(out, "eval", "bad.ckpt", "not a functrain checkpoint")


def test_a_failure_while_training_is_one_line_with_status_1(project: Path):
    out = functrain(project, "train", "run.yaml", "train_dataset=mytask:Unreadable")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith("functrain train: OSError: cannot read image 17")
    assert (
        "example index 17" in lines[0] and f"{project / 'mytask.py'}:" in lines[0] and "--debug" in lines[0]
    )


@pytest.mark.compile
def test_a_mistake_in_the_users_model_is_one_short_line_naming_it_compiled_too(project: Path):
    # compile: true runs the step's forward eagerly before tracing it: eager's error, the user's line
    line_no = next(i for i, ln in enumerate(_MYTASK.splitlines(), 1) if 'x["x"]' in ln)
    for compile in ("false", "true"):
        argv = ["model=mytask:Indexing", "train_dataset=mytask:tuple_inputs", f"compile={compile}"]
        argv.append(f"output_dir={project / compile}")
        out = functrain(project, "train", "run.yaml", *argv)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert lines[0].startswith("functrain train: TypeError: tuple indices"), lines[0][:300]
        assert f"(at {project / 'mytask.py'}:{line_no})" in lines[0] and len(lines[0]) < 500, lines[0][:600]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_preempted_run_exits_128_plus_the_signal_and_resumes(project: Path, sig: int, status: int):
    argv = ["train", "run.yaml", "train_dataset=mytask:Slow", "epochs=3", "log_steps=1", "print_steps=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "functrain", *argv],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.time() + 240
    assert proc.stdout is not None
    for line in proc.stdout:  # step 1's scalars are printed as step 2 begins: training is under way
        if line.startswith("step ") or time.time() > deadline:
            proc.send_signal(sig)
            break
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == status, err[-3000:]
    assert f"preempted by {signal.Signals(sig).name}" in err
    assert err.strip().endswith(f"continue with: functrain train --resume {project / 'out'}")
    assert "Traceback" not in err
    saved = os.listdir(project / "out" / "checkpoints")
    assert saved and all(int(re.findall(r"\d+", f)[0]) < 12 for f in saved)  # stopped before the end
    # naming the run's output_dir still resumes it (the CONFIG.yaml's own here)
    resumed = functrain(project, *argv[:3], "epochs=3", "resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert '"step": 12' in resumed.stdout  # 3 epochs of 4 batches, finished


def test_default_save_total_limit_keeps_the_newest_three_and_the_best(project: Path):
    """30 epochs with save_strategy=epoch once kept 30 checkpoints; the default now keeps 3 (+ the best)."""
    out = functrain(project, "train", "run.yaml", "epochs=6")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = sorted(int(re.findall(r"\d+", f)[0]) for f in os.listdir(project / "out" / "checkpoints"))
    assert steps == [16, 20, 24]  # 4 steps per epoch
    out = functrain(project, "train", "run.yaml", "epochs=6", "output_dir=out2", *_EVALUATED)
    assert out.returncode == 0, out.stderr[-3000:]
    from functrain import checkpoint  # torch: only here, the other tests run the command alone

    manager = checkpoint.CheckpointManager(project / "out2" / "checkpoints", best_metric="eval/loss")
    kept = manager.all_steps()
    assert kept[-3:] == [16, 20, 24] and len(kept) <= 4
    best = min(range(4, 25, 4), key=lambda s: _eval_loss(project / "out2", s))
    assert best in kept


_EVALUATED = ("eval_strategy=epoch", "eval_dataset=mytask:train_set")


def _eval_loss(run: Path, step: int) -> float:
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    return next(r["eval/loss"] for r in rows if r.get("step") == step and "eval/loss" in r)


def test_demo_takes_config_overrides(monkeypatch, capsys):
    from functrain.cli import main
    from functrain.trainer import demo

    seen = {}

    def run(output_dir, *, overrides, **fields):
        seen.update(output_dir=output_dir, overrides=overrides, fields=fields)
        return {"eval/accuracy": 1.0}

    monkeypatch.setattr(demo, "run", run)
    assert main(["demo", "output_dir=My Runs/d", "epochs=2", "compile=false", "seed=1"]) == 0
    assert seen["overrides"] == ["output_dir=My Runs/d", "epochs=2", "compile=false", "seed=1"]
    assert seen["output_dir"] == "runs/demo"  # the default, which the output_dir override replaces
    assert main(["demo", "epochs=2"]) == 0 and seen["overrides"] == ["epochs=2"]
    assert capsys.readouterr().err == ""


def test_config_reading_with_imports_deferred_imports_no_torch(project: Path):
    """What the command reads before its slow imports: the whole config validated, torch not imported."""
    probe = (
        "import sys\n"
        "from functrain.config import ConfigError, TrainerConfig\n"
        "from functrain.config.imports import deferred_imports\n"
        "with deferred_imports():\n"
        "    config = TrainerConfig.from_yaml('run.yaml').with_overrides(['criterion=MSELoss', 'test_dataset=m:t'])\n"
        "    try:\n"
        "        TrainerConfig.from_yaml('run.yaml').with_overrides(['epochs=0'])\n"
        "    except ConfigError as err:\n"
        "        print('REFUSED', err.paths)\n"
        "print('TORCH', 'torch' in sys.modules, config.test_dataset)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=project, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED ['epochs']" in out.stdout and "TORCH False m:t" in out.stdout
