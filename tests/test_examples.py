"""Every example runs as a newcomer would run it (small: FUNCTRAIN_SMALL=1), the notebooks headless."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name[0].isdigit())


def small_env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FUNCTRAIN_SMALL": "1",
        "FUNCTRAIN_OUT": str(tmp_path / "out"),
        "FUNCTRAIN_PLOT": str(tmp_path / "curves.png"),
    }


def test_every_example_is_listed():
    assert SCRIPTS == [
        "01_compose_steps.py",
        "02_fit.py",
        "03_trainer.py",
        "04_finetune.py",
        "06_sharded.py",
        "07_hf_finetune.py",
        "08_tensor_parallel.py",
    ]


def _quick_start_commands() -> list[str]:
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", section, re.S)
        for line in block.splitlines()
    ]


def test_readme_quick_start_pins_the_cpu_torch_ci_tests_and_its_test_command_is_cis():
    """Verbatim on a fresh machine: torch is installed first, pinned to CI's version, from the CPU index
    (PyPI's default is the CUDA build); the test command is the one .ci/run runs after pinning torch."""
    commands = _quick_start_commands()
    ci = (EXAMPLES.parent / ".ci" / "run").read_text()
    (full,) = re.findall(r"^FULL=(\S+)$", ci, re.M)
    torch_installs = [c for c in commands if re.search(r"pip install torch\b", c)]
    assert torch_installs and all(
        f"pip install torch=={full} --index-url https://download.pytorch.org/whl/cpu" in c
        for c in torch_installs
    ), torch_installs
    assert commands[-1].endswith('&& pip install -e ".[dev]" && python -m pytest'), commands
    assert all(c.startswith("python3 -m venv .venv && ") for c in commands), "one command each, fresh venv"
    assert re.search(r'^python -m pip install -q -e "\.\[dev\]"$', ci, re.M), (
        "CI installs what the README says"
    )
    assert re.search(r"^python -m pytest -q", ci, re.M), "CI runs the README's test command"
    assert ci.index("pip install -q torch==$FULL") < ci.index('-e ".[dev]"'), "CI pins torch first"


def _imported_modules(example: Path) -> set[str]:
    if example.suffix == ".ipynb":
        cells = json.loads(example.read_text())["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    else:
        source = example.read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names)


def test_the_examples_extra_installs_every_package_an_example_imports():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

    provided = names(project["dependencies"]) | names(project["optional-dependencies"]["examples"])
    distributions = importlib.metadata.packages_distributions()  # module -> the packages that install it
    missing = {}
    for example in sorted(EXAMPLES.glob("*.py")) + sorted(EXAMPLES.glob("*.ipynb")):
        for module in _imported_modules(example) - {"functrain"}:
            wanted = {d.lower() for d in distributions.get(module, [module])}
            if not wanted & provided:
                missing.setdefault(example.name, []).append(module)
    assert missing == {}, (
        f'pip install -e ".[examples]" does not install what these examples import: {missing}'
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script: str, tmp_path: Path):
    if script == "07_hf_finetune.py":
        pytest.importorskip("transformers")  # a test-only extra
    args = [sys.executable, str(EXAMPLES / script)]
    if script == "02_fit.py":
        args.append(str(tmp_path / "fit_run"))
    out = subprocess.run(
        args, cwd=tmp_path, env=small_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    if script == "02_fit.py":
        assert (tmp_path / "fit_run" / "curves.png").stat().st_size > 1000


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``, ignored ones too, with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.slow
@pytest.mark.parametrize("notebook", ["train_digits.ipynb", "05_sweep.ipynb"])
def test_notebook_executes_headless_and_writes_nothing_beside_it(notebook: str, tmp_path: Path, monkeypatch):
    """As ``jupyter execute examples/NOTEBOOK`` runs it: the kernel in examples/, no FUNCTRAIN_PLOT."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    for key, value in small_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("FUNCTRAIN_PLOT")  # a newcomer sets none: the figure is shown, not saved
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own default: inline
    before = _files(EXAMPLES)
    nb = nbformat.read(EXAMPLES / notebook, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()  # raises on any error cell
    after = _files(EXAMPLES)
    changed = sorted(k for k in after.keys() | before.keys() if after.get(k) != before.get(k))
    assert changed == [], f"running {notebook} wrote into examples/: {changed}"
    # the figure is shown inline, in the plotting cell's outputs
    shown = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "display_data" and "image/png" in out.get("data", {})
    ]
    assert len(shown) == 1


def _on_two_ranks(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 examples/SCRIPT ARGS`` in ``tmp_path``, checked to exit 0."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**small_env(tmp_path), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES.parent), env.get("PYTHONPATH", "")])
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    out = subprocess.run(
        [*launch, str(EXAMPLES / script), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.slow
def test_sharded_example_under_torchrun_halves_the_state_per_rank(tmp_path: Path):
    import re

    out = _on_two_ranks(tmp_path, "06_sharded.py", "--epochs", "2")
    held = re.findall(r"rank (\d)/2 \(params\): holds (\d+) kB.*?would hold (\d+) kB", out.stdout)
    assert sorted(r for r, _, _ in held) == ["0", "1"], out.stdout
    for _, mine, whole in held:
        assert int(mine) <= 0.55 * int(whole), out.stdout
    # what it is doing, one line per epoch from rank 0 only, and what to expect
    epoch_line = r"^epoch (\d)/2: train loss [\d.]+ \| eval loss [\d.]+, accuracy [\d.]+$"
    assert re.findall(epoch_line, out.stdout, re.M) == ["1", "2"], out.stdout
    assert re.search(r"accuracy [\d.]+ \(expected with the defaults: ", out.stdout), out.stdout


@pytest.mark.slow
def test_tensor_parallel_example_under_torchrun_splits_the_state_and_gathers_it(tmp_path: Path):
    import re

    out = _on_two_ranks(tmp_path, "08_tensor_parallel.py")
    held = re.findall(r"rank (\d)/2: holds \d+ kB of params and optimizer state \(([\d.]+) of", out.stdout)
    assert sorted(r for r, _ in held) == ["0", "1"], out.stdout
    assert all(float(share) <= 0.6 for _, share in held), out.stdout  # replicated embeddings, norms, head
    assert re.search(r"^the gathered weights in a plain nn.Module: loss [\d.]+; saved ", out.stdout, re.M), (
        out.stdout
    )
    assert (tmp_path / "runs" / "08_tensor_parallel" / "final.ckpt").stat().st_size > 0
