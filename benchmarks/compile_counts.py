"""How often ``functrain demo``, the examples and the notebook compile, and how long compiling takes.

Each workload runs in a child process with its own empty inductor cache (``--warm`` reuses one per
workload), imports functrain and runs the examples of ``--repo`` (default: this checkout; give an export of
an older commit for a before/after pair) and, when it ends, reports every ``CompiledStep`` it made: name,
``num_compiles``, ``compile_seconds`` and the recompile reasons. One JSON line per workload goes to stdout
(and to ``--out``), then a table.

    python benchmarks/compile_counts.py                          # demo, 01-04, the notebook
    python benchmarks/compile_counts.py 01 demo --repo /tmp/old  # functrain from another checkout

Workloads: ``demo`` (``functrain demo``, its default epochs), ``01``..``04`` (``examples/0N_*.py`` as a
newcomer runs them), ``notebook`` (the code cells of ``examples/train_digits.ipynb``, in order,
matplotlib headless). Times are wall times on a shared machine: compare counts, and seconds only within
one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("demo", "01", "02", "03", "04", "notebook")

# Runs in the child: the workload, then a report of every CompiledStep still reachable.
CHILD = r"""
import json, os, runpy, sys, time
kind, target, report = sys.argv[1], sys.argv[2], sys.argv[3]
from functrain.jit import CompiledStep
made = []  # every CompiledStep the workload creates, kept alive for the report
_init = CompiledStep.__init__
def _recording_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    made.append(self)
CompiledStep.__init__ = _recording_init
start = time.perf_counter()
if kind == "demo":
    from functrain import cli
    cli.main(["demo", f"output_dir={target}"])
elif kind == "script":
    sys.argv = [target]
    runpy.run_path(target, run_name="__main__")
else:  # notebook: its code cells, in order, in one namespace
    import matplotlib
    matplotlib.use("Agg")
    cells = json.load(open(target))["cells"]
    ns = {"__name__": "__main__"}
    for cell in cells:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            lines = [l for l in source.splitlines() if not l.lstrip().startswith(("%", "!"))]
            exec(compile("\n".join(lines), "<cell>", "exec"), ns)
wall = time.perf_counter() - start
rows = [
    {"name": getattr(s, "__name__", "step"), "compiles": s.num_compiles,
     "compile_seconds": round(s.compile_seconds, 1), "reasons": list(s.compile_reasons)}
    for s in made if s.compile
]
json.dump({"wall_seconds": round(wall, 1), "steps": rows}, open(report, "w"))
"""


def _script(examples: Path, workload: str) -> Path:
    (found,) = examples.glob(f"{workload}_*.py")
    return found


def run(workload: str, repo: Path, warm_dir: Path | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile-counts-") as tmp:
        cache = warm_dir / workload if warm_dir else Path(tmp) / "inductor"
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(cache),
            "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
            "FUNCTRAIN_OUT": str(Path(tmp) / "out"),
            "FUNCTRAIN_PLOT": str(Path(tmp) / "curves.png"),
            "MPLBACKEND": "Agg",
        }
        report = Path(tmp) / "report.json"
        if workload == "demo":
            kind, target = "demo", str(Path(tmp) / "demo_run")
        elif workload == "notebook":
            kind, target = "notebook", str(repo / "examples" / "train_digits.ipynb")
        else:
            kind, target = "script", str(_script(repo / "examples", workload))
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, kind, target, str(report)],
            cwd=tmp, env=env, capture_output=True, text=True,
        )  # fmt: skip
        out: dict = {"workload": workload, "repo": str(repo), "process_seconds": time.perf_counter() - start}
        if proc.returncode != 0 or not report.exists():
            out["error"] = proc.stderr[-2000:]
            return out
        out.update(json.loads(report.read_text()))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=list(WORKLOADS), help=f"any of {WORKLOADS}")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose functrain is imported")
    parser.add_argument("--warm", type=Path, default=None, help="a folder of per-workload inductor caches")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    args = parser.parse_args()
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {WORKLOADS}")
    results = []
    for workload in args.workloads:
        result = run(workload, args.repo.resolve(), args.warm)
        results.append(result)
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")
    print("\n| workload | steps compiled | compiles | compile s | wall s |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['workload']} | failed | | | |")
            continue
        names = ", ".join(f"{s['name']}x{s['compiles']}" for s in r["steps"])
        compiles = sum(s["compiles"] for s in r["steps"])
        seconds = sum(s["compile_seconds"] for s in r["steps"])
        print(f"| {r['workload']} | {names} | {compiles} | {seconds:.0f} | {r['wall_seconds']:.0f} |")


if __name__ == "__main__":
    main()
