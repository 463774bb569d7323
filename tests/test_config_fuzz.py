"""Config reading is total (issue 22, item 3): any bytes, any YAML -> a config or a `ConfigError` naming the
file, never another exception, a hang or a traceback from ``functrain train``.

Time and memory per input are measured by ``benchmarks/config_fuzz.py``, not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from config_fuzz_inputs import VALID, bombs, mutations

from functrain.config import ConfigError, TrainerConfig, yaml_io

REPO = Path(__file__).resolve().parents[1]


def _read(path: Path) -> tuple[str, TrainerConfig | ConfigError]:
    """``("ok", config)`` or ``("config error", err)``; any other exception propagates (the failure)."""
    try:
        return "ok", TrainerConfig.from_yaml(path)
    except ConfigError as err:
        return "config error", err


def _escapes(inputs: dict[str, bytes], tmp_path: Path) -> dict[str, str]:
    """Inputs whose reading raised something other than a `ConfigError` naming the file, by name."""
    bad = {}
    for i, (name, data) in enumerate(inputs.items()):
        path = tmp_path / f"in{i}.yaml"
        path.write_bytes(data)
        try:
            kind, result = _read(path)
        except BaseException as exc:  # what escapes is the finding
            bad[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if kind == "config error" and str(path) not in str(result):
            bad[name] = f"ConfigError not naming the file: {str(result)[:200]}"
    return bad


def test_the_valid_run_yaml_reads() -> None:
    config = TrainerConfig.from_yaml(VALID)
    assert config.optimizer.lr == 3e-4 and config.optimizer.args["betas"] == [0.9, 0.999]


def test_600_seeded_mutations_give_a_config_or_a_config_error_naming_the_file(tmp_path: Path) -> None:
    inputs = {f"mutation {i}": data for i, data in enumerate(mutations(600, seed=22))}
    assert len(set(inputs.values())) > 550  # the mutations differ
    assert _escapes(inputs, tmp_path) == {}


def test_the_mutations_reach_the_hostile_cases(tmp_path: Path) -> None:
    """The fuzz is not all syntax errors: it reaches each guard (and some inputs still read)."""
    found = ""
    for i, data in enumerate(mutations(600, seed=22)):
        path = tmp_path / f"m{i}.yaml"
        path.write_bytes(data)
        kind, result = _read(path)
        found += "<ok>\n" if kind == "ok" else str(result)
    for message in (
        "not UTF-8",
        "UTF-16",
        "invalid YAML",
        "appears twice",
        "contains itself",
        "nodes",
        "characters",
    ):
        assert message in found, message
    assert "<ok>" in found


@pytest.mark.parametrize("name", list(bombs()))
def test_bombs_and_hostile_files_are_refused_naming_the_file(name: str, tmp_path: Path) -> None:
    assert _escapes({name: bombs()[name]}, tmp_path) == {}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("billion laughs", "aliases (*name) expand the document"),
        ("self-referencing sequence", "contains itself"),
        ("self-referencing mapping", "contains itself"),
        ("3000-deep flow", "maximum nesting depth"),
        ("100-deep mapping", "nested more than 64 levels deep"),
        ("5000-digit integer", "has 5000 characters"),
        ("400-digit optimizer.lr", "optimizer.lr (line 1): the integer has 400 characters"),
        ("lr 1e400", "optimizer.lr (line 1): must be a finite number"),
        ("bad timestamp", "cannot read the value '2001-13-45'"),
        ("utf-16 with BOM", "UTF-16 (or UTF-32) encoded; it must be UTF-8"),
        ("utf-16-le without BOM", "it must be UTF-8"),
        ("latin-1", "not UTF-8: byte 0xe9 at line 1, column 21"),
        ("10 MB of a list", "larger than 4 MB"),
        ("100k unknown keys", "holds more than 50,000 values"),
        ("python tag", "could not determine a constructor"),
        ("NUL byte", "control characters are not allowed"),
    ],
)
def test_what_each_refusal_says(name: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(bombs()[name])
    with pytest.raises(ConfigError) as info:
        TrainerConfig.from_yaml(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_a_field_problem_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 3\nbatch_size: 16\noptimizer:\n  name: adamw\n  lr: -1\nmetricz: [accuracy]\n")
    with pytest.raises(ConfigError) as info:
        TrainerConfig.from_yaml(path)
    text = str(info.value)
    assert text.startswith(f"2 problems in the trainer config {path}:")
    assert "optimizer.lr (line 5): must be > 0" in text and "metricz (line 6): unknown field" in text


def test_aliases_within_bounds_still_read() -> None:
    config = TrainerConfig.from_yaml(
        "epochs: &n 3\nsave_total_limit: *n\noptimizer: {lr: &lr 0.1}\nsweep: {optimizer.lr: [*lr, 0.2]}\n"
    )
    assert config.save_total_limit == 3 and config.sweep == {"optimizer.lr": [0.1, 0.2]}


def test_one_parse_with_the_c_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    if getattr(yaml, "__with_libyaml__", False):
        assert issubclass(yaml_io._Loader, yaml.CSafeLoader)
    made = []
    base = yaml_io._Loader

    class Counting(base):  # type: ignore[misc, valid-type]
        def __init__(self, stream: str) -> None:
            made.append(stream)
            super().__init__(stream)

    monkeypatch.setattr(yaml_io, "_Loader", Counting)
    monkeypatch.setattr(yaml, "compose", lambda *a, **k: pytest.fail("parsed a second time"))
    monkeypatch.setattr(yaml, "safe_load", lambda *a, **k: pytest.fail("parsed a second time"))
    TrainerConfig.from_yaml(VALID)
    assert len(made) == 1


@pytest.mark.parametrize(
    "name", ["billion laughs", "3000-deep flow", "3000-deep block", "self-referencing mapping"]
)
def test_the_pure_python_loader_refuses_the_same_bombs(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without libyaml: the same guards; deep nesting ends as a depth error, not a RecursionError."""
    monkeypatch.setattr(yaml_io, "_Loader", yaml_io._make_loader(yaml.SafeLoader))
    assert _escapes({name: bombs()[name]}, tmp_path) == {}


