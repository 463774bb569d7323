import subprocess
import sys
import threading
import traceback

import pytest
import torch

from functrain.data import Prefetcher, prefetch_to_device, to_device


def test_items_come_in_order_through_transfer():
    with Prefetcher(range(20), transfer=lambda x: x * 2, size=3) as items:
        assert list(items) == [2 * i for i in range(20)]
    assert not items.running


def _failing_source():
    yield 1
    raise_from_dataset()


def raise_from_dataset():
    raise KeyError("bad example 7")


def test_producer_exception_surfaces_with_its_original_traceback():
    items = Prefetcher(_failing_source())
    assert next(items) == 1
    with pytest.raises(KeyError, match="bad example 7") as info:
        next(items)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "raise_from_dataset" in frames and "_failing_source" in frames
    assert not items.running
    with pytest.raises(StopIteration):
        next(items)


def test_transfer_exception_surfaces_too():
    def transfer(x):
        raise ValueError(f"cannot move {x}")

    with pytest.raises(ValueError, match="cannot move 0"):
        next(Prefetcher(range(3), transfer=transfer))


def test_break_stops_the_thread_and_closes_the_source():
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    items = Prefetcher(endless(), size=2)
    for i in items:
        if i == 3:
            break
    thread = items._thread
    del items  # dropping the iterator after break is enough
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert closed.is_set()


def test_close_while_the_queue_is_full_does_not_hang():
    items = Prefetcher(iter(range(1000)), size=1)
    assert next(items) == 0
    items.close()
    assert not items.running
    with pytest.raises(StopIteration):
        next(items)


def test_the_producer_is_a_daemon_thread():
    items = Prefetcher(iter(range(3)))
    assert items._thread.daemon
    items.close()


@pytest.mark.slow  # a fresh interpreter imports torch and functrain: several seconds on 2 cores
def test_an_abandoned_prefetcher_does_not_block_interpreter_exit():
    code = (
        "import itertools\n"
        "from functrain.data import Prefetcher\n"
        "p = Prefetcher(itertools.count(), size=2)\n"
        "print(next(p))\n"
        "import functrain.data.prefetch as m\n"
        "m._keep = p\n"  # a live reference at exit: only the daemon flag lets Python leave
    )
    # The producer blocks forever on a full queue: if shutdown waited for it, the child would never
    # exit and subprocess.run would raise TimeoutExpired (a hang check, not a timing assertion).
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0"]


def test_size_must_be_positive():
    with pytest.raises(ValueError, match="size"):
        Prefetcher([1], size=0)


def test_to_device_maps_tensor_leaves_and_keeps_others():
    batch = {"x": torch.ones(2), "names": ["a"], "n": 3}
    moved = to_device(batch, "cpu")
    assert moved["names"] == ["a"] and moved["n"] == 3
    assert moved["x"].device.type == "cpu"
    assert to_device(batch, None) is batch
    assert [b["x"].device.type for b in prefetch_to_device([batch, batch], "cpu")] == ["cpu", "cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetch_copies_on_a_side_stream():
    batches = [{"x": torch.full((256,), float(i))} for i in range(8)]
    out = list(prefetch_to_device(batches, "cuda", size=2))
    assert all(b["x"].is_cuda for b in out)
    assert [float(b["x"][0]) for b in out] == [float(i) for i in range(8)]
