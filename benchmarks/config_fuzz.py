"""Time and peak memory of `TrainerConfig.from_yaml` on hostile inputs (issue 22: each under 1 s and 200 MB).

The inputs are those of ``tests/test_config_fuzz.py``: seeded mutations of a valid run.yaml and the
hand-written bombs (billion laughs, self-reference, 3,000-deep nesting, 5,000-digit numbers, 10 MB files,
other encodings). Each is written to a file and read once, in this process, after a warm-up read (so
the one-time import of torch by the loss check is not counted). Peak memory per input is the rise of the
process's resident-set high-water mark (``VmHWM``, reset before each input through
``/proc/self/clear_refs``) above its resident size before the read; where that reset is not possible,
the peak of Python allocations (``tracemalloc``) is reported instead.

    python benchmarks/config_fuzz.py            # 600 mutations + the bombs
    python benchmarks/config_fuzz.py --mutations 2000 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this checkout's functrain, and the test inputs

from config_fuzz_inputs import VALID, bombs, mutations  # noqa: E402

from functrain.config import ConfigError, TrainerConfig  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _status_kib("VmHWM")
    except (OSError, KeyError):
        return False
    return True


def measure(name: str, data: bytes, path: Path, rss: bool) -> tuple[float, float, str]:
    """(seconds, peak MB above the start, outcome) of reading ``data`` from ``path``."""
    path.write_bytes(data)
    if rss:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
    else:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        TrainerConfig.from_yaml(path)
        outcome = "read"
    except ConfigError:
        outcome = "ConfigError"
    except Exception as exc:  # an escape: the test fails on it; report it here too
        outcome = f"ESCAPED {type(exc).__name__}"
    seconds = time.perf_counter() - start
    if rss:
        peak_mb = (_status_kib("VmHWM") - before) / 1024
    else:
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return seconds, peak_mb, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", type=int, default=600)
    parser.add_argument("--seed", type=int, default=22)
    args = parser.parse_args()
    inputs = {f"mutation {i}": m for i, m in enumerate(mutations(args.mutations, seed=args.seed))}
    inputs.update(bombs())
    rss = _can_reset_peak()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        TrainerConfig.from_yaml(VALID)  # warm-up: imports (torch, for the loss check)
        rows = [(name, len(data), *measure(name, data, path, rss)) for name, data in inputs.items()]
    escaped = [row for row in rows if row[4].startswith("ESCAPED")]
    slowest = max(rows, key=lambda row: row[2])
    largest = max(rows, key=lambda row: row[3])
    memory = "peak RSS rise (VmHWM)" if rss else "peak Python allocations (tracemalloc)"
    print(
        f"inputs: {len(rows)} ({args.mutations} mutations, seed {args.seed}; {len(rows) - args.mutations} bombs)"
    )
    print(
        f"outcomes: {sum(r[4] == 'read' for r in rows)} read, {sum(r[4] == 'ConfigError' for r in rows)} ConfigError, {len(escaped)} escaped"
    )
    print(f"max seconds: {slowest[2]:.3f} ({slowest[0]!r}, {slowest[1]:,} bytes)")
    print(f"max {memory}: {largest[3]:.1f} MB ({largest[0]!r}, {largest[1]:,} bytes)")
    print("slowest five:")
    for name, size, seconds, peak, outcome in sorted(rows, key=lambda row: -row[2])[:5]:
        print(f"  {seconds:7.3f} s  {peak:7.1f} MB  {size:>10,} bytes  {outcome:12}  {name}")
    for row in escaped:
        print(f"ESCAPED: {row}")


if __name__ == "__main__":
    main()
