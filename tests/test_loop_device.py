"""fit / evaluate / predict put batches on the state's device (on CPU: a ``meta`` state stands in for CUDA)."""

from __future__ import annotations

import pytest
import torch
from models import classification_batch, mlp

import functrain as ft
from functrain import random
from functrain.data.build import as_loader

META = torch.device("meta")


def dataset(n=12):
    return list(zip(*classification_batch(n)))


class Dataset(torch.utils.data.IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def recording_steps(seen):
    """A train, eval and predict step that note the devices of each batch's tensors and compute nothing."""

    def devices(batch):
        return {leaf.device for leaf in ft.tree.leaves(batch) if isinstance(leaf, torch.Tensor)}

    def train_step(state, batch):
        seen.append(devices(batch))
        return state.replace(step=state.step + 1), {}

    def eval_step(state, batch):
        seen.append(devices(batch))
        return {"loss": torch.zeros(()), "num_examples": 4, "metrics": None}

    def predict_step(state, batch):
        seen.append(devices(batch))
        return torch.zeros(1)

    return train_step, eval_step, predict_step


def sources(data):
    return {
        "dataset": (data, 4),
        "iterable dataset": (Dataset(data), 4),
        "DataLoader": (torch.utils.data.DataLoader(data, batch_size=4), None),
        "Loader": (ft.data.Loader(data, 4, shuffle=False), None),
    }


@pytest.mark.parametrize("kind", ["dataset", "iterable dataset", "DataLoader", "Loader"])
def test_fit_evaluate_and_predict_move_batches_onto_the_state_device(kind):
    state = ft.TrainState.create(mlp(), ft.optim.sgd(0.1), device=META)
    assert state.device == META
    seen = []
    train_step, eval_step, predict_step = recording_steps(seen)
    data, batch_size = sources(dataset())[kind]
    result = ft.fit(
        state, train_step, data, batch_size=batch_size, max_steps=3, progress_bar=False,
        eval_step=eval_step, eval_data=data, eval_every=3,
    )  # fmt: skip
    assert int(result.state.step) == 3
    ft.evaluate(state, eval_step, data, batch_size=batch_size)
    list(ft.predict(state, predict_step, data, batch_size=batch_size))
    # 3 train steps, 3 eval batches in fit, 3 in evaluate, 3 in predict
    assert seen == [{META}] * 12


def test_a_loader_with_its_own_device_keeps_it():
    state = ft.TrainState.create(mlp(), ft.optim.sgd(0.1), device=META)
    seen = []
    train_step, _, _ = recording_steps(seen)
    ft.fit(state, train_step, ft.data.Loader(dataset(), 4, shuffle=False, device="cpu"), max_steps=2,
           progress_bar=False)  # fmt: skip
    assert seen == [{torch.device("cpu")}] * 2


def test_a_cpu_state_gets_the_batches_as_they_are():
    state = ft.TrainState.create(mlp(), ft.optim.sgd(0.1))
    batches = [classification_batch(4, seed=i) for i in range(3)]
    pointers = []

    def step(state, batch):
        pointers.append(batch[0].data_ptr())
        return state.replace(step=state.step + 1), {}

    ft.fit(
        state, step, torch.utils.data.DataLoader(batches, batch_size=None), max_steps=3, progress_bar=False
    )
    assert pointers == [x.data_ptr() for x, _ in batches]  # not copied
    loader = ft.data.Loader(dataset(), 4, shuffle=False)
    assert as_loader(loader, None, random.key(0), "fit", shuffle=False, device=None) is loader


def test_cuda_batches_are_pinned_and_copied_by_the_loader(monkeypatch):
    # Building a CUDA loader touches no GPU: check the wiring here, the copies in test_cuda.py.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    built = as_loader(dataset(), 4, random.key(0), "fit", shuffle=True, device=cuda)
    assert built.device == cuda and built._source.pin_memory
    given = ft.data.Loader(dataset(), 4, shuffle=False)
    moved = as_loader(given, None, random.key(0), "fit", shuffle=False, device=cuda)
    assert moved.device == cuda and given.device is None  # the user's loader is not changed
    assert moved.batch_indices(0) == given.batch_indices(0)
