"""``ft.Trainer`` with its defaults (``compile: auto``, tiered) against a plain eager PyTorch loop, whole jobs.

Two jobs of issue #33, each run start to finish in a fresh process (empty functrain and inductor caches,
one thread), in interleaved rounds:

    bert     a tiny Hugging Face BERT (BertForSequenceClassification, random small config), 2 epochs of
             64 batches of 8 sequences of 32 tokens; label: whether the tokens are drawn from the lower or
             the upper half of the vocabulary
    digits   a BatchNorm CNN on sklearn's digits (1437 train images, batch 64: 23 batches, the last
             short), 10 epochs
    digits-long  the same for 218 epochs (5014 steps: the issue's ">= 5,000 steps" run; ``--jobs
             digits-long --compiled`` compares the defaults with today's compiled run)

Variants:

    eager    for batch in DataLoader: loss = model(...); loss.backward(); AdamW.step(); zero_grad()
    ft       ft.Trainer(model, {output_dir, epochs, batch_size}, train_set).train(): every other field
             its default (compile auto, progress bar, checkpoints every epoch, model summary)
    ft-compiled  the same with compile: true (``--compiled``; cold inductor compiles: slow)
    ft-background  the ft run built from a config of import specs with compile_background: true
             (``--background``): a niced child process compiles the steps into the fresh inductor cache
             beside the run (its CPU time counted in the process's), the run switches where it pays
    ft@DIR   the ft run with functrain imported from another checkout (``--against DIR``, e.g. a
             worktree of main): before/after pairs in one script run, interleaved with the others

Python's bytecode cache is kept between the children (``PYTHONPYCACHEPREFIX``, one scratch folder per
invocation, filled by an untimed warm-up run of each job's eager and ft variants): an installed package has
its ``.pyc`` files, while a source checkout under ``PYTHONDONTWRITEBYTECODE`` would recompile functrain's
~230 modules (0.2-0.35 s CPU) in every run and charge the Trainer for it; torch's and transformers' are
cached in site-packages either way. ``--no-bytecode-cache`` measures that setting instead.

Both variants use AdamW (lr 1e-3, no weight decay: the Trainer's default) and the same data order seed;
accuracy is computed the same way (argmax on a held-out split) from the final weights. Reported per job:
the median wall time of the whole process and of the training call (from building the model to the end
of training), their ratio to the eager loop, the accuracy, and what the tier policy decided.

Usage:
    python benchmarks/tiers.py --rounds 5           # writes benchmarks/results/tiers.md
    python benchmarks/tiers.py --rounds 2 --jobs digits-long --compiled --out /tmp/long.md
    python benchmarks/tiers.py --rounds 5 --jobs bert --against ../main --out /tmp/ba.md  # before/after
    python benchmarks/tiers.py --one digits ft      # one run in this process (prints a JSON line)
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
from pathlib import Path

STARTED = time.perf_counter()

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

JOBS = {"bert": 2, "digits": 10, "digits-long": 218}  # epochs; digits-long: 5014 steps
LR = 1e-3
DEVICE = os.environ.get("TIERS_BENCH_DEVICE", "cpu")  # --device: where both variants train


# ------------------------------------------------------------------------------------------ the jobs


def bert_data():
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (512 + 256,), generator=g)
    ids = torch.randint(1, 32, (512 + 256, 32), generator=g) + 31 * labels[:, None]  # 1-31 or 32-62
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    return model, rows[:512], rows[512:], 8


class DigitsCNN(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )  # fmt: skip


def digits_data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0)
    torch.manual_seed(0)
    train = torch.utils.data.TensorDataset(xtr, ytr)
    return DigitsCNN(), train, torch.utils.data.TensorDataset(xte, yte), 64


def _logits(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, dict):
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return model(batch[0])


def _to(batch, device: str):
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return [x.to(device) for x in batch]


def accuracy(model: nn.Module, test) -> float:
    model.eval().to(DEVICE)
    loader = torch.utils.data.DataLoader(test, batch_size=256)
    right = total = 0
    with torch.no_grad():
        for batch in loader:
            batch = _to(batch, DEVICE)
            target = batch["labels"] if isinstance(batch, dict) else batch[1]
            right += int((_logits(model, batch).argmax(-1) == target).sum())
            total += len(target)
    return right / total


# ------------------------------------------------------------------------------------------ the variants


def eager_loop(job: str) -> dict:
    started, cpu = time.perf_counter(), time.process_time()
    model, train, test, batch_size = bert_data() if job == "bert" else digits_data()
    model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(
        train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(42)
    )
    model.train()
    for _ in range(JOBS[job]):
        for batch in loader:
            batch = _to(batch, DEVICE)
            if isinstance(batch, dict):
                loss = model(**batch).loss
            else:
                loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            opt.zero_grad()
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    train_s, train_cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"train_s": train_s, "train_cpu": train_cpu, "accuracy": accuracy(model, test)}


def ft_trainer(job: str, compile: bool | str) -> dict:
    import functrain as ft

    started, cpu = time.perf_counter(), time.process_time()
    model, train, test, batch_size = bert_data() if job == "bert" else digits_data()
    out = tempfile.mkdtemp(prefix="tiers-bench-")  # removed by fresh_run with its cache folder
    config = {"output_dir": out, "epochs": JOBS[job], "batch_size": batch_size, "device": DEVICE}
    if compile != "auto":
        config["compile"] = compile
    trainer = ft.Trainer(model, config, train_dataset=train)
    result = trainer.train()
    train_s, train_cpu = time.perf_counter() - started, time.process_time() - cpu
    trained = {**result.state.params, **result.state.buffers}
    model.load_state_dict({k: v for k, v in trained.items() if k in model.state_dict()})
    step = trainer._jitted["train"]
    plan = getattr(step, "plan", None)
    return {
        "train_s": train_s,
        "train_cpu": train_cpu,
        "accuracy": accuracy(model, test),
        "plan": plan.describe() if plan is not None and plan.decided_at is not None else "",
        "compiles": step.num_compiles,
    }


def job_model(job: str) -> nn.Module:
    """The job's model, for a config's import spec (``tiers:digits_model``)."""
    return (bert_data() if job == "bert" else digits_data())[0]


def job_train(job: str):
    return (bert_data() if job == "bert" else digits_data())[1]


def ft_background(job: str) -> dict:
    """``ft.Trainer`` with its defaults and ``compile_background: true``, built from a config of import
    specs as ``functrain train`` builds it (functrain.cli.main.trainer_from_config), so that its child
    process rebuilds the run and compiles it into the (fresh) inductor cache while the run goes on eagerly;
    the run switches where the warm compile pays."""
    import functrain as ft
    from functrain.cli.main import trainer_from_config

    started, cpu = time.perf_counter(), time.process_time()
    name = "bert" if job == "bert" else "digits"
    _, _, test, batch_size = bert_data() if job == "bert" else digits_data()
    config = {
        "output_dir": tempfile.mkdtemp(prefix="tiers-bench-"), "epochs": JOBS[job], "batch_size": batch_size,
        "device": DEVICE, "compile_background": True,
        "model": {"target": "tiers:job_model", "args": [name]},
        "train_dataset": {"target": "tiers:job_train", "args": [name]},
    }  # fmt: skip
    trainer = trainer_from_config(ft.TrainerConfig.from_dict(config))
    result = trainer.train()
    train_s, train_cpu = time.perf_counter() - started, time.process_time() - cpu
    model = trainer.model
    trained = {**result.state.params, **result.state.buffers}
    model.load_state_dict({k: v for k, v in trained.items() if k in model.state_dict()})
    step = trainer._jitted["train"]
    built = step.background.poll() if step.background is not None else "none"
    return {
        "train_s": train_s,
        "train_cpu": train_cpu,
        "accuracy": accuracy(model, test),
        "plan": (step.plan.describe() if step.plan.decided_at is not None else "")
        + (f" [child built in {built.cold_seconds:.0f} s, warm {built.warm_seconds:.1f} s]"
           if hasattr(built, "cold_seconds") else f" [child {built}: {step.background.failure}]"),
        "compiles": step.num_compiles,
    }  # fmt: skip


VARIANTS = {"eager": eager_loop, "ft": lambda job: ft_trainer(job, "auto")}
VARIANTS["ft-compiled"] = lambda job: ft_trainer(job, True)
VARIANTS["ft-background"] = ft_background


def one(job: str, variant: str) -> None:
    torch.set_num_threads(1)
    row = VARIANTS[variant](job)
    row.update(job=job, variant=variant, process_s=time.perf_counter() - STARTED)
    print("RESULT " + json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------ rounds


def fresh_run(job: str, variant: str, pycache: str | None = None) -> dict:
    """One run of ``variant`` in a fresh process; ``ft@DIR`` runs ``ft`` with functrain from ``DIR``."""
    load = os.getloadavg()[0]
    variant, _, checkout = variant.partition("@")
    paths = [checkout, os.environ.get("PYTHONPATH", "")] if checkout else []
    path = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)} if checkout else {}
    with tempfile.TemporaryDirectory(prefix="tiers-cache-") as cache:
        env = {
            **os.environ,
            **({"PYTHONPYCACHEPREFIX": pycache, "PYTHONDONTWRITEBYTECODE": ""} if pycache else {}),
            "TMPDIR": cache,  # the run's output_dir too
            "OMP_NUM_THREADS": "1",
            "FUNCTRAIN_CACHE_DIR": os.path.join(cache, "functrain"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
            "TQDM_DISABLE": "",
            **path,
        }
        started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(
            [sys.executable, __file__, "--one", job, variant],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{job}/{variant} failed:\n{out.stderr[-3000:]}")
    row = json.loads(lines[-1][len("RESULT ") :])
    return {
        **row,
        "variant": f"{variant}@{checkout}" if checkout else variant,
        "wall_s": wall,
        "cpu_s": cpu,
        "load": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", nargs="+", default=["bert", "digits"], choices=list(JOBS))
    parser.add_argument("--compiled", action="store_true", help="also ft.Trainer(compile=true)")
    parser.add_argument("--device", default="cpu", help="where both variants train (cpu, cuda)")
    parser.add_argument(
        "--background", action="store_true", help="also ft.Trainer(compile_background=true): a child compiles"
    )
    parser.add_argument("--one", nargs=2, metavar=("JOB", "VARIANT"))
    parser.add_argument(
        "--against", metavar="DIR", help="also the ft run with functrain imported from checkout DIR (ft@DIR)"
    )
    parser.add_argument(
        "--no-bytecode-cache", action="store_true", help="children recompile every module (no .pyc kept)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tiers.md"))
    args = parser.parse_args()
    os.environ["TIERS_BENCH_DEVICE"] = args.device  # the children's
    if args.one:
        one(*args.one)
        return
    variants = ["eager", "ft"] + (["ft-compiled"] if args.compiled else [])
    variants += ["ft-background"] if args.background else []
    variants += [f"ft@{os.path.abspath(args.against)}"] if args.against else []
    with tempfile.TemporaryDirectory(prefix="tiers-pycache-") as pycache:
        rows = rounds(args, variants, None if args.no_bytecode_cache else pycache)
    write(args, variants, rows)


def rounds(args: argparse.Namespace, variants: list[str], pycache: str | None) -> list[dict]:
    if pycache is not None:
        for job in args.jobs:  # untimed: fills the bytecode cache every timed run then reads
            # (not ft-compiled: minutes of compiling for a few .pyc)
            for variant in ["eager", "ft"] + [v for v in variants if "@" in v]:
                fresh_run(job, variant, pycache)
    rows: list[dict] = []
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]  # rotated each round
        for job in args.jobs:
            for variant in order:
                row = fresh_run(job, variant, pycache)
                rows.append(row)
                print(
                    f"round {r + 1} {job:6s} {variant:11s} load {row['load']:4.1f} "
                    f"process {row['wall_s']:6.2f} s "
                    f"({row['cpu_s']:5.2f} s CPU)  train {row['train_s']:6.2f} s ({row['train_cpu']:5.2f} s CPU)"
                    f"  accuracy {row['accuracy']:.3f}  {row.get('plan', '')}",
                    flush=True,
                )
    return rows


def write(args: argparse.Namespace, variants: list[str], rows: list[dict]) -> None:
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M')}, 1-minute load average before each run "
        f"{min(r['load'] for r in rows):.1f}-{max(r['load'] for r in rows):.1f}, at the end "
        f"{common.load_average()}; "
        f"{common.machine()}",
        "",
        f"Command: python benchmarks/tiers.py --rounds {args.rounds} --device {args.device}"
        + (" --compiled" if args.compiled else "")
        + (" --no-bytecode-cache" if args.no_bytecode_cache else "")
        + (" --background" if args.background else "")
        + (f" --against {args.against}" if args.against else ""),
        "",
        "Whole jobs in fresh processes (empty functrain and inductor caches, one thread), variants interleaved "
        "in rotated order each round. Medians over rounds; ratios to the eager loop's median, and in brackets "
        "the median of the per-round ratios. CPU: the process's user+sys time (the machine is shared: on a "
        "loaded machine wall time mostly measures the other sessions, CPU time the job).",
        "",
        "| job | variant | process wall s | ratio | process CPU s | ratio | train wall s | ratio | train CPU s "
        "| ratio | accuracy | tier decision |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for job in args.jobs:
        base = [r for r in rows if r["job"] == job and r["variant"] == "eager"]
        for variant in variants:
            mine = [r for r in rows if r["job"] == job and r["variant"] == variant]
            cells = []
            for key in ("wall_s", "cpu_s", "train_s", "train_cpu"):
                value = statistics.median(r[key] for r in mine)
                ratio = value / statistics.median(r[key] for r in base)
                paired = statistics.median(m[key] / b[key] for m, b in zip(mine, base))
                cells.append(f"{value:.2f} | {ratio:.2f} ({paired:.2f})")
            acc = statistics.median(r["accuracy"] for r in mine)
            plans = sorted({r.get("plan", "") for r in mine} - {""})
            lines.append(f"| {job} | {variant} | {' | '.join(cells)} | {acc:.3f} | {'; '.join(plans)} |")
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
