"""How fast the ``functrain`` command refuses a bad run, against ``python -c "import torch"``.

Each refusal is checked before torch or the user's code is imported, so it should answer in a fraction
of torch's import time. Every measurement is a fresh process (cold interpreter and imports; the page
cache is as warm as the machine's, unless ``--drop-caches`` may empty it, which needs root); the cases
are interleaved in each repeat so load changes hit them alike. Reported: the median and the min of
``--repeats`` runs, and the median's ratio to torch's import.

    python benchmarks/cli_startup.py [--repeats 5] [--out benchmarks/results/cli_startup.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# model and datasets name a module that does not exist: each refusal answers before importing it.
_RUN = """\
output_dir: {out}
model: mytask:Net
train_dataset: mytask:train_set
eval_strategy: "no"
max_steps: 10
"""

CASES: dict[str, list[str]] = {
    "import torch (baseline)": ["-c", "import torch"],
    "python (empty)": ["-c", "pass"],
    "train missing.yaml": ["-m", "functrain", "train", "missing.yaml"],
    "train --resume of a folder that is no run": ["-m", "functrain", "train", "--resume", "out"],
    "predict without test_dataset": ["-m", "functrain", "predict", "run.yaml", "--output", "p.ckpt"],
    "eval --checkpoint nope.ckpt": ["-m", "functrain", "eval", "run.yaml", "--checkpoint", "nope.ckpt"],
    "summary of a bad yaml": ["-m", "functrain", "summary", "bad.yaml"],
}


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _time(argv: list[str], cwd: Path, env: dict[str, str], drop: bool) -> tuple[float, int]:
    if drop:
        _drop_caches()
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, out.returncode


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--drop-caches", action="store_true", help="empty the page cache before each run (root)"
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the functrain checkout to time (default: this one)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    drop = args.drop_caches and _drop_caches()
    with tempfile.TemporaryDirectory(prefix="cli_startup_") as tmp:
        project = Path(tmp)
        (project / "run.yaml").write_text(_RUN.format(out=project / "out"))
        (project / "bad.yaml").write_text("epochs: [1,\nmodel: mytask:Net\n")
        (project / "out").mkdir()  # no config.yaml: not a run directory
        env = {**os.environ, "PYTHONPATH": str(args.root), "OMP_NUM_THREADS": "1"}
        times: dict[str, list[float]] = {name: [] for name in CASES}
        statuses: dict[str, set[int]] = {name: set() for name in CASES}
        for _ in range(args.repeats):
            for name, argv in CASES.items():
                seconds, status = _time(argv, project, env, drop)
                times[name].append(seconds)
                statuses[name].add(status)
    torch_median = statistics.median(times["import torch (baseline)"])
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M')}, load average at the end {load}; {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; page cache "
        f"{'dropped before each run' if drop else 'warm (not dropped)'}",
        "",
        f"functrain from {args.root}",
        "",
        f"Command: python benchmarks/cli_startup.py --repeats {args.repeats}"
        + (" --drop-caches" if args.drop_caches else ""),
        "",
        "| command | exit status | median (s) | min (s) | median vs import torch |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        status = ",".join(map(str, sorted(statuses[name])))
        lines.append(
            f"| {name} | {status} | {median:.3f} | {min(values):.3f} | {median / torch_median:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
