"""Partial restore for fine-tuning, and interop with plain state_dicts, nn.Module and safetensors."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_helpers import StandInState

from functrain import checkpoint


def _model(classes: int) -> torch.nn.Module:
    torch.manual_seed(classes)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, classes))


def _state(module: torch.nn.Module) -> StandInState:
    return StandInState(
        step=torch.tensor(0),
        params={k: v.detach().clone() for k, v in module.named_parameters()},
        buffers={k: v.detach().clone() for k, v in module.named_buffers()},
        opt_state=(),
        rng=torch.tensor([0, 1]),
    )


def test_new_head_is_left_at_its_initial_value(tmp_path):
    pretrained = _state(_model(10))
    checkpoint.save(tmp_path / "pre.ckpt", pretrained, fsync=False)
    fresh = _state(_model(2))
    tuned, report = checkpoint.init_weights_from(tmp_path / "pre.ckpt", fresh)
    assert torch.equal(tuned.params["0.weight"], pretrained.params["0.weight"])
    assert torch.equal(tuned.buffers["1.running_var"], pretrained.buffers["1.running_var"])
    assert torch.equal(tuned.params["2.weight"], fresh.params["2.weight"])
    assert sorted(report.initial) == ["2.bias", "2.weight"]
    assert report.skipped["2.weight"] == "shape [10, 4] in source, [2, 4] in target"
    assert "0.weight" in report.loaded and not report.complete
    with pytest.raises(checkpoint.CheckpointError, match=r"left at initial value: 2\.weight"):
        checkpoint.init_weights_from(tmp_path / "pre.ckpt", fresh, strict=True)


def test_strict_import_of_a_plain_state_dict_file(tmp_path):
    module = _model(3)
    torch.save(module.state_dict(), tmp_path / "plain.pt")
    state, report = checkpoint.init_weights_from(tmp_path / "plain.pt", _state(_model(3)), strict=True)
    assert report.complete
    for name, value in module.state_dict().items():
        group = state.params if name in state.params else state.buffers
        assert torch.equal(group[name], value), name


def test_key_map_casts_and_unused_entries_are_reported():
    state = _state(_model(2))
    source = {"backbone." + k: v.double() for k, v in state.params.items()} | {"extra": torch.ones(1)}
    tuned, report = checkpoint.init_weights_from(
        source, state, key_map=lambda k: k.removeprefix("backbone.") if k.startswith("backbone.") else None
    )
    assert report.skipped == {"extra": "dropped by key_map"}
    assert report.cast["0.weight"] == "torch.float64 -> torch.float32"
    assert tuned.params["0.weight"].dtype == torch.float32
    assert sorted(report.initial) == sorted(state.buffers)


def test_needs_params_and_buffers():
    with pytest.raises(checkpoint.CheckpointError, match="'params' dict"):
        checkpoint.init_weights_from({}, {"weights": {}})


def test_exported_state_dict_loads_strictly_with_tied_keys(tmp_path):
    module = _model(3)
    state = _state(module)
    tied = {"3.weight": "2.weight"}
    checkpoint.save(tmp_path / "s.ckpt", state, metadata={"tied_parameters": tied}, fsync=False)
    exported = checkpoint.export(tmp_path / "s.ckpt", tmp_path / "model.pt", format="pt")
    assert exported["3.weight"] is exported["2.weight"]
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert loaded["3.weight"].data_ptr() == loaded["2.weight"].data_ptr()
    fresh = _model(3)
    fresh.load_state_dict({k: v for k, v in loaded.items() if k != "3.weight"}, strict=True)
    for name, value in module.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)


def test_to_state_dict_feeds_load_state_dict():
    module = _model(3)
    fresh = _model(4 - 1)
    torch.nn.init.zeros_(fresh[0].weight)
    fresh.load_state_dict(checkpoint.to_state_dict(_state(module)), strict=True)
    assert torch.equal(fresh[0].weight, module[0].weight)
    with pytest.raises(checkpoint.CheckpointError, match="tied parameter 'x' points to 'y'"):
        checkpoint.to_state_dict(_state(module), tied_parameters={"x": "y"})


def test_safetensors_round_trip(tmp_path):
    pytest.importorskip("safetensors")  # an optional dependency; installed in the dev extra
    state = _state(_model(3))
    checkpoint.save(
        tmp_path / "s.ckpt", state, metadata={"tied_parameters": {"head": "2.weight"}}, fsync=False
    )
    checkpoint.export(tmp_path / "s.ckpt", tmp_path / "m.safetensors", format="safetensors")
    weights = checkpoint.load_state_dict(tmp_path / "m.safetensors")
    assert torch.equal(weights["head"], state.params["2.weight"])
    imported, report = checkpoint.init_weights_from(
        tmp_path / "m.safetensors", _state(_model(3)), strict=True, tied_parameters={"head": "2.weight"}
    )
    assert report.complete and torch.equal(imported.params["2.bias"], state.params["2.bias"])


def test_missing_safetensors_gives_install_hint(hide_import, tmp_path):
    hide_import("safetensors")
    checkpoint.save(tmp_path / "s.ckpt", _state(_model(3)), fsync=False)
    with pytest.raises(checkpoint.CheckpointError, match="pip install safetensors"):
        checkpoint.export(tmp_path / "s.ckpt", tmp_path / "m.safetensors", format="safetensors")