def test_an_override_is_read_with_the_same_guards() -> None:
    config = TrainerConfig.from_yaml(VALID)
    with pytest.raises(ConfigError, match="contains itself"):
        config.with_overrides(["optimizer.args=&a [*a]"])
    with pytest.raises(ConfigError, match="the integer has 401 characters"):
        config.with_overrides(["optimizer.lr=1" + "0" * 400])
    with pytest.raises(ConfigError, match="must be a finite number"):
        config.with_overrides(["optimizer.lr=1e400"])


def test_python_values_out_of_range_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.lr: must be a finite number, got 1000"):
        TrainerConfig(optimizer={"lr": 10**400})
    with pytest.raises(ConfigError, match="an integer of about 5001 digits"):
        TrainerConfig(output_dir=10**5000)


def test_reading_a_broken_file_imports_no_torch(tmp_path: Path) -> None:
    """A broken file is refused before anything heavy is imported (a quick answer from the CLI)."""
    paths = []
    for name in ("billion laughs", "latin-1", "5000-digit integer", "3000-deep flow"):
        paths.append(tmp_path / f"{len(paths)}.yaml")
        paths[-1].write_bytes(bombs()[name])
    code = textwrap.dedent(f"""
        import json, sys
        from functrain.config import ConfigError, TrainerConfig
        for path in {[str(p) for p in paths]!r}:
            try:
                TrainerConfig.from_yaml(path)
            except ConfigError:
                pass
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(out.stdout) == []


# ----------------------------------------------------------------------------------- through the CLI

_CLI_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    err = io.StringIO()
    sys.argv = ["functrain", "train", path]
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module("functrain", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            code, _ = "traceback", traceback.print_exc()
    results[path] = [code, err.getvalue()]
print(json.dumps(results))
"""


def _cli_inputs() -> dict[str, bytes]:
    chosen = dict(list(bombs().items())[:30])
    chosen.update({f"mutation {i}": m for i, m in enumerate(mutations(600, seed=22)[:400:40])})
    chosen["model os.system returns an int"] = (
        b"epochs: 1\neval_strategy: 'no'\nmodel: {target: 'os:getpid'}\ntrain_dataset: 'os:getcwd'\n"
    )
    return chosen


def test_cli_train_exits_2_without_a_traceback_on_every_bad_config(tmp_path: Path) -> None:
    """``python -m functrain train bad.yaml`` for 40 bad files: exit status 2, no traceback.

    The files run through ``functrain/__main__.py`` in one interpreter (``runpy``), as ``python -m
    functrain`` does, so that torch is imported once (a fresh process each costs ~4 s here); one file also
    runs as a real subprocess below.
    """
    inputs = _cli_inputs()
    (tmp_path / "fuzz_cli_task.py").write_text(
        "import torch\n\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        raise RuntimeError('bad init')\n"
    )
    inputs["model whose __init__ raises"] = (
        b"epochs: 1\neval_strategy: 'no'\nmodel: fuzz_cli_task:Net\ntrain_dataset: 'os:getcwd'\n"
    )
    paths = {}
    for i, (name, data) in enumerate(inputs.items()):
        paths[name] = tmp_path / f"bad{i}.yaml"
        paths[name].write_bytes(data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.run(
        [sys.executable, "-c", _CLI_DRIVER, *map(str, paths.values())],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=True, timeout=300,
    )  # fmt: skip
    results = json.loads(driver.stdout)
    assert len(results) >= 20
    bad = {
        name: results[str(path)]
        for name, path in paths.items()
        if results[str(path)][0] != 2 or "Traceback" in results[str(path)][1]
    }
    assert bad == {}
    assert (
        "model: built os.getpid(...) returned int, expected an nn.Module"
        in results[str(paths["model os.system returns an int"])][1]
    )
    init_error = results[str(paths["model whose __init__ raises"])][1]
    assert f"(at {tmp_path / 'fuzz_cli_task.py'}:7, in __init__)" in init_error


def test_cli_train_subprocess_exit_2_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(bombs()["billion laughs"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "functrain", "train", str(path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(path) in proc.stderr
