"""Checkpoints of a tensor-parallel state: saved whole (msgpack, atomic), resumed on another layout.

One 4-rank torchrun launch of ``tp_checkpoint_worker.py layouts`` writes a run on tp 2 x dp 2 (the
manager saving ``{"state", "loop"}`` as ``fit`` does) and resumes its step-4 file on tp 2 x dp 2, tp 1 x
dp 4 and tp 4; this process resumes it on one process. One 1-rank launch (``fit``) runs ``ft.fit`` itself
on a tp mesh of one: its checkpoint callback saves the placed state, and resuming it places the file.
"""

from __future__ import annotations

import os

import pytest
import tp_checkpoint_worker as worker
import tp_worker as base
from test_sharding_torchrun import _torchrun

import functrain as ft

pytestmark = pytest.mark.slow

# float64, 4 steps on another layout after the resume: the split matmuls and the dp mean sum in another
# order (measured 8.7e-13 on tp 1 x dp 4, 5.7e-13 on tp 4, 7.9e-13 on one process)
OTHER_LAYOUT = 1e-10


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _torchrun(
        "layouts", str(tmp_path_factory.mktemp("tp_layouts")), 4, script="tp_checkpoint_worker.py"
    )


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _torchrun("fit", str(tmp_path_factory.mktemp("tp_fit")), 1, script="tp_checkpoint_worker.py")[0]


def test_a_placed_state_is_saved_whole_with_its_layout_in_the_metadata(layouts: list[dict]) -> None:
    first = layouts[0]["uninterrupted"]
    for out in layouts:
        # the file the manager wrote (rank 0), ft.checkpoint.save's file on each rank, the state_dict export:
        # each exactly the gathered state
        assert out["file_vs_gathered"] == 0.0 and out["save_vs_gathered"] == 0.0, out
        assert out["state_dict_vs_gathered"] == 0.0 and out["state_dict_plain"], out
        for metadata in (out["metadata"], out["save_metadata"]):
            layout = metadata["tensor_parallel"]["state"]  # fit's {"state": ...}, or the state itself
            assert (layout["tp"], layout["dp"]) == (2, 2) and layout["plan"] == dict(ft.distributed.GPT_PLAN)
            assert len(layout["split"]) == 20 and layout["split"]["blocks.0.attn.proj.weight"] == 1, layout
        # every rank gathered the same state: what rank 0 wrote is every rank's
        assert base.max_diff(out["uninterrupted"], first) == 0.0


@pytest.mark.parametrize("name", list(worker.LAYOUTS))
def test_the_file_resumes_on_another_layout(layouts: list[dict], name: str) -> None:
    for out in layouts:
        resumed = out[name]
        # loaded (onto the run's state as the loop does, and given a target): placed by the new layout's
        # strategy, bitwise the uninterrupted state at step 4
        assert resumed["loaded_placed"] and resumed["resumed_placed"], resumed
        assert resumed["loaded_vs_uninterrupted"] == 0.0 and resumed["targeted_vs_uninterrupted"] == 0.0
        assert resumed["resumed_step"] == worker.STEPS, resumed
        # init_weights_from a tp 2 x dp 2 file onto this layout: the weights placed, the moments its own
        assert resumed["init_weights_placed"] and resumed["init_weights_vs_file"] == 0.0, resumed
        assert resumed["init_weights_moments_kept"] == 0.0, resumed
        if name == "tp2xdp2":  # the layout that wrote it: bitwise the uninterrupted run to the end
            assert resumed["resumed_vs_uninterrupted"] == 0.0 and resumed["its_file_vs_uninterrupted"] == 0.0
        else:
            assert 0.0 <= resumed["resumed_vs_uninterrupted"] <= OTHER_LAYOUT, resumed
            assert resumed["its_file_vs_uninterrupted"] <= OTHER_LAYOUT, resumed


def test_the_file_resumes_on_one_process(layouts: list[dict], tmp_path: str) -> None:
    uninterrupted = layouts[0]["uninterrupted"]
    state = worker.read(layouts[0]["saved_path"])
    assert base.max_diff(state.params, uninterrupted[worker.SAVED]["params"]) == 0.0
    assert base.max_diff(state.opt_state, uninterrupted[worker.SAVED]["opt_state"]) == 0.0
    step = ft.make_train_step(base.model(heads=worker.HEADS), base.lm_loss)
    manager = ft.checkpoint.CheckpointManager(os.fspath(tmp_path))
    state, _ = worker.train(state, step, worker.loader(1, 0), worker.SAVED, manager)
    assert int(state.step) == worker.STEPS
    assert base.max_diff(state.params, uninterrupted[worker.STEPS]["params"]) <= OTHER_LAYOUT
    assert base.max_diff(state.opt_state, uninterrupted[worker.STEPS]["opt_state"]) <= OTHER_LAYOUT


def test_a_mismatch_names_the_layout_that_wrote_the_file(layouts: list[dict]) -> None:
    target = ft.TrainState.create(base.model(heads=worker.HEADS), ft.optim.sgd(0.1))  # another optimizer
    with pytest.raises(ft.checkpoint.CheckpointError) as caught:
        ft.checkpoint.restore(layouts[0]["saved_path"], target={"state": target, "loop": {"position": 0}})
    message = str(caught.value)
    assert "written by a tensor-parallel run (state: tp=2 x dp=2, plan {'*attn.q': 'colwise'" in message
    assert "not in the layout" in message, message


def test_fit_saves_a_placed_state_and_resumes_it_placed_or_on_a_plain_state(fitted: dict) -> None:
    assert fitted["metadata"]["tensor_parallel"]["state"]["tp"] == 1, fitted["metadata"]
    assert fitted["metadata"]["data_parallel"]["global_batch_size"] == worker.GLOBAL_BATCH
    assert fitted["placed"] == {"placed": True, "step": worker.STEPS, "vs_uninterrupted": 0.0}, fitted
    assert fitted["plain"]["step"] == worker.STEPS and fitted["plain"]["vs_uninterrupted"] <= OTHER_LAYOUT
    # a DTensor outside a placed state has no strategy to gather it: refused, saying what to save
    assert "outside a tensor-parallel TrainState" in fitted["stray"] and "full_tensor()" in fitted["stray"]


def test_a_sharded_checkpoint_of_a_placed_state_is_refused_with_the_reason(fitted: dict) -> None:
    # save_sharded would write one whole copy per rank and restore_sharded would not place the tensors
    for name in ("save", "restore"):
        message = fitted["sharded"][name]
        assert f"{name}_sharded: the state is a tensor-parallel state" in message, message
        assert "saved whole" in message and "CheckpointManager" in message, message
