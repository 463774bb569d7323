"""Import specs run code, and say so (issue 22, item 4): the built objects are checked with a message
naming the field, an error while building names the user's file and line, an opt-in allow-list of
modules, and the warning in ``--help-config`` and the README."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from functrain.config import ConfigError, build_object, config_help
from functrain.config.imports import ALLOWED_MODULES_ENV, check_import_spec

REPO = Path(__file__).resolve().parents[1]

USER_MODULE = """\
import torch


class Net(torch.nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.layer = torch.nn.Linear(width, 2)
        raise ValueError("no weights for this width")


class Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(-1, 2)


def rows():
    return [(torch.zeros(4), 0)] * 8


def nothing():
    return None
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "specs_user_task.py"
    path.write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "specs_user_task", raising=False)
    return path


@pytest.mark.parametrize(
    ("spec", "path", "message"),
    [
        ({"target": "os:getpid"}, "model", "model: built os.getpid(...) returned int, expected an nn.Module"),
        ("math:pi", "model", "model: 'math:pi' is float, expected an nn.Module"),
        ("collections:OrderedDict", "model", "built collections.OrderedDict(...) returned OrderedDict"),
        (
            "os:getpid",
            "train_dataset",
            "train_dataset: built os.getpid(...) returned int, expected a dataset",
        ),
        ("os:getcwd", "eval_dataset", "eval_dataset: built os.getcwd(...) returned str, expected a dataset"),
        ("specs_user_task:nothing", "test_dataset", "returned NoneType, expected a dataset"),
    ],
)
def test_a_built_object_of_the_wrong_kind_is_a_config_error_naming_the_field(
    spec: object, path: str, message: str, user_module: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        build_object(spec, path=path)  # type: ignore[arg-type]
    assert message in str(info.value) and info.value.paths == [path]


def test_objects_of_the_right_kind_are_built(user_module: Path) -> None:
    model = build_object({"target": "torch.nn:Linear", "args": [4, 2]}, path="model")
    assert isinstance(model, torch.nn.Linear)
    assert len(build_object("specs_user_task:rows", path="train_dataset")) == 8
    assert build_object("collections:OrderedDict", path="spec") == {}  # no check for other paths


@pytest.mark.parametrize(
    ("spec", "line"),
    [
        ("specs_user_task:Net", 8),
        ({"target": "specs_user_task:Net", "kwargs": {"width": 3}}, 8),
        ("specs_user_task:Deep", 14),
    ],
)
def test_an_exception_while_building_names_the_users_file_and_line(
    spec: object, line: int, user_module: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        build_object(spec, path="model")  # type: ignore[arg-type]
    assert f"(at {user_module}:{line}, in __init__)" in str(info.value)
    assert info.value.__cause__ is not None  # the original traceback stays chained


def test_the_allow_list_refuses_other_modules(user_module: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "specs_user_task, torch.nn")
    assert build_object("specs_user_task:rows", path="train_dataset")[0][1] == 0
    assert isinstance(
        build_object({"target": "torch.nn:Linear", "args": [2, 2]}, path="model"), torch.nn.Linear
    )
    with pytest.raises(ConfigError, match="the module 'os' is not in FUNCTRAIN_ALLOWED_MODULES"):
        build_object({"target": "os:system", "args": ["echo should not run"]}, path="model")
    with pytest.raises(ConfigError, match=r"is defined in 'torch', which is not in"):  # via an allowed module
        check_import_spec("specs_user_task:torch.Tensor")
    with pytest.raises(ConfigError, match="the attribute '__builtins__' is private"):
        check_import_spec("specs_user_task:__builtins__")
    with pytest.raises(
        ConfigError, match="the module 'torch' is not in"
    ):  # torch.nn allows torch.nn.*, not torch
        check_import_spec("torch:zeros")
    monkeypatch.delenv(ALLOWED_MODULES_ENV)
    assert check_import_spec("os:getpid") is not None


def test_help_config_and_readme_say_a_config_is_code() -> None:
    text = config_help()
    assert "a config file is code" in text and "os:system" in text and ALLOWED_MODULES_ENV in text
    assert "validating the config\nalready imports" in text or "validating the config already imports" in text
    readme = (REPO / "README.md").read_text()
    assert "**Security: a run.yaml is code.**" in readme and ALLOWED_MODULES_ENV in readme
