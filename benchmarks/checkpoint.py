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
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SAVERS = ("functrain", "functrain+fsync", "torch", "safetensors")
SCENARIOS = ("overwrite", "new file")
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


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(operation: str, library: str, path: str, gib: float) -> dict:
    """Run one operation in this (fresh) process and report its time and memory.

    ``operation`` is "load", "save" (to ``path``) or "save-new": the next file of the folder ``path``
    (``step_<n>``), the previous one deleted after the timed save as a checkpoint folder keeping one does.
    """
    import torch

    from functrain import checkpoint, tree

    flat = None
    new_file = operation == "save-new"
    if new_file:
        operation, folder = "save", path
        os.makedirs(folder, exist_ok=True)
        previous = sorted(
            int(name[5:].split(".")[0]) for name in os.listdir(folder) if name.startswith("step_")
        )
        step = previous[-1] + 1 if previous else 1
        path = os.path.join(folder, f"step_{step}.{'ckpt' if library.startswith('functrain') else 'bin'}")
    state = make_state(gib) if operation == "save" else None
    if state is not None and library in ("torch", "safetensors"):
        flat = {f"params.{k}": v for k, v in state["params"].items()}
        flat |= {f"buffers.{k}": v for k, v in state["buffers"].items()}
    state_bytes = tree.num_bytes(state) if state is not None else 0
    before = _current_rss_bytes()
    start = time.perf_counter()
    if operation == "save":
        if library.startswith("functrain") and new_file:
            manager = checkpoint.CheckpointManager(folder, max_to_keep=1, fsync=library.endswith("fsync"))
            manager.save(step, state)
        elif library.startswith("functrain"):
            checkpoint.save(path, state, step=10, fsync=library.endswith("fsync"))
        elif library == "torch":
            torch.save(flat, path)
        else:
            import safetensors.torch

            safetensors.torch.save_file(flat, path)
    else:
        if library == "functrain":
            loaded = checkpoint.restore(path)
        elif library == "torch":
            loaded = torch.load(path, weights_only=True)
        else:
            import safetensors.torch

            loaded = safetensors.torch.load_file(path)
        state_bytes = tree.num_bytes(loaded)
    if new_file and not library.startswith("functrain"):  # what the manager's retention does, timed alike
        for name in os.listdir(folder):
            if name != os.path.basename(path):
                os.remove(os.path.join(folder, name))
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    # Saving: the state is resident before; loading: the loaded state is what must be resident after.
    extra = peak - before - (state_bytes if operation == "load" else 0)
    return {"seconds": seconds, "extra_rss": extra, "state_bytes": state_bytes}


def _run_worker(operation: str, library: str, path: str, gib: float) -> dict:
    output = subprocess.run(
        [sys.executable, __file__, "--worker", operation, library, path, "--gib", str(gib)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


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
    rows += [
        ("save (new file)", "save-new", library, os.path.join(folder, f"new-{library}")) for library in SAVERS
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
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.gib)))
        return
    folder = args.folder or tempfile.mkdtemp(prefix="functrain-bench-")
    measurements = _measurements(folder)
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):  # interleaved, so slow phases of a shared machine hit every library
        for label, operation, library, path in measurements:
            os.sync()  # start every measurement with no other file's pages waiting to be written
            results.setdefault((label, library), []).append(_run_worker(operation, library, path, args.gib))
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
            name = "safetensors (mmap, lazy)" if (label, library) == ("load", "safetensors") else library
            print(
                f"| {label} | {name} | {median:.2f} | {fastest:.2f} | "
                f"{median / statistics.median(torch_runs):.2f}x | {fastest / min(torch_runs):.2f}x | {extra:.2f}x |"
            )
    if args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
