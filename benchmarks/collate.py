"""Loading cost: ``functrain.data.collate`` and ``Loader`` against torch's ``default_collate`` and ``DataLoader``.

Three tables, every variant timed in this one process, interleaved (each repeat runs every variant in
turn, rotated), ratios the median of the per-repeat ratios against torch's:

    collate   one batch of the same samples (dict / tuple / HF-style samples of tensors, numpy, ints) by
              ``default_collate``, by ``functrain.data.collate`` and by its careful path alone
              (``careful``: per-sample ``tree.flatten`` and leaf checks, what collate did before its
              fast path), at several batch sizes
    loader    one epoch over a memmap of rows (``{"x": row, "y": label}`` samples, shuffled) by a torch
              ``DataLoader`` and by ``functrain.data.Loader`` (default ``prefetch=2`` thread, and
              ``prefetch=0``), with collate and with the careful path as ``collate_fn`` (before)
    workers   with ``--workers`` worker processes: the first batch of the second epoch, and the whole
              second epoch, by ``Loader`` with persistent workers (the default), with
              ``persistent_workers=False`` (a DataLoader per epoch: what Loader did before), and by
              ``DataLoader`` with and without ``persistent_workers``
    images    ``collate`` as a ``DataLoader``'s ``collate_fn`` in ``--workers`` worker processes, against
              ``default_collate``, on batches of 32 3x224x224 images (a worker stacks into shared memory)

Usage:
    python benchmarks/collate.py                     # writes benchmarks/results/collate.md
    python benchmarks/collate.py --repeats 21 --rows 20000 --dim 256 --batch 128 --workers 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

from functrain import random
from functrain.data import Loader, collate
from functrain.data.collate import _collate_checked


def _sample_kinds(rng: np.random.Generator) -> dict[str, object]:
    """Sample factories ``i -> sample`` of the kinds datasets return."""
    x = torch.from_numpy(rng.standard_normal((512, 64), dtype=np.float32))
    image = torch.from_numpy(rng.standard_normal((512, 3, 32, 32), dtype=np.float32))
    ids = torch.from_numpy(rng.integers(0, 30000, (512, 128)))
    return {
        "dict: tensor (64,), 0-d tensor": lambda i: {"x": x[i], "y": torch.tensor(i % 10)},
        "tuple: image (3,32,32), int": lambda i: (image[i], i % 10),
        "dict: numpy (64,), numpy int": lambda i: {"x": x[i].numpy(), "y": np.int64(i % 10)},
        "HF: input_ids, attention_mask, labels": lambda i: {
            "input_ids": ids[i],
            "attention_mask": torch.ones(128, dtype=torch.long),
            "labels": torch.tensor(i % 2),
        },
    }


def _ratio(times: dict[str, list[float]], name: str, base: str) -> float:
    return common.median_spread([a / b for a, b in zip(times[name], times[base])])[0]


def collate_table(batch_sizes: list[int], repeats: int) -> str:
    rows = [
        "| samples | batch | default_collate ms | collate ms | collate / default | careful (before) ms "
        "| careful / default |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, make in _sample_kinds(np.random.default_rng(0)).items():
        for size in batch_sizes:
            samples = [make(i) for i in range(size)]
            fns = {
                "default": lambda s=samples: default_collate(s),
                "collate": lambda s=samples: collate(s),
                "careful": lambda s=samples: _collate_checked(s),
            }
            calls = max(10, 20000 // size)  # 10-80 ms per timing: longer than the scheduler's noise
            times = common.interleaved(fns, repeats, calls)
            med = {name: common.median_spread(ts)[0] for name, ts in times.items()}
            rows.append(
                f"| {kind} | {size} | {med['default']:.3f} | {med['collate']:.3f} | "
                f"**{_ratio(times, 'collate', 'default'):.2f}x** | {med['careful']:.3f} | "
                f"{_ratio(times, 'careful', 'default'):.2f}x |"
            )
            print(rows[-1], flush=True)
    return "\n".join(rows)


class MemmapRows(torch.utils.data.Dataset):
    """``{"x": row, "y": label}`` from a ``.npy`` memmap: numpy rows and labels as ``np.load`` gives them,
    or (``tensors``) a tensor view of the row and a Python int."""

    def __init__(self, path: Path, tensors: bool) -> None:
        self.x = np.load(path / "x.npy", mmap_mode="r+" if tensors else "r")
        self.y = np.load(path / "y.npy", mmap_mode="r")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, object]:
        if self.tensors:
            return {"x": torch.from_numpy(self.x[i]), "y": int(self.y[i])}
        return {"x": self.x[i], "y": self.y[i]}


def _write_memmap(path: Path, rows: int, dim: int) -> None:
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(path / "x.npy", dtype=np.float32, mode="w+", shape=(rows, dim))
    for start in range(0, rows, 4096):
        x[start : start + 4096] = rng.standard_normal((min(4096, rows - start), dim), dtype=np.float32)
    x.flush()
    np.save(path / "y.npy", rng.integers(0, 10, rows))


def _epoch(batches) -> None:
    for _ in batches:
        pass


def loader_table(data: MemmapRows, batch: int, repeats: int) -> list[str]:
    torch_loader = DataLoader(data, batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    loaders = {
        "DataLoader": torch_loader,
        "Loader": Loader(data, batch, key=random.key(0)),
        "Loader prefetch=0": Loader(data, batch, key=random.key(0), prefetch=0),
        "Loader, careful (before)": Loader(data, batch, key=random.key(0), collate_fn=_collate_checked),
        "Loader prefetch=0, careful (before)": Loader(
            data, batch, key=random.key(0), prefetch=0, collate_fn=_collate_checked
        ),
    }
    epochs = iter(range(10**9))
    fns = {
        name: (lambda ld=ld: _epoch(ld))
        if isinstance(ld, DataLoader)
        else (lambda ld=ld: _epoch(ld.epoch(next(epochs))))
        for name, ld in loaders.items()
    }
    times = common.interleaved(fns, repeats, 1)
    samples = "tensor row, int" if data.tensors else "numpy row, numpy int"
    rows = []
    for name, ts in times.items():
        med, lo, hi = common.median_spread(ts)
        ratio = "-" if name == "DataLoader" else f"**{_ratio(times, name, 'DataLoader'):.2f}x**"
        rows.append(f"| {samples} | {name} | {med:.1f} | {lo:.1f}-{hi:.1f} | {ratio} |")
        print(rows[-1], flush=True)
    return rows


def workers_table(data: MemmapRows, batch: int, workers: int, repeats: int) -> str:
    def make(name: str):
        if name.startswith("DataLoader"):
            loader = DataLoader(
                data, batch, shuffle=True, num_workers=workers, persistent_workers="persistent" in name
            )
            return lambda epoch: iter(loader)
        persistent = "persistent_workers=False" not in name
        loader = Loader(data, batch, key=random.key(0), num_workers=workers, persistent_workers=persistent)
        return loader.epoch

    names = [
        "Loader (persistent, default)",
        "Loader persistent_workers=False (before)",
        "DataLoader persistent_workers=True",
        "DataLoader",
    ]
    first: dict[str, list[float]] = {n: [] for n in names}
    whole: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            epoch = make(name)
            _epoch(epoch(0))
            t0 = time.perf_counter()
            batches = epoch(1)
            next(iter(batches))
            first[name].append((time.perf_counter() - t0) * 1e3)
            _epoch(batches)
            whole[name].append((time.perf_counter() - t0) * 1e3)
            del epoch, batches
    rows = [
        f"| loader (num_workers={workers}) | epoch 2 first batch ms | IQR | epoch 2 ms | IQR | "
        "epoch 2 vs DataLoader persistent |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        f, flo, fhi = common.median_spread(first[name])
        w, wlo, whi = common.median_spread(whole[name])
        ratio = _ratio(whole, name, "DataLoader persistent_workers=True")
        rows.append(
            f"| {name} | {f:.1f} | {flo:.1f}-{fhi:.1f} | {w:.1f} | {wlo:.1f}-{whi:.1f} | {ratio:.2f}x |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows)


class Images(torch.utils.data.Dataset):
    """``{"image": 3x224x224 float32, "label": int}``: batches large enough that a copy shows."""

    def __init__(self, size: int) -> None:
        self.x = torch.randn(64, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"image": self.x[i % 64], "label": i % 10}


def images_table(workers: int, repeats: int) -> str:
    data = Images(1024)
    fns = {}
    for name, fn in (
        ("default_collate", default_collate),
        ("collate", collate),
        ("careful", _collate_checked),
    ):
        loader = DataLoader(data, 32, num_workers=workers, persistent_workers=True, collate_fn=fn)
        _epoch(loader)  # start the workers
        fns[name] = lambda ld=loader: _epoch(ld)
    times = common.interleaved(fns, repeats, 1)
    rows = [f"| collate_fn (DataLoader, {workers} workers) | ms per epoch | IQR | vs default_collate |"]
    rows.append("|---|---:|---:|---:|")
    for name, ts in times.items():
        med, lo, hi = common.median_spread(ts)
        ratio = "-" if name == "default_collate" else f"**{_ratio(times, name, 'default_collate'):.2f}x**"
        rows.append(f"| {name} | {med:.1f} | {lo:.1f}-{hi:.1f} | {ratio} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--rows", type=int, default=20000, help="examples in the memmap")
    parser.add_argument("--dim", type=int, default=256, help="float32 values per example")
    parser.add_argument("--batch", type=int, default=128, help="batch size of the loader tables")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-repeats", type=int, default=5)
    parser.add_argument("--tables", nargs="+", default=["collate", "loader", "workers", "images"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "collate.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    header = f"Machine: {common.machine()}; load average {common.load_average()}; {time.strftime('%Y-%m-%d %H:%M')}\n"
    parts = [header]
    if "collate" in args.tables:
        parts.append(f"collate, {args.repeats} repeats:\n\n" + collate_table(args.batch_sizes, args.repeats))
    with tempfile.TemporaryDirectory(prefix="functrain-collate-") as tmp:
        _write_memmap(Path(tmp), args.rows, args.dim)
        data = MemmapRows(Path(tmp), tensors=False)
        what = f"{args.rows} x {args.dim} float32 memmap, batch {args.batch}"
        if "loader" in args.tables:
            rows = ["| samples | loader (num_workers=0) | ms per epoch | IQR | vs DataLoader |"]
            rows.append("|---|---|---:|---:|---:|")
            for tensors in (False, True):
                rows += loader_table(MemmapRows(Path(tmp), tensors), args.batch, args.repeats)
            parts.append(f"loader, {what}, {args.repeats} repeats:\n\n" + "\n".join(rows))
        if "workers" in args.tables:
            table = workers_table(data, args.batch, args.workers, args.worker_repeats)
            parts.append(f"workers, {what}, {args.worker_repeats} repeats:\n\n" + table)
    if "images" in args.tables:
        table = images_table(args.workers, args.worker_repeats)
        parts.append(
            f"images, 1024 of 3x224x224 float32, batch 32, {args.worker_repeats} repeats:\n\n" + table
        )
    parts.append(f"load average after: {common.load_average()}")
    common.write_report("\n\n".join(parts), args.out, echo=False)


if __name__ == "__main__":
    main()
