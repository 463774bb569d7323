"""Warm start, compile memory and Ctrl-C during a compile (issue 33, items 3-5), in fresh processes.

Jobs: ``mlp`` (64-64-10, batch 32), ``gpt`` (compile.py's tiny GPT, 2 blocks), ``bert`` (a tiny Hugging
Face BERT, 2 layers, hidden 32, batch 8 x 32 tokens). Each row is a child process that imports torch,
then functrain, builds the job and runs ``ft.jit(make_train_step(...))`` once, with ``OMP_NUM_THREADS=1``:

    eager      jit(..., compile=False)
    cold       an empty inductor cache directory (functrain's per-user cache from an earlier process)
    warm       a new process with the cache directory ``cold`` filled
    portable   an empty inductor cache, warmed by the file jit(..., cache_dir=...) wrote in ``cold``

Reported per row: seconds from the end of ``import torch`` to the end of the first step, wall and CPU
(this process plus its reaped children: a loaded machine stretches wall time, CPU much less), dynamo's
``compile_times()`` phases, and peak memory sampled every 10 ms with psutil: the main process's RSS and
the main process plus its children. A child is counted by its USS (its own pages), and not at all between
``vfork`` and ``exec``, while it still is the main process (same memory, same command line).

``--workers``: cold compiles with inductor's compile workers set to 1 and 2 C++ compilers at once
(``TORCHINDUCTOR_COMPILE_THREADS``) and with functrain's policy (:mod:`functrain.compile.workers`: one per
idle core), interleaved, each in an empty inductor cache: start time, CPU and peak memory against eager.

``--instructions``: the bytecode instructions dynamo interprets to trace each job's step (counted by
wrapping ``InstructionTranslatorBase.step``; deterministic, unlike time on a shared machine), in total and
by the source file and function they run in, inclusive of what those call; inductor is replaced by a
backend that runs dynamo's graph as it is.

``--aot-compile`` (torch >= 2.15, an experiment, not a functrain feature): dynamo's own cross-process
artifact, ``torch.compile(step).aot_compile(...)`` saved with ``save_compiled_function`` in one child
(inductor, torch's default guard filter) and loaded with ``torch.compiler.load_compiled_function`` in a
new one, the model passed as ``external_data``: what a warm start would cost if it skipped dynamo's trace.
It is not safe (benchmarks/README.md, "Warm start on torch 2.15"): torch's filter drops every global
guard and every function/class/module identity guard, and the artifact runs its own pickled copy of the
step's closures.

``--interrupt``: a fit run with checkpoints and ``Preemption`` gets SIGINT ``--delay`` seconds after
inductor receives the graph (a cold compile): seconds until the run has saved and returned, and until the
process has exited.

Usage:
    python benchmarks/warm_start.py --jobs mlp gpt bert --repeats 2
    python benchmarks/warm_start.py --workers --jobs mlp gpt --repeats 2
    python benchmarks/warm_start.py --interrupt --jobs mlp gpt --delay 0.5 3
    python benchmarks/warm_start.py --instructions --jobs mlp gpt
    python benchmarks/warm_start.py --aot-compile --jobs mlp gpt --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_T0 = time.perf_counter()
import torch  # noqa: E402

_T_TORCH = time.perf_counter()


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


_CPU_TORCH = _cpu()
HERE = Path(__file__).resolve().parent


def _job(name: str):
    """(model, batch, loss function of (model, batch)) for ``name``."""
    import torch.nn.functional as F
    from torch import nn

    import functrain as ft

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        return model, (torch.randn(32, 64), torch.randint(0, 10, (32,))), ft.supervised_loss(F.cross_entropy)
    if name == "gpt":
        sys.path.insert(0, str(HERE))
        import compile as compile_bench

        model = compile_bench.TinyGPT(2)
        return model, compile_bench.gpt_batch(), ft.supervised_loss(compile_bench.lm_loss)
    if name == "bert":
        import transformers

        config = transformers.BertConfig(
            vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, num_labels=2,
        )  # fmt: skip
        model = transformers.BertForSequenceClassification(config)
        batch = {"input_ids": torch.randint(0, 1000, (8, 32)), "labels": torch.randint(0, 2, (8,))}
        return model, batch, lambda model, batch: model(**batch).loss
    raise ValueError(name)


def child(job: str, mode: str, cache_dir: str) -> dict:
    import functrain as ft

    model, batch, loss = _job(job)
    state = ft.TrainState.create(model, ft.optim.adamw(1e-3))
    step = ft.jit(ft.make_train_step(model, loss), compile=mode != "eager", cache_dir=cache_dir)
    state, _ = step(state, batch)
    out = {"wall": time.perf_counter() - _T_TORCH, "cpu": _cpu() - _CPU_TORCH, "import_torch": _T_TORCH - _T0}
    if mode != "eager":
        from torch._dynamo.utils import compile_times, counters

        headers, values = compile_times(repr="csv", aggregate=True)
        phases = dict(zip(headers, (float(v) for v in values)))
        out["phases"] = {
            "trace": phases.get("bytecode_tracing", 0.0),
            "guards": phases.get("build_guards", 0.0),
            "inductor": phases.get("OutputGraph.call_user_compiler", 0.0),
            "g++": phases.get("compile_file", 0.0),
        }
        out["hits"] = (
            counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        )
        out["compiles"] = step.num_compiles
    return out


def aot_child(job: str, mode: str, path: str) -> dict:
    """``--aot-compile``'s child: ``save`` compiles the step with ``aot_compile`` and writes it to ``path``;
    ``load`` reads it and runs the first step (no dynamo trace)."""
    import functrain as ft

    model, batch, loss = _job(job)
    state = ft.TrainState.create(model, ft.optim.adamw(1e-3))
    step = ft.jit(ft.make_train_step(model, loss))
    step._choose_layout_handling(state)  # the function jit would hand torch.compile
    modules = {f"module:{name}": m for name, m in model.named_modules()}
    if mode == "save":
        compiled = torch.compile(step._target, fullgraph=True, backend="inductor").aot_compile(
            ((state, batch), {})
        )
        compiled.save_compiled_function(path, external_data=modules)
    else:
        with open(path, "rb") as f:
            compiled = torch.compiler.load_compiled_function(f, external_data=modules)
    compiled(state, batch)
    return {
        "wall": time.perf_counter() - _T_TORCH,
        "cpu": _cpu() - _CPU_TORCH,
        "import_torch": _T_TORCH - _T0,
    }


def aot_starts(jobs: list[str], repeats: int) -> None:
    print("| job | run | start s (wall) | CPU s |\n|---|---|---:|---:|")
    for job in jobs:
        for r in range(repeats):
            with tempfile.TemporaryDirectory(prefix="functrain-aot-") as tmp:
                env = _env(os.path.join(tmp, "inductor"), os.path.join(tmp, "user"))
                for mode in ("save", "load"):
                    cmd = [sys.executable, __file__, "--aot-child", job, mode, os.path.join(tmp, "step.aot")]
                    res, _, _ = _sampled(cmd, env)
                    print(
                        f"| {job} | aot {mode} {r + 1} | {res['wall']:.2f} | {res['cpu']:.2f} |", flush=True
                    )
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)


def _sampled(cmd: list[str], env: dict[str, str]) -> tuple[dict, float, float]:
    """Run ``cmd``; its JSON result and the peak MB of the main process and of main + children (USS)."""
    import psutil

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    main = psutil.Process(proc.pid)
    command = cmd
    peak_main = peak_tree = 0
    while proc.poll() is None:
        try:
            rss = main.memory_info().rss
            kids = 0
            for kid in main.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    # A child that has not exec'd yet (still the main's command line) is a vfork of the
                    # main process: its pages are the main's own, even by USS.
                    if kid.cmdline() != command:
                        kids += kid.memory_full_info().uss
            peak_main, peak_tree = max(peak_main, rss), max(peak_tree, rss + kids)
        except psutil.Error:
            pass
        time.sleep(0.01)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2:]} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), peak_main / 2**20, peak_tree / 2**20


def _env(inductor: str, functrain_cache: str) -> dict[str, str]:
    return dict(
        os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, OMP_NUM_THREADS="1", FUNCTRAIN_CACHE_DIR=functrain_cache
    )


def starts(jobs: list[str], repeats: int) -> None:
    print("| job | run | start s (wall) | CPU s | trace | guards | inductor | g++ | cache hits | peak main MB "
          "| main + children MB | / eager peak |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for job in jobs:
        for r in range(repeats):
            with tempfile.TemporaryDirectory(prefix="functrain-warm-") as tmp:
                user = os.path.join(tmp, "user")  # functrain's per-user cache, kept across the rows
                jit_cache = os.path.join(tmp, "jit-cache")
                rows = [("eager", "eager", "e"), ("cold", "cold", "c"), ("warm", "warm", "c"),
                        ("portable", "warm", "p")]  # fmt: skip
                base = None
                for name, mode, inductor in rows:
                    cmd = [sys.executable, __file__, "--child", job, mode, jit_cache]
                    res, main, tree = _sampled(cmd, _env(os.path.join(tmp, inductor), user))
                    base = base or tree
                    ph = res.get("phases", {})
                    cells = [
                        f"{ph[k]:.2f}" if k in ph else "" for k in ("trace", "guards", "inductor", "g++")
                    ]
                    print(
                        f"| {job} | {name} {r + 1} | {res['wall']:.2f} | {res['cpu']:.2f} | {' | '.join(cells)} | "
                        f"{res.get('hits', '')} | {main:.0f} | {tree:.0f} | {tree / base:.2f}x |",
                        flush=True,
                    )
        print(f"load average {os.getloadavg()[0]:.1f}", flush=True)


def compile_workers(jobs: list[str], repeats: int) -> None:
    print("| job | compilers | start s (wall) | CPU s | g++ (summed) | peak main MB | main + children MB "
          "| / eager peak |\n|---|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for job in jobs:
        with tempfile.TemporaryDirectory(prefix="functrain-workers-") as tmp:
            user, jit_cache = os.path.join(tmp, "user"), os.path.join(tmp, "jit-cache")
            cmd = [sys.executable, __file__, "--child", job, "eager", jit_cache]
            _, _, eager = _sampled(cmd, _env(os.path.join(tmp, "e"), user))
            print(f"| {job} | eager | | | | | {eager:.0f} | 1.00x |", flush=True)
            for r in range(repeats):
                for threads in ("1", "2", "policy"):
                    env = _env(os.path.join(tmp, f"cold-{r}-{threads}"), user)
                    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
                    if threads != "policy":
                        env["TORCHINDUCTOR_COMPILE_THREADS"] = threads
                    cmd = [sys.executable, __file__, "--child", job, "cold", jit_cache]
                    res, main, tree = _sampled(cmd, env)
                    print(
                        f"| {job} | {threads} | {res['wall']:.2f} | {res['cpu']:.2f} | {res['phases']['g++']:.2f} | "
                        f"{main:.0f} | {tree:.0f} | {tree / eager:.2f}x |",
                        flush=True,
                    )
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)


_INTERRUPTED = """
import importlib, sys, time
import torch
sys.path.insert(0, {here!r})
import warm_start
import functrain as ft
from functrain.callbacks import Preemption
jit_module = importlib.import_module("functrain.jit")
compile_graph = jit_module.compile_graph
def announcing(*args, **kwargs):
    print("COMPILING", flush=True)
    return compile_graph(*args, **kwargs)
