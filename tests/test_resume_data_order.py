"""The restored key decides the data order: a run resumed from a state made with another seed trains on the
interrupted run's batches, bitwise, through ``fit`` and the ``Trainer`` (the sharded case: 2 gloo ranks,
``test_sharding_torchrun.py``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from trainer_fixtures import SmallNet, make_dataset, quiet_config

import functrain as ft
from functrain import checkpoint, tree

EXAMPLES = [(x, y) for x, y in make_dataset(30, seed=3)]  # 8 batches of 4 an epoch, the last one short


def _fit(seed: int, max_steps: int, folder: Path | None, resume: bool) -> ft.TrainState:
    torch.manual_seed(0)
    model = SmallNet()
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=seed)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy)), compile=False)
    return ft.fit(
        state, step, EXAMPLES, batch_size=4, max_steps=max_steps, progress_bar=False,
        checkpoints=folder, save_every=5 if folder else None, resume_from_checkpoint=resume,
    ).state  # fmt: skip


def _bitwise(a: object, b: object) -> bool:
    la, lb = tree.leaves(a), tree.leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def test_fit_resumed_from_a_state_of_another_seed_continues_the_interrupted_order(tmp_path: Path) -> None:
    straight = _fit(0, 12, None, False)  # 12 steps: into the second epoch
    _fit(0, 5, tmp_path, False)  # interrupted mid-epoch, saved at step 5
    resumed = _fit(7, 12, tmp_path, True)  # the new run's state has another key
    assert int(resumed.step) == 12
    assert _bitwise(resumed.params, straight.params)
    assert _bitwise(resumed.opt_state, straight.opt_state)
    assert torch.equal(resumed.rng, straight.rng)  # the checkpoint's key, restored


def test_the_checkpoint_keeps_the_data_key(tmp_path: Path) -> None:
    _fit(0, 5, tmp_path, False)
    saved = checkpoint.CheckpointManager(tmp_path).restore("latest")["loop"]["data_key"]
    assert torch.equal(saved, ft.loop.data_key(ft.TrainState.create(SmallNet(), ft.optim.sgd(0.1), seed=0)))


def _train(tmp_path: Path, seed: int, epochs: int, resume: bool, folder: str) -> ft.TrainState:
    torch.manual_seed(0)
    config = quiet_config(
        tmp_path, output_dir=str(tmp_path / folder), seed=seed, epochs=epochs, batch_size=8,
        eval_strategy="no", resume_from_checkpoint=resume,
    )  # fmt: skip
    return ft.Trainer(SmallNet(), config, make_dataset(40, seed=1)).train().state


def test_trainer_resumed_with_another_seed_trains_as_the_uninterrupted_run(tmp_path: Path) -> None:
    straight = _train(tmp_path, 5, 3, False, "straight")
    _train(tmp_path, 5, 2, False, "run")
    resumed = _train(tmp_path, 6, 3, True, "run")  # the config's seed changed between the two commands
    assert int(resumed.step) == int(straight.step) == 15
    assert _bitwise(resumed.params, straight.params)
