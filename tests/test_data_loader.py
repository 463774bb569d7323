import os
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from functrain import TrainerConfig, random
from functrain.config import ConfigError
from functrain.data import CollateError, DataPosition, Loader, ResumeWarning, num_batches, num_examples
from functrain.trainer import build


class Squares:
    """A map-style dataset of dicts: enough structure to exercise collation."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"index": i, "x": torch.tensor([float(i), float(i * i)])}


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))


def indices(batches):
    return [b["index"].tolist() for b in batches]


def test_two_epochs_differ_and_the_same_key_repeats():
    loader = Loader(Squares(40), 8, key=random.key(0), prefetch=0)
    first, second = indices(loader.epoch(0)), indices(loader.epoch(1))
    assert first != second
    assert sorted(i for b in first for i in b) == sorted(i for b in second for i in b) == list(range(40))
    again = Loader(Squares(40), 8, key=random.key(0), prefetch=0)
    assert indices(again.epoch(1)) == second
    other = Loader(Squares(40), 8, key=random.key(1), prefetch=0)
    assert indices(other.epoch(1)) != second


def test_batches_follow_the_documented_permutation():
    key = random.key(5)
    loader = Loader(Squares(10), 4, key=key, prefetch=0)
    order = torch.randperm(10, generator=random.generator(random.fold_in(key, 2))).tolist()
    assert indices(loader.epoch(2)) == [order[0:4], order[4:8], order[8:10]]
    assert loader.batch_indices(2) == [order[0:4], order[4:8], order[8:10]]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    batch_size=st.integers(1, 6),
    drop_last=st.booleans(),
    world_size=st.integers(1, 3),
    data=st.data(),
)
def test_resume_yields_exactly_the_rest_of_an_uninterrupted_run(n, batch_size, drop_last, world_size, data):
    rank = data.draw(st.integers(0, world_size - 1))
    per_epoch = num_batches(n, batch_size, drop_last, world_size)
    if per_epoch == 0:
        return
    loader = Loader(
        list(range(n)),
        batch_size,
        key=random.key(n),
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        prefetch=0,
    )
    assert len(loader) == per_epoch
    num_epochs = 3
    full = [(p.as_tuple(), b.tolist()) for p, b in loader.iterate(num_epochs=num_epochs)]
    assert len(full) == num_epochs * per_epoch
    consumed = data.draw(st.integers(0, len(full)))
    position = full[consumed - 1][0] if consumed else (0, 0)
    resumed = [
        (p.as_tuple(), b.tolist()) for p, b in loader.iterate(DataPosition(*position), num_epochs=num_epochs)
    ]
    assert resumed == full[consumed:]
    epoch, index = DataPosition(*position).normalized(per_epoch).as_tuple()
    if epoch < num_epochs:
        assert [b.tolist() for b in loader.epoch(epoch, index)] == [
            b for _, b in full[consumed : (epoch + 1) * per_epoch]
        ]


@pytest.mark.parametrize("drop_last", [False, True])
def test_sharded_loaders_cover_each_example_once_per_epoch(drop_last):
    n, batch_size, world_size = 23, 3, 4
    loaders = [
        Loader(
            Squares(n),
            batch_size,
            key=random.key(0),
            drop_last=drop_last,
            rank=r,
            world_size=world_size,
            prefetch=0,
        )
        for r in range(world_size)
    ]
    assert len({len(loader) for loader in loaders}) == 1
    for epoch in range(2):
        per_rank = [list(loader.epoch(epoch)) for loader in loaders]
        assert all(len(batches) == len(loaders[0]) for batches in per_rank)
        seen = Counter(i for batches in per_rank for b in batches for i in b["index"].tolist())
        assert set(seen.values()) == {1}
        assert len(seen) == (n if not drop_last else n // (batch_size * world_size) * batch_size * world_size)
        if not drop_last:  # 23 = 2 * 12 + 11: the last step gives 3, 3, 3, 2
            assert [num_examples(batches[-1]) for batches in per_rank] == [3, 3, 3, 2]


def test_a_rank_without_examples_in_the_last_step_gets_an_empty_batch():
    loaders = [Loader(Squares(3), 2, key=random.key(0), rank=r, world_size=4, prefetch=0) for r in range(4)]
    last = [list(loader.epoch(0))[-1] for loader in loaders]
    assert [num_examples(b) for b in last] == [1, 1, 1, 0]
    assert last[3]["x"].shape == (0, 2) and last[3]["index"].dtype == torch.int64
    assert sorted(i for b in last for i in b["index"].tolist()) == [0, 1, 2]


def test_workers_give_the_same_batches_as_the_main_process():
    kwargs = dict(batch_size=4, key=random.key(0), prefetch=0)
    serial = list(Loader(Squares(18), **kwargs).epoch(1, start_index=1))
    parallel = list(Loader(Squares(18), num_workers=2, **kwargs).epoch(1, start_index=1))
    kwargs["prefetch"] = 2  # workers started from the prefetch thread
    parallel_ahead = list(Loader(Squares(18), num_workers=2, **kwargs).epoch(1, start_index=1))
    assert len(serial) == len(parallel) == len(parallel_ahead) == 4
    for a, b, c in zip(serial, parallel, parallel_ahead):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["x"], b["x"])
        assert torch.equal(a["index"], c["index"]) and torch.equal(a["x"], c["x"])


class WhoLoads(Squares):
    """Each example says which process loaded it, a draw from the global torch RNG (augmentation done the
    way the docstring advises against, to see the workers' seeds) and which worker_init_fn calls its
    worker saw."""

    def __getitem__(self, i):
        inits = torch.tensor(sorted(_WORKER_INITS) or [-1])
        return {**super().__getitem__(i), "pid": os.getpid(), "noise": torch.rand(()), "inits": inits}


_WORKER_INITS: list[int] = []  # appended to in each worker process


def _record_init(worker_id):
    _WORKER_INITS.append(worker_id)


def epochs_of(loader, count):
    return [list(loader.epoch(e)) for e in range(count)]


def test_workers_persist_across_epochs_with_the_batches_of_new_workers():
    kwargs = dict(batch_size=4, key=random.key(0), prefetch=0, num_workers=2)
    kept = epochs_of(Loader(WhoLoads(18), **kwargs), 3)
    fresh = epochs_of(Loader(WhoLoads(18), persistent_workers=False, **kwargs), 3)
    serial = epochs_of(Loader(WhoLoads(18), batch_size=4, key=random.key(0), prefetch=0), 3)

    def pids(batches):
        return {p for b in batches for p in b["pid"].tolist()}

    assert pids(kept[0]) == pids(kept[1]) == pids(kept[2]) and len(pids(kept[0])) == 2
    assert os.getpid() not in pids(kept[0])
    assert not pids(fresh[0]) & pids(fresh[1])  # the old behaviour: new processes every epoch
    for k, f, s in zip(kept, fresh, serial):
        assert [b["index"].tolist() for b in k] == [b["index"].tolist() for b in s]
        assert all(torch.equal(a["x"], b["x"]) for a, b in zip(k, s))
        # Reseeded per epoch as torch seeds new workers: the same draws as fresh workers.
        assert torch.equal(torch.cat([b["noise"] for b in k]), torch.cat([b["noise"] for b in f]))
    assert not torch.equal(torch.cat([b["noise"] for b in kept[0]]), torch.cat([b["noise"] for b in kept[1]]))


def test_persistent_workers_resume_and_survive_abandoned_and_failed_epochs():
    kwargs = dict(batch_size=3, key=random.key(1), prefetch=0)
    loader = Loader(WhoLoads(20), num_workers=2, prefetch_factor=1, **kwargs)
    reference = Loader(WhoLoads(20), **kwargs)
    first = loader.epoch(0)
    next(first)  # left open: its workers still hold batches of epoch 0
    other = [b["index"].tolist() for b in loader.epoch(2)]  # an epoch while epoch 0 is open
    assert other == [b["index"].tolist() for b in reference.epoch(2)]
    first.close()
    resumed = [b["index"].tolist() for b in loader.epoch(1, start_index=2)]
    assert resumed == [b["index"].tolist() for b in reference.epoch(1)][2:]

    class FailsOnce(WhoLoads):
        def __getitem__(self, i):
            if i == 7 and self.epoch_to_fail:
                raise ValueError("example 7 fails in epoch 0")
            return super().__getitem__(i)

    failing = FailsOnce(20)
    failing.epoch_to_fail = True
    loader = Loader(failing, num_workers=2, **kwargs)
    with pytest.raises(ValueError, match="example 7 fails"):
        list(loader.epoch(0))
    failing.epoch_to_fail = False  # reaches the workers only if new ones start
    assert [b["index"].tolist() for b in loader.epoch(1)] == [b["index"].tolist() for b in reference.epoch(1)]


def test_worker_init_fn_runs_once_in_each_worker():
    loader = Loader(WhoLoads(16), 4, shuffle=False, prefetch=0, num_workers=2, worker_init_fn=_record_init)
    for batches in epochs_of(loader, 2):
        for b in batches:
            inits = b["inits"]
            assert inits.shape == (4, 1) and set(inits[:, 0].tolist()) <= {0, 1}
        assert {b["inits"][0, 0].item() for b in batches} == {0, 1}
    assert _WORKER_INITS == []  # never called in this process


def test_worker_options_are_checked():
    with pytest.raises(ValueError, match="prefetch_factor=2 needs worker processes"):
        Loader(Squares(4), 2, shuffle=False, prefetch_factor=2)
    with pytest.raises(ValueError, match="prefetch_factor must be an int >= 1"):
        Loader(Squares(4), 2, shuffle=False, num_workers=1, prefetch_factor=0)
    with pytest.raises(ValueError, match="DataLoader together with persistent_workers, worker_init_fn"):
        Loader(DataLoader(TensorDataset(torch.arange(4))), persistent_workers=False, worker_init_fn=print)
    # Without workers there is nothing to keep: persistent_workers=True (the default) is fine.
    assert len(list(Loader(Squares(4), 2, shuffle=False, persistent_workers=True).epoch(0))) == 2


def test_the_trainer_config_passes_the_worker_options():
    def pids(config):
        loader = build.loader(config, WhoLoads(8), 4, key=random.key(0), device=torch.device("cpu"))
        return [{p for b in loader.epoch(e) for p in b["pid"].tolist()} for e in range(2)]

    kept = pids(TrainerConfig(max_steps=1, num_workers=2, prefetch_factor=3))
    assert kept[0] == kept[1]
    fresh = pids(TrainerConfig(max_steps=1, num_workers=2, persistent_workers=False))
    assert not fresh[0] & fresh[1]
    with pytest.raises(ConfigError, match="prefetch_factor: is set but num_workers is 0"):
        TrainerConfig(max_steps=1, prefetch_factor=2)


def test_prefetching_iterate_matches_the_unprefetched_one():
    plain = Loader(Squares(10), 3, key=random.key(0), prefetch=0)
    ahead = Loader(Squares(10), 3, key=random.key(0), prefetch=2, device="cpu")
    a = [(p.as_tuple(), b["index"].tolist()) for p, b in plain.iterate(num_epochs=2)]
    b = [(p.as_tuple(), b["index"].tolist()) for p, b in ahead.iterate(num_epochs=2)]
    assert a == b and len(a) == 8


def test_breaking_out_of_an_epoch_stops_its_thread():
    iterator = Loader(Squares(50), 2, key=random.key(0)).epoch(0)
    next(iterator)
    iterator.close()
    assert not iterator.running


def test_dataset_errors_surface_in_the_consumer():
    class Broken(Squares):
        def __getitem__(self, i):
            if i == 4:
                raise IndexError("example 4 is corrupt")
            return super().__getitem__(i)

    with pytest.raises(IndexError, match="example 4 is corrupt"):
        list(Loader(Broken(8), 2, shuffle=False).epoch(0))


def test_iterable_dataset_resumes_by_skipping():
    stream = Stream(10)
    loader = Loader(stream, 3, prefetch=0)
    assert not loader.exact_resume
    assert loader.batches_per_epoch is None  # Stream has no __len__
    full = [b.tolist() for b in loader.epoch(2)]
    assert full == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [b.tolist() for b in loader.epoch(2, start_index=2)] == full[2:]
    assert stream.epochs == [2, 2]
    with pytest.raises(TypeError, match="unknown"):
        len(loader)
    positions = [p.as_tuple() for p, _ in loader.iterate(DataPosition(0, 3), num_epochs=2)]
    assert positions == [(0, 4), (1, 1), (1, 2), (1, 3), (1, 4)]


def test_iterable_dataset_rejects_shuffle_without_a_buffer_and_sharding():
    with pytest.raises(ValueError, match=r"needs shuffle_buffer=N.*or pass shuffle=False"):
        Loader(Stream(4), 2, shuffle=True)
    with pytest.raises(ValueError, match="cannot be sharded"):
        Loader(Stream(4), 2, world_size=2, rank=1)


def test_wrapped_dataloader_with_set_epoch_resumes_exactly():
    dataset = TensorDataset(torch.arange(12))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = Loader(DataLoader(dataset, batch_size=5, sampler=sampler), prefetch=0)
    assert loader.exact_resume and len(loader) == 3
    epoch1 = [b[0].tolist() for b in loader.epoch(1)]
    assert epoch1 != [b[0].tolist() for b in loader.epoch(0)]  # set_epoch was called
    assert [b[0].tolist() for b in loader.epoch(1, start_index=1)] == epoch1[1:]


def test_wrapped_dataloader_without_reproducible_order_warns_only_when_resumed():
    dataset = TensorDataset(torch.arange(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a run from the start: nothing to warn about
        loader = Loader(DataLoader(dataset, batch_size=2, shuffle=True), prefetch=0)
        assert len(list(loader.epoch(0))) == 3 and len(list(loader.iterate(num_epochs=1))) == 3
    assert not loader.exact_resume
    with pytest.warns(ResumeWarning, match="at epoch 1, batch 1 .* RandomSampler has no generator"):
        assert len(list(loader.iterate(DataPosition(1, 1), num_epochs=2))) == 2
    with pytest.warns(ResumeWarning, match="at epoch 0, batch 2"):
        Loader(DataLoader(dataset, batch_size=2, shuffle=True), prefetch=0).epoch(0, 2)
    sequential = Loader(DataLoader(dataset, batch_size=2), prefetch=0)
    assert sequential.exact_resume
    assert [b[0].tolist() for b in sequential.epoch(0, 1)] == [[2, 3], [4, 5]]


def test_wrapped_dataloader_refuses_batching_arguments():
    with pytest.raises(ValueError, match="DataLoader together with batch_size, key"):
        Loader(DataLoader(TensorDataset(torch.arange(4))), 2, key=random.key(0))
    with pytest.raises(ValueError, match="DataLoader together with pin_memory"):
        Loader(DataLoader(TensorDataset(torch.arange(4))), pin_memory=True)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="shuffle=True needs key="):
        Loader(Squares(4), 2)
    with pytest.raises(ValueError, match="batch_size is required"):
        Loader(Squares(4))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        Loader(Squares(4), 0, shuffle=False)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        Loader(Squares(4), 2, shuffle=False, rank=2, world_size=2)
    with pytest.raises(TypeError, match="key must be a functrain random key"):
        Loader(Squares(4), 2, key=0)
    with pytest.raises(TypeError, match="map-style dataset"):
        Loader(object(), 2)
    with pytest.raises(ValueError, match="start_index=5 is past the end"):
        Loader(Squares(4), 2, shuffle=False).epoch(0, 5)
    with pytest.raises(ValueError, match="no batches"):
        Loader(Squares(3), 4, shuffle=False, drop_last=True).iterate()
    with pytest.raises(TypeError, match="position must be a DataPosition"):
        Loader(Squares(3), 4, shuffle=False).iterate((0, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA warning")
def test_pin_memory_without_cuda_warns_instead_of_silently_ignoring():
    with pytest.warns(UserWarning, match="pin_memory=True has no effect without CUDA"):
        Loader(Squares(3), 2, shuffle=False, pin_memory=True)


def test_collate_errors_name_the_path_through_the_loader():
    class Ragged(Squares):
        def __getitem__(self, i):
            return {"x": torch.zeros(i + 1)}

    with pytest.raises(CollateError, match=r"sample\['x'\] has shape"):
        next(iter(Loader(Ragged(4), 2, shuffle=False).epoch(0)))
