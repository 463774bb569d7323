"""Host threads while the main thread compiles a step.

``torch.compiler.is_compiling()`` reads a process-global flag that dynamo sets for the whole compile: a
prefetch thread, the async checkpoint writer or a logger that asks it while the main thread compiles is
told "compiling". functrain's host code that branches on tracing (the flat-dict fast path of
``tree.flatten``, the remat and checkpoint routing, the cache-hit dispatcher, the fused optimizer's
checks) must ask ``is_dynamo_compiling()``, which is true only inside dynamo's trace. On the old code the
prefetch thread's collate flattened some samples the traced way and raised ``CollateError`` between two
structures that print identically (the first-week Trainer crash with a Hugging Face model).
"""

from __future__ import annotations

import threading

import optree
import pytest
import torch

from functrain import tree
from functrain.data import collate


def _slow_to_trace(x: torch.Tensor) -> torch.Tensor:
    # Enough ops that dynamo's trace takes a good fraction of a second on a loaded 2-core machine.
    for i in range(400):
        x = torch.sin(x) * (1 + i % 3) + torch.cos(x)
    return x


class _HostThread(threading.Thread):
    """Flattens and collates flat dicts of tensors in a loop, as the prefetch thread does, recording
    the spec types it got and how many of its polls fell inside a compile (the global flag set)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.polls_while_compiling = 0
        self.spec_types: set[type] = set()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        samples = [{"input_ids": torch.arange(4) + i, "labels": torch.tensor(i % 2)} for i in range(32)]
        while not self.stop.is_set():
            compiling = torch.compiler.is_compiling()
            try:
                self.spec_types.add(type(tree.flatten(samples[0])[1]))
                batch = collate(samples)
                assert tree.same_structure(tree.structure(batch), tree.structure(samples[0]))
            except BaseException as e:
                self.errors.append(e)
                return
            self.polls_while_compiling += compiling


@pytest.mark.compile
def test_a_host_thread_flattens_and_collates_eagerly_while_the_main_thread_compiles():
    host = _HostThread()
    host.start()
    try:
        for round_ in range(3):  # three compiles (fresh functions), to be sure the thread ran during one
            torch._dynamo.reset()
            fn = torch.compile(_slow_to_trace, fullgraph=True, backend="eager")
            fn(torch.ones(3) * round_)
            if host.polls_while_compiling > 10 or host.errors:
                break
    finally:
        host.stop.set()
        host.join()
    assert not host.errors, f"the host thread failed: {host.errors[0]!r}"
    # The test could fail: the thread really ran while dynamo's global "compiling" flag was set.
    assert host.polls_while_compiling > 10
    assert host.spec_types == {optree.PyTreeSpec}


def test_no_functrain_module_branches_on_the_process_global_compiling_flag():
    # The flag of torch.compiler.is_compiling() is set for every thread while any thread compiles.
    import pathlib
    import re

    import functrain

    root = pathlib.Path(functrain.__file__).parent
    asks = re.compile(r"\bis_compiling\(\)")  # is_dynamo_compiling() does not match
    offenders = [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if asks.search(line)
    ]
    assert not offenders, f"ask torch.compiler.is_dynamo_compiling() instead: {offenders}"
