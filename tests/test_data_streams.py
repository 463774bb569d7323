"""Streams (iterable datasets, Hugging Face-style streaming datasets, stateful loaders) in ``fit`` and the
Trainer: taken with the defaults, shuffled through a seeded buffer on request, resumed exactly from their
own state or by a replay that is checked (a warning where it differs, never silently other batches)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trainer_fixtures import SmallNet, quiet_config

import functrain as ft
from functrain import checkpoint, random, tree
from functrain.data import Loader, ResumeWarning
from functrain.data.shuffle_buffer import ShuffleBuffer
from functrain.trainer import build


def _example(i: int, noise: float = 0.0) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(6, generator=g) + noise
    return x, int(x[0] > 0)


class Seeded(torch.utils.data.IterableDataset):
    """A stream that replays itself: the same 30 examples on every pass (a file read in order)."""

    def __iter__(self):
        return (_example(i) for i in range(30))


class Unseeded(torch.utils.data.IterableDataset):
    """A stream that never repeats (a live feed, an unseeded augmentation): other examples on every pass."""

    def __iter__(self):
        return (_example(i, noise=float(torch.rand(()))) for i in range(30))


class DuckStream:
    """What a Hugging Face streaming dataset looks like to functrain: iterable, no __len__/__getitem__."""

    def __iter__(self):
        return (_example(i) for i in range(30))


class Live(torch.utils.data.IterableDataset):
    """An endless feed that continues where it stopped, and says where with state_dict(); a new one starts
    where it is told (a feed that moved on since: a fresh pass does not replay the old one)."""

    def __init__(self, start: int = 0, state: Any = None) -> None:
        self.position = start
        self.state = state  # what state_dict() adds (a value a checkpoint cannot hold, for one test)

    def __iter__(self):
        while True:
            example = _example(1000 + self.position)
            self.position += 1
            yield example

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, **({"extra": self.state} if self.state is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def _fit(data: Any, max_steps: int, folder: Path | None = None, resume: bool = False, **kw: Any) -> Any:
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy)), compile=False)
    batch_size = None if isinstance(data, torch.utils.data.DataLoader) else 4
    return ft.fit(
        state, step, data, batch_size=batch_size, max_steps=max_steps, progress_bar=False,
        checkpoints=folder, save_every=3 if folder else None, resume_from_checkpoint=resume, **kw,
    ).state  # fmt: skip


def _bitwise(a: Any, b: Any) -> bool:
    la, lb = tree.leaves(a), tree.leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


# ------------------------------------------------------------------------------------ taken with defaults


@pytest.mark.parametrize("stream", [Seeded, DuckStream], ids=["IterableDataset", "duck-typed"])
def test_the_trainer_takes_a_stream_with_its_default_config(tmp_path: Path, stream: type) -> None:
    config = quiet_config(tmp_path, max_steps=10, batch_size=4, eval_strategy="no")
    assert config.shuffle == "auto"
    assert int(ft.Trainer(SmallNet(), config, stream()).train().state.step) == 10


def test_fit_takes_a_duck_typed_stream() -> None:
    assert int(_fit(DuckStream(), 9).step) == 9  # 8 batches a pass: into the second


def test_auto_shuffles_a_map_style_dataset_and_reads_a_stream_in_order() -> None:
    config, cpu = ft.TrainerConfig(max_steps=1), torch.device("cpu")
    mapped = build.loader(config, list(range(20)), 4, key=random.key(0), device=cpu)
    order = [i for batch in mapped.batch_indices(0) for i in batch]
    assert sorted(order) == list(range(20)) and order != list(range(20))
    stream = build.loader(config, Seeded(), 4, key=random.key(0), device=cpu)
    assert torch.equal(
        torch.cat([x for x, _ in stream.epoch(0)]), torch.stack([_example(i)[0] for i in range(30)])
    )


def test_shuffle_true_reads_a_stream_through_a_seeded_buffer_of_the_configured_size() -> None:
    config, cpu = ft.TrainerConfig(max_steps=1, shuffle=True, shuffle_buffer_size=8), torch.device("cpu")

    def order(key: int, epoch: int) -> list[int]:
        loader = build.loader(config, Seeded(), 4, key=random.key(key), device=cpu)
        firsts = torch.cat([x for x, _ in loader.epoch(epoch)])[:, 0]
        return [next(i for i in range(30) if _example(i)[0][0] == v) for v in firsts]

    first = order(0, 0)
    assert sorted(first) == list(range(30)) and first != list(range(30))
    assert order(0, 0) == first  # the same key and epoch: the same order
    assert order(0, 1) != first and order(1, 0) != first
    assert all(first.index(i) >= i - 8 for i in range(30))  # earlier by at most the buffer's size


def test_a_shuffle_buffer_is_a_permutation_per_worker_too() -> None:
    loader = Loader(Seeded(), 5, shuffle=True, shuffle_buffer=6, key=random.key(2), prefetch=0, num_workers=1)
    xs = torch.cat([x for x, _ in loader.epoch(0)])
    assert sorted(xs[:, 0].tolist()) == sorted(_example(i)[0][0].item() for i in range(30))
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        ShuffleBuffer(Seeded(), 0, random.key(0), 0)


def test_a_stream_refusal_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"shuffle_buffer=N.*shuffle_buffer_size.*shuffle=False"):
        Loader(DuckStream(), 4, shuffle=True, key=random.key(0))
    with pytest.raises(ValueError, match="shuffle_buffer is for streams"):
        Loader(list(range(8)), 4, shuffle_buffer=4, key=random.key(0))
    with pytest.raises(ft.config.ConfigError, match="shuffle_buffer_size"):
        ft.TrainerConfig(max_steps=1, shuffle_buffer_size=0)


# ------------------------------------------------------------------------------------ resume


def test_a_replaying_stream_resumes_exactly_and_quietly(tmp_path: Path) -> None:
    straight = _fit(Seeded(), 13)  # 8 batches a pass: a resume in the second pass
    _fit(Seeded(), 10, tmp_path)  # saved at step 9
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        resumed = _fit(Seeded(), 13, tmp_path, resume=True)
    assert _bitwise(resumed.params, straight.params)


def test_a_replaying_stream_through_a_shuffle_buffer_resumes_exactly(tmp_path: Path) -> None:
    def loader() -> Loader:
        return Loader(Seeded(), 4, shuffle=True, shuffle_buffer=7, key=random.key(3))

    straight = _fit(loader(), 13)
    _fit(loader(), 10, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        resumed = _fit(loader(), 13, tmp_path, resume=True)
    assert _bitwise(resumed.params, straight.params)


def test_a_stream_that_does_not_replay_says_so_on_resume(tmp_path: Path) -> None:
    _fit(Unseeded(), 5, tmp_path)  # saved at step 3
    with pytest.warns(ResumeWarning, match=r"not exact: the stream Unseeded .*state_dict\(\)") as caught:
        _fit(Unseeded(), 8, tmp_path, resume=True)
    assert len([w for w in caught if issubclass(w.category, ResumeWarning)]) == 1


def test_a_stateful_stream_continues_from_its_saved_state(tmp_path: Path) -> None:
    straight = _fit(Live(), 9)
    _fit(Live(), 7, tmp_path)  # saved last at step 7 (28 examples), while the prefetch thread read on
    saved = checkpoint.CheckpointManager(tmp_path).restore("latest")["loop"]
    assert saved["data_states"] == [{"position": 28}] and saved["batch_fingerprints"] == [""]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        resumed = _fit(Live(start=500), 9, tmp_path, resume=True)  # the state brings it back to 28
    assert _bitwise(resumed.params, straight.params)


def test_a_data_state_a_checkpoint_cannot_hold_warns_and_trains_on(tmp_path: Path) -> None:
    with pytest.warns(ResumeWarning, match=r"state_dict\(\) cannot be saved in a checkpoint.*extra"):
        _fit(Live(state=object()), 4, tmp_path)
    saved = checkpoint.CheckpointManager(tmp_path).restore("latest")["loop"]
    assert saved["data_states"] == [None] and saved["batch_fingerprints"][0]  # the resume replays, checked


class ProtocolLoader(torch.utils.data.DataLoader):
    """A DataLoader with StatefulDataLoader's protocol: its sampler's generator state is its state."""

    def __init__(self, dataset: Any) -> None:
        self.g = torch.Generator().manual_seed(0)
        self._skip, self._yielded, self._state = 0, 0, self.g.get_state()
        super().__init__(dataset, batch_size=4, shuffle=True, generator=self.g)

    def __iter__(self):
        start, self._skip = self._skip, 0
        self._state = self.g.get_state()
        for i, batch in enumerate(super().__iter__()):
            self._yielded = i + 1
            if i >= start:
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._state, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g.set_state(state["generator"])
        self._skip = state["yielded"]


def _stateful_loaders() -> list[Any]:
    loaders: list[Any] = [ProtocolLoader]
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # torchdata is optional; the protocol class stands in for it
        return loaders

    def torchdata_loader(dataset: Any) -> Any:
        g = torch.Generator().manual_seed(0)
        return StatefulDataLoader(dataset, batch_size=4, shuffle=True, generator=g)

    return [*loaders, torchdata_loader]


@pytest.mark.parametrize("make", _stateful_loaders(), ids=lambda f: getattr(f, "__name__", str(f)))
def test_a_stateful_dataloader_is_saved_and_restored(tmp_path: Path, make: Any) -> None:
    dataset = [_example(i) for i in range(30)]  # 8 batches an epoch: the resume is in the second
    straight = _fit(make(dataset), 14)
    _fit(make(dataset), 10, tmp_path)  # saved at step 9
    assert checkpoint.CheckpointManager(tmp_path).restore("latest")["loop"]["data_states"][0] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        resumed = _fit(make(dataset), 14, tmp_path, resume=True)
    assert _bitwise(resumed.params, straight.params)
