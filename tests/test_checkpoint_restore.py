"""Restoring onto a target: structure, shape and dtype checks reported together; target types kept."""

from __future__ import annotations

import collections

import pytest
import torch
from test_checkpoint_helpers import StandInState, assert_bit_equal

from functrain import checkpoint

Adam = collections.namedtuple("Adam", "count mu nu")


def _state(hidden: int = 4) -> StandInState:
    params = {"fc.weight": torch.randn(hidden, 3), "fc.bias": torch.randn(hidden)}
    return StandInState(
        step=torch.tensor(7, dtype=torch.int64),
        params=params,
        buffers={"bn.running_mean": torch.zeros(hidden)},
        opt_state=(Adam(torch.tensor(7), {k: torch.randn_like(v) for k, v in params.items()}, None),),
        rng=torch.tensor([1, 2], dtype=torch.int64),
        name="custom",
    )


def test_restore_onto_target_keeps_types_and_static_fields(tmp_path):
    state = _state()
    checkpoint.save(tmp_path / "s.ckpt", state, step=7, fsync=False)
    target = StandInState(
        step=torch.tensor(0),
        params={k: torch.zeros_like(v) for k, v in state.params.items()},
        buffers={"bn.running_mean": torch.ones(4)},
        opt_state=(Adam(torch.tensor(0), {k: torch.zeros_like(v) for k, v in state.params.items()}, None),),
        rng=torch.tensor([0, 0]),
        name="custom",
    )
    restored = checkpoint.restore(tmp_path / "s.ckpt", target=target)
    assert isinstance(restored, StandInState) and isinstance(restored.opt_state[0], Adam)
    assert_bit_equal(restored, state)


def test_restore_without_target_gives_plain_containers(tmp_path):
    state = _state()
    checkpoint.save(tmp_path / "s.ckpt", state, fsync=False)
    plain = checkpoint.restore(tmp_path / "s.ckpt")
    assert type(plain) is dict and set(plain) == {"step", "params", "buffers", "opt_state", "rng"}
    assert type(plain["opt_state"][0]) is tuple and plain["opt_state"][0][2] is None
    assert torch.equal(plain["params"]["fc.weight"], state.params["fc.weight"])


def test_every_mismatch_is_reported_by_path_in_one_error(tmp_path):
    checkpoint.save(tmp_path / "s.ckpt", _state(hidden=4), fsync=False)
    wrong = _state(hidden=5)
    wrong = wrong.replace(
        params={**wrong.params, "head.weight": torch.zeros(2)},
        buffers={"bn.running_mean": torch.zeros(5, dtype=torch.float64)},
        rng=1,
    )
    wrong = wrong.replace(params={k: v for k, v in wrong.params.items() if k != "fc.bias"})
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.restore(tmp_path / "s.ckpt", target=wrong)
    message = str(info.value)
    for expected in [
        "missing in checkpoint: params['head.weight']",
        "unexpected in checkpoint: params['fc.bias']",
        "wrong shape at params['fc.weight']: checkpoint [4, 3], target [5, 3]",
        "wrong shape at buffers['bn.running_mean']",
        "wrong dtype at buffers['bn.running_mean']: checkpoint torch.float32, target torch.float64",
        "wrong type at rng: checkpoint tensor int64[2], target int",
        "opt_state[0].mu['fc.weight']",
    ]:
        assert expected in message, expected


def test_restore_moves_tensors_to_the_targets_device(tmp_path):
    checkpoint.save(tmp_path / "s.ckpt", {"a": torch.ones(2)}, fsync=False)
    device = "cuda" if torch.cuda.is_available() else "meta"  # meta: a second device on a CPU-only machine
    restored = checkpoint.restore(tmp_path / "s.ckpt", target={"a": torch.empty(2, device=device)})
    assert restored["a"].device.type == device
    if device == "cuda":
        assert torch.equal(restored["a"].cpu(), torch.ones(2))


