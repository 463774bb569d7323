"""Checkpoint save/load time and peak memory: functrain vs torch.save/torch.load and safetensors.

Each measurement runs in a fresh subprocess (so peak RSS belongs to that one operation), repeated, and the
median is reported. Files are read back warm from the page cache for every library alike.

    python benchmarks/checkpoint.py --gib 1.0 --repeats 3

"Extra RSS" is the peak resident memory during the operation beyond the state itself, as a fraction of
the state's size (the target is at most 0.2x).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

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


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(operation: str, library: str, path: str, gib: float) -> dict:
    """Run one operation in this (fresh) process and report its time and memory."""
    import torch

    from functrain import checkpoint, tree

    flat = None
    state = make_state(gib) if operation == "save" else None
    if state is not None and library in ("torch", "safetensors"):
        flat = {f"params.{k}": v for k, v in state["params"].items()}
        flat |= {f"buffers.{k}": v for k, v in state["buffers"].items()}
    state_bytes = tree.num_bytes(state) if state is not None else 0
    before = _current_rss_bytes()
    start = time.perf_counter()
    if operation == "save":
        if library.startswith("functrain"):
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


def _crc_seconds(gib: float) -> float:
    state = make_state(gib)
    import torch

    start = time.perf_counter()
    for t in state["params"].values():
        zlib.crc32(memoryview(t.view(torch.uint8).numpy()))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--worker", nargs=3, metavar=("OPERATION", "LIBRARY", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.gib)))
        return
    folder = args.folder or tempfile.mkdtemp(prefix="functrain-bench-")
    paths = _paths(folder)
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):  # interleaved, so slow phases of a shared machine hit every library
        for library in SAVERS:
            results.setdefault(("save", library), []).append(
                _run_worker("save", library, paths[library], args.gib)
            )
        for library in LOADERS:
            results.setdefault(("load", library), []).append(
                _run_worker("load", library, paths[library], args.gib)
            )
    state_bytes = results[("load", "functrain")][0]["state_bytes"]
    print(f"state: {state_bytes / (1 << 30):.2f} GiB, {args.repeats} repeats, median of each")
    print(f"crc32 of the state alone: {_crc_seconds(args.gib):.2f} s (overlapped with I/O in functrain)")
    print()
    print("| operation | library | time (s) | vs torch | extra peak RSS / state |")
    print("|---|---|---|---|---|")
    for operation, libraries in (("save", SAVERS), ("load", LOADERS)):
        torch_time = statistics.median(r["seconds"] for r in results[(operation, "torch")])
        for library in libraries:
            runs = results[(operation, library)]
            seconds = statistics.median(r["seconds"] for r in runs)
            extra = statistics.median(r["extra_rss"] for r in runs) / state_bytes
            label = "safetensors (mmap, lazy)" if (operation, library) == ("load", "safetensors") else library
            print(f"| {operation} | {label} | {seconds:.2f} | {seconds / torch_time:.2f}x | {extra:.2f}x |")
    for path in paths.values():
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
