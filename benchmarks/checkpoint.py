"""Checkpoint save/load time and peak memory: functrain vs torch.save/torch.load and safetensors.

Each measurement runs in a fresh subprocess (so peak RSS belongs to that one operation), repeated, and the
median and the minimum are reported. Files are read back warm from the page cache for every library alike.
Before every measurement the parent calls ``os.sync()``, so no library is slowed by the write-back of the
file another library wrote just before it.

Saving is measured two ways:

- *overwrite*: every save replaces the same file (a ``last.ckpt``); torch.save and safetensors truncate
  it and write in place, functrain writes a new file beside it and renames it over (atomic);
- *new file*: every save writes a new file and the previous one is deleted afterwards (a checkpoint
  folder keeping one); functrain through ``CheckpointManager(max_to_keep=1)``.

    python benchmarks/checkpoint.py --gib 1.0 --repeats 5

"Extra RSS" is the peak resident memory during the operation beyond the state itself, as a fraction of
the state's size (the target is at most 0.2x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

SAVERS = ("functrain", "functrain+fsync", "torch", "safetensors")
LOADERS = ("functrain", "torch", "safetensors")


def make_state(gib: float):
    """A state shaped like a model's: a few large matrices and many small tensors, ~``gib`` GiB."""
    import torch

    numel = int(gib * (1 << 30)) // 16 // 4
    state = {"params": {}, "buffers": {}, "step": torch.tensor(10, dtype=torch.int64)}
    generator = torch.Generator().manual_seed(0)
    for index in range(16):
        state["params"][f"layer{index}.weight"] = torch.empty(numel, dtype=torch.float32).normal_(
            generator=generator
        )
        state["buffers"][f"layer{index}.scale"] = torch.ones(1024, dtype=torch.bfloat16)
    return state


def _save(library: str, path: str, state: dict, step: int) -> None:
    import torch

    from functrain import checkpoint

    fsync = library.endswith("fsync")
    if library.startswith("functrain") and os.path.isdir(path):  # a checkpoint folder keeping one
        checkpoint.CheckpointManager(path, max_to_keep=1, fsync=fsync).save(step, state)
        return
    if library.startswith("functrain"):
        checkpoint.save(path, state, step=step, fsync=fsync)
        return
    if os.path.isdir(path):  # a new file in the folder, then the previous one removed: what retention does
        previous = os.listdir(path)
        _save(library, os.path.join(path, f"step_{step}.bin"), state, step)
        for name in previous:
            os.remove(os.path.join(path, name))
    elif library == "torch":
        torch.save(checkpoint.to_state_dict(state), path)
    else:
        import safetensors.torch

        safetensors.torch.save_file(checkpoint.to_state_dict(state), path)


def _load(library: str, path: str) -> object:
    import torch

    from functrain import checkpoint

    if library == "functrain":
        return checkpoint.restore(path)
    if library == "torch":
        return torch.load(path, weights_only=True)
    import safetensors.torch

    return safetensors.torch.load_file(path)


def worker(operation: str, library: str, path: str, gib: float, step: int) -> dict:
    """Run one operation in this (fresh) process and report its time and memory.

    ``operation`` is "save" or "load"; a ``path`` that is a folder means "save a new file into it".
    """
    from functrain import tree

    state = make_state(gib) if operation == "save" else None
    before = common.rss_mb()
    start = time.perf_counter()
    if state is not None:
        _save(library, path, state, step)
    else:
        loaded = _load(library, path)
    seconds = time.perf_counter() - start
    extra = (common.peak_rss_mb() - before) * 2**20
    # Saving: the state is resident before; loading: the loaded state is what must be resident after.
    state_bytes = tree.num_bytes(state if state is not None else loaded)
    if state is None:
        extra -= state_bytes
    return {"seconds": seconds, "extra_rss": extra, "state_bytes": state_bytes}


def _run_worker(operation: str, library: str, path: str, gib: float, step: int) -> dict:
    args = ["--worker", operation, library, path, "--gib", str(gib), "--step", str(step)]
    return common.run_child(__file__, args, f"{operation} with {library}")


def _paths(folder: str) -> dict[str, str]:
    return {
        "functrain": os.path.join(folder, "state.ckpt"),
        "functrain+fsync": os.path.join(folder, "state-fsync.ckpt"),
        "torch": os.path.join(folder, "state.pt"),
        "safetensors": os.path.join(folder, "state.safetensors"),
    }


def _measurements(folder: str) -> list[tuple[str, str, str, str]]:
    """(label, worker operation, library, path) for every measurement of one repeat, in order."""
    paths = _paths(folder)
    rows = [("save (overwrite)", "save", library, paths[library]) for library in SAVERS]
    for library in SAVERS:
        os.makedirs(os.path.join(folder, f"new-{library}"), exist_ok=True)
    rows += [
        ("save (new file)", "save", library, os.path.join(folder, f"new-{library}")) for library in SAVERS
    ]
    rows += [("load", "load", library, paths[library]) for library in LOADERS]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--worker", nargs=3, metavar=("OPERATION", "LIBRARY", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.gib, args.step)))
        return
    folder = args.folder or tempfile.mkdtemp(prefix="functrain-bench-")
    measurements = _measurements(folder)
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):  # interleaved, so slow phases of a shared machine hit every library
        for label, operation, library, path in measurements:
            os.sync()  # start every measurement with no other file's pages waiting to be written
            result = _run_worker(operation, library, path, args.gib, step=repeat + 1)
            results.setdefault((label, library), []).append(result)
    state_bytes = results[("load", "functrain")][0]["state_bytes"]
    print(f"state: {state_bytes / (1 << 30):.2f} GiB, {args.repeats} repeats")
    print()
    print(
        "| operation | library | median (s) | min (s) | vs torch, median | vs torch, min | extra peak RSS / state |"
    )
    print("|---|---|---|---|---|---|---|")
    for label in dict.fromkeys(label for label, *_ in measurements):
        torch_runs = [r["seconds"] for r in results[(label, "torch")]]
        for library in SAVERS if label.startswith("save") else LOADERS:
            runs = results[(label, library)]
            seconds = [r["seconds"] for r in runs]
            median, fastest = statistics.median(seconds), min(seconds)
            extra = statistics.median(r["extra_rss"] for r in runs) / state_bytes
            if (label, library) == ("load", "safetensors"):  # maps the file, reads on first use
                print(f"| {label} | safetensors (mmap, lazy) | {median:.2f} | {fastest:.2f} | - | - | - |")
                continue
            print(
                f"| {label} | {library} | {median:.2f} | {fastest:.2f} | "
                f"{median / statistics.median(torch_runs):.2f}x | {fastest / min(torch_runs):.2f}x | {extra:.2f}x |"
            )
    if args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