def test_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="cannot open"):
        checkpoint.restore(tmp_path / "nope.ckpt")
    with pytest.raises(checkpoint.CheckpointError, match=r"nope\.pt: cannot open weights file"):
        checkpoint.load_state_dict(tmp_path / "nope.pt")


def test_save_replaces_a_good_file_only_when_complete(tmp_path):
    path = tmp_path / "s.ckpt"
    checkpoint.save(path, {"a": torch.ones(2)}, fsync=False)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.save(path, {"a": torch.ones(2), "bad": object()})
    assert torch.equal(checkpoint.restore(path)["a"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["s.ckpt"]


def test_a_write_failing_midway_leaves_the_replaced_file_whole(tmp_path):
    # atomic_write drops the old file's cached pages before writing: its contents must not suffer.
    from functrain.core.atomic import atomic_write, drop_cached_pages

    path = tmp_path / "last.ckpt"
    old = torch.arange(1 << 18, dtype=torch.float32)
    checkpoint.save(path, {"a": old})
    with pytest.raises(RuntimeError, match="disk full"), atomic_write(path) as file:
        file.write(b"\0" * (1 << 20))
        raise RuntimeError("disk full")
    assert torch.equal(checkpoint.restore(path)["a"], old)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    drop_cached_pages(tmp_path / "missing.ckpt")  # nothing to drop: no error


# ------------------------------------------------------------------ a TrainState back in the composed style


def _trained():
    import functrain as ft

    model = torch.nn.Linear(3, 2)
    tx = ft.optim.adam(1e-2)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss)), compile=False)
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    state, _ = step(ft.TrainState.create(model, tx, seed=0), batch)
    return model, tx, step, batch, state


def test_a_plain_restore_given_to_a_step_is_refused_in_one_line_naming_target(tmp_path):
    import functrain as ft

    model, tx, eager, batch, state = _trained()
    ft.checkpoint.save(tmp_path / "s.ckpt", state)
    plain = ft.checkpoint.restore(tmp_path / "s.ckpt")
    compiled = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss)))
    unjitted = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss))
    for step in (compiled, eager, unjitted):
        with pytest.raises(TypeError) as info:
            step(plain, batch)
        message = str(info.value)
        assert "\n" not in message and "ft.checkpoint.restore(path, target=state)" in message, message
    assert compiled.num_compiles == 0  # refused before dynamo traced anything
    # what the message says: a TrainState again, that steps as the saved one does
    restored = ft.checkpoint.restore(tmp_path / "s.ckpt", target=ft.TrainState.create(model, tx, seed=5))
    assert isinstance(restored, ft.TrainState) and restored.tx is tx
    assert_bit_equal(eager(restored, batch)[0].params, eager(state, batch)[0].params)


def test_a_fit_checkpoint_restored_onto_a_bare_state_says_what_it_holds(tmp_path):
    import functrain as ft

    model, tx, step, batch, _ = _trained()
    data = [(x, y) for x, y in zip(*batch)]
    result = ft.fit(ft.TrainState.create(model, tx), step, data, batch_size=2, epochs=1, progress_bar=False,
                    checkpoints=tmp_path / "run")  # fmt: skip
    manager = ft.checkpoint.CheckpointManager(tmp_path / "run")
    path = manager.path(manager.latest())
    bare = ft.TrainState.create(model, tx)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.restore(path, target=bare)
    head = str(info.value).splitlines()[0]
    assert "{'state', 'loop'}" in head and "restore_onto(state, ft.checkpoint.restore(path)['state'])" in head
    with pytest.raises(ValueError) as info:
        checkpoint.restore_onto(bare, checkpoint.restore(path))
    assert "{'state', 'loop'}" in str(info.value).splitlines()[0]
    # what the message says restores the train state
    restored = checkpoint.restore_onto(bare, checkpoint.restore(path)["state"])
    assert_bit_equal(restored.params, result.state.params)