jit_module.compile_graph = announcing
model, batch, loss = warm_start._job({job!r})
state = ft.TrainState.create(model, ft.optim.adamw(1e-3))
step = ft.jit(ft.make_train_step(model, loss))
data = torch.utils.data.TensorDataset(*batch)  # mlp and gpt: (inputs, targets)
result = ft.fit(state, step, data, batch_size=len(data) // 2, epochs=2, checkpoints=sys.argv[1],
                callbacks=[Preemption()], progress_bar=False)
print("RESULT", result.stop_reason, flush=True)
"""


def interrupts(jobs: list[str], delays: list[float]) -> None:
    print("| job | SIGINT after inductor got the graph | run returned, checkpoint saved (s) | process exited (s) "
          "| stop reason |\n|---|---:|---:|---:|---|")  # fmt: skip
    for job in jobs:
        for delay in delays:
            with tempfile.TemporaryDirectory(prefix="functrain-intr-") as tmp:
                script = Path(tmp, "child.py")
                script.write_text(_INTERRUPTED.format(here=str(HERE), job=job))
                env = _env(os.path.join(tmp, "inductor"), os.path.join(tmp, "user"))
                proc = subprocess.Popen(
                    [sys.executable, str(script), os.path.join(tmp, "ckpt")], env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True,
                )  # fmt: skip
                for line in proc.stdout:
                    if line.startswith("COMPILING"):
                        break
                time.sleep(delay)
                sent = time.perf_counter()
                proc.send_signal(signal.SIGINT)
                returned, reason = None, ""
                for line in proc.stdout:
                    if line.startswith("RESULT"):
                        returned, reason = time.perf_counter() - sent, line.split(" ", 1)[1].strip()
                proc.wait()
                exited = time.perf_counter() - sent
                saved = (
                    os.listdir(os.path.join(tmp, "ckpt")) if os.path.isdir(os.path.join(tmp, "ckpt")) else []
                )
                print(
                    f"| {job} | {delay} s | {returned if returned is None else f'{returned:.2f}'} | {exited:.2f} | "
                    f"{reason} ({len(saved)} checkpoint) |",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.1f}")


def instructions(jobs: list[str], top: int = 12) -> None:
    """Per job: dynamo's interpreted instructions for one trace of the step, and where they run."""
    import collections
    import importlib

    from torch._dynamo import symbolic_convert

    import functrain as ft

    jit_module = importlib.import_module("functrain.jit")  # `functrain.jit` is also the function
    jit_module.compile_graph = lambda gm, example_inputs, config: gm.forward  # no inductor
    inclusive: collections.Counter[str] = collections.Counter()
    original = symbolic_convert.InstructionTranslatorBase.step

    def counting(tx):  # this frame and each caller's, once per instruction
        seen, frame = set(), tx
        while frame is not None:
            code = frame.f_code
            where = f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_firstlineno} {code.co_name}"
            if where not in seen:
                seen.add(where)
                inclusive[where] += 1
            frame = getattr(frame, "parent", None)
        return original(tx)

    symbolic_convert.InstructionTranslatorBase.step = counting
    try:
        for job in jobs:
            inclusive.clear()
            torch._dynamo.reset()
            model, batch, loss = _job(job)
            state = ft.TrainState.create(model, ft.optim.adamw(1e-3))
            ft.jit(ft.make_train_step(model, loss))(state, batch)
            # the outermost frame (jit's wrapper) counts every instruction
            print(f"{job}: {max(inclusive.values())} instructions; inclusive, the largest:")
            for where, n in inclusive.most_common(top + 1)[1:]:
                print(f"  {n:7d}  {where}")
    finally:
        symbolic_convert.InstructionTranslatorBase.step = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", nargs="+", default=["mlp", "gpt", "bert"], help="--interrupt: mlp, gpt")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--interrupt", action="store_true")
    p.add_argument(
        "--workers", action="store_true", help="cold compiles with 1, 2 and the policy's compilers"
    )
    p.add_argument("--instructions", action="store_true", help="dynamo's instructions per step trace")
    p.add_argument("--delay", nargs="+", type=float, default=[0.5, 3.0])
    p.add_argument(
        "--aot-compile",
        action="store_true",
        help="dynamo's aot_compile artifact saved, then loaded (measured on torch 2.15)",
    )
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--aot-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        torch.set_num_threads(1)
        print(json.dumps(child(*args.child)))
        return
    if args.aot_child:
        torch.set_num_threads(1)
        print(json.dumps(aot_child(*args.aot_child)))
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if args.instructions:
        instructions(args.jobs)
    elif args.interrupt:
        interrupts(args.jobs, args.delay)
    elif args.aot_compile:
        aot_starts(args.jobs, args.repeats)
    elif args.workers:
        compile_workers(args.jobs, args.repeats)
    else:
        starts(args.jobs, args.repeats)


if __name__ == "__main__":
    main()
