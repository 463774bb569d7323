"""The cheap tier's own cost: functrain's eager (uncompiled) step, ``ft.fit`` and ``ft.Trainer(compile=False)``
against a plain eager PyTorch loop, on the two jobs of issue 33.

Jobs (each side builds its model from the same seed; AdamW lr 1e-3, weight decay 0.01; one thread):

    bert     a tiny Hugging Face BertForSequenceClassification (2 layers, hidden 64, random config),
             1024 dict samples of 32 token ids, batch 16, 2 epochs: 128 steps
    digits   a BatchNorm CNN on sklearn's digits (1437 training images, 1x8x8), batch 64, 10 epochs:
             230 steps, each epoch ending with a short batch of 29

Rows:

    step     ms per training step over the same pre-collated batches: ``torch`` (``model(x)``,
             ``loss.backward()``, ``torch.optim.AdamW(foreach).step()``, ``zero_grad(set_to_none=True)``),
             ``ft-step`` (``make_train_step`` with ``ft.optim.adamw``, called as it is, no jit) and
             ``ft-trainer-step`` (the step ``ft.Trainer(compile=False)`` runs: its optimizer and the
             non-finite skip)
    call     seconds of the whole training call: the ``torch`` loop with its ``DataLoader``,
             ``ft.fit`` with the eager step and ``ft.data.Loader``, ``ft.Trainer(..., compile=False)``
             built and trained with its defaults (checkpoints each epoch, logs, no progress bar)

Both sides run in this one process, interleaved: each round runs every variant once, in a rotated order;
the table gives medians over rounds and the ratio to the ``torch`` row. A child process measures
``import functrain``, building a ``Trainer`` (digits) and whether ``torch._dynamo`` / ``torch._inductor``
were imported by then and after a ``compile=False`` run (medians of ``--children`` fresh processes).

Usage:
    python benchmarks/eager_step.py                       # both jobs, writes benchmarks/results/eager_step.md
    python benchmarks/eager_step.py --jobs digits --rounds 3 --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

LR, WEIGHT_DECAY = common.LR, common.WEIGHT_DECAY


def _scratch() -> str:
    """A new folder for a Trainer's run directory, removed when this process exits."""
    path = tempfile.mkdtemp(prefix="eager-step-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# ------------------------------------------------------------------------------------------ jobs


class DigitsCNN(nn.Module):
    """Two conv-BatchNorm-ReLU blocks, a max-pool and a linear head, for 1x8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@dataclass(frozen=True)
class Job:
    name: str
    make_model: Callable[[], nn.Module]
    dataset: Any  # samples: a list of dicts (bert) or a TensorDataset (digits)
    batch_size: int
    epochs: int
    torch_loss: Callable[[nn.Module, Any], torch.Tensor]  # the eager loop's loss of a collated batch
    ft_loss: Callable[[Callable[..., Any], Any], Any]  # functrain's loss_fn(model, batch)


def _bert_job() -> Job:
    import transformers

    config = transformers.BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=64, num_labels=2,
    )  # fmt: skip
    transformers.logging.set_verbosity_error()

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification(config)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (1024, 32), generator=g)
    samples = [{"input_ids": ids[i], "labels": ids[i, 0] % 2} for i in range(len(ids))]
    return Job(
        "bert", make_model, samples, 16, 2,
        torch_loss=lambda model, batch: model(**batch).loss,
        ft_loss=lambda model, batch: model(**batch).loss,
    )  # fmt: skip


def _digits_job() -> Job:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, _, y_train, _ = train_test_split(x, y, test_size=0.2, random_state=0)
    images = torch.tensor(x_train, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    dataset = torch.utils.data.TensorDataset(images, torch.tensor(y_train))

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return DigitsCNN()

    return Job(
        "digits", make_model, dataset, 64, 10,
        torch_loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        ft_loss=None,  # type: ignore[arg-type]  # set below: ft.supervised_loss needs functrain imported
    )  # fmt: skip


def make_job(name: str) -> Job:
    import functrain as ft

    if name == "bert":
        return _bert_job()
    job = _digits_job()
    return Job(**{**job.__dict__, "ft_loss": ft.supervised_loss(F.cross_entropy)})


def _torch_loader(job: Job, seed: int = 0) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        job.dataset, batch_size=job.batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)


# ------------------------------------------------------------------------------------------ step rows


def step_variants(job: Job, batches: list[Any]) -> dict[str, Callable[[], None]]:
    """``{name: run one pass over batches}``, each on its own copy of the job's model."""
    import functrain as ft

    model = job.make_model().train()
    opt = _adamw(model)

    def torch_pass() -> None:
        for batch in batches:
            loss = job.torch_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    ft_model = job.make_model().train()
    box = [ft.TrainState.create(ft_model, ft.optim.adamw(LR, weight_decay=WEIGHT_DECAY))]
    step = ft.make_train_step(ft_model, job.ft_loss)

    def ft_pass() -> None:
        for batch in batches:
            box[0], _ = step(box[0], batch)

    trainer = _trainer(job, _scratch())
    trainer_step, tbox = trainer._jit("train"), [trainer.state]

    def trainer_pass() -> None:
        for batch in batches:
            tbox[0], _ = trainer_step(tbox[0], batch)

    return {"torch": torch_pass, "ft-step": ft_pass, "ft-trainer-step": trainer_pass}


# ------------------------------------------------------------------------------------------ call rows


def _trainer(job: Job, out: str) -> Any:
    import functrain as ft

    config = ft.TrainerConfig(
        output_dir=out, epochs=job.epochs, batch_size=job.batch_size, compile=False, progress_bar=False,
        print_summary=False, optimizer={"name": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
    )  # fmt: skip
    return ft.Trainer(job.make_model(), config, train_dataset=job.dataset)


def call_variants(job: Job) -> dict[str, Callable[[], None]]:
    """``{name: one whole training call}``; each builds its model first (outside the timed part)."""
    import functrain as ft

    def torch_call() -> Callable[[], None]:
        model = job.make_model().train()

        def run() -> None:
            opt = _adamw(model)
            for _ in range(job.epochs):
                for batch in _torch_loader(job):
                    loss = job.torch_loss(model, batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

        return run

    def fit_call() -> Callable[[], None]:
        model = job.make_model()

        def run() -> None:
            state = ft.TrainState.create(model, ft.optim.adamw(LR, weight_decay=WEIGHT_DECAY))
            loader = ft.data.Loader(job.dataset, batch_size=job.batch_size, key=ft.random.key(0))
            ft.fit(
                state, ft.make_train_step(model, job.ft_loss), loader, epochs=job.epochs, progress_bar=False
            )

        return run

    def trainer_call() -> Callable[[], None]:
        out = _scratch()

        def run() -> None:  # a fresh output_dir each call (a rerun would write <out>-N beside it)
            _trainer(job, tempfile.mkdtemp(dir=out)).train()

        return run

    return {"torch": torch_call, "ft.fit": fit_call, "ft.Trainer": trainer_call}


# ------------------------------------------------------------------------------------------ child

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import functrain as ft
t2 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import eager_step
job = eager_step.make_job("digits")
t3 = time.perf_counter()
trainer = eager_step._trainer(job, eager_step._scratch())
t4 = time.perf_counter()
built = {m: m in sys.modules for m in ("torch._dynamo", "torch._inductor")}
trainer.train()
trained = {m: m in sys.modules for m in ("torch._dynamo", "torch._inductor")}
print(json.dumps({"import torch": t1 - t0, "import functrain": t2 - t1, "Trainer(...)": t4 - t3,
                  "built": built, "trained": trained}))
"""


def child_rows(n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(Path(__file__).resolve().parent)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"the import child failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


# ------------------------------------------------------------------------------------------ main


def rounds(fns: dict[str, Callable[[], Any]], n: int, scale: float) -> dict[str, dict[str, list[float]]]:
    """``{name: {"wall": [...], "cpu": [...]}}``, one value per round times ``scale``: every round runs
    each function once, starting one later each round. CPU time is this process's (one thread): what the
    other jobs of a loaded machine add to the wall time, it leaves out."""
    names = list(fns)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in names}
    for r in range(n):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            w0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            times[name]["wall"].append((time.perf_counter() - w0) * scale)
            times[name]["cpu"].append((time.process_time() - c0) * scale)
    return times


def table(title: str, unit: str, times: dict[str, dict[str, list[float]]]) -> list[str]:
    """Medians over rounds and their ratios to the ``torch`` row (of the medians; and the median of
    the per-round ratios, each round's variants run back to back)."""
    lines = [
        f"### {title}",
        "",
        f"| variant | wall {unit} | / torch | per round | CPU {unit} | / torch | per round |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, kinds in times.items():
        cells = []
        for kind in ("wall", "cpu"):
            xs, base = kinds[kind], times["torch"][kind]
            med = statistics.median(xs)
            per_round = statistics.median(x / b for x, b in zip(xs, base))
            cells.append(f"{med:.2f} | {med / statistics.median(base):.2f}x | {per_round:.2f}x")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", default=["bert", "digits"], choices=["bert", "digits"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--call-rounds", type=int, default=None, help="rounds of whole calls (default: --rounds)"
    )
    parser.add_argument("--children", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "eager_step.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        "# eager_step: functrain's eager step, fit and Trainer(compile=False) against a plain eager loop",
        "",
        f"{common.machine()}; load average before: {common.load_average()}",
        "",
    ]
    print("\n".join(lines), flush=True)
    for name in args.jobs:
        job = make_job(name)
        batches = list(_torch_loader(job, seed=1))
        steps = step_variants(job, batches)
        for fn in steps.values():  # warm-up: allocator, first-call caches
            fn()
        times = rounds(steps, args.rounds, 1e3 / len(batches))
        part = table(f"{name}: one step ({len(batches)} steps a pass)", "ms", times)
        call_rounds = args.rounds if args.call_rounds is None else args.call_rounds
        if call_rounds:
            calls = {k: make() for k, make in call_variants(job).items()}
            times = rounds(calls, call_rounds, 1.0)
            part += table(f"{name}: the whole training call ({job.epochs} epochs)", "s", times)
        print("\n".join(part), flush=True)
        lines += part
    if args.children:
        kids = child_rows(args.children)
        part = [
            "### import and construction (digits, fresh processes)",
            "",
            "| what | s (median) |",
            "|---|---:|",
        ]
        for key in ("import torch", "import functrain", "Trainer(...)"):
            part.append(f"| {key} | {statistics.median(k[key] for k in kids):.3f} |")
        part += [
            "",
            f"torch._dynamo / torch._inductor imported after building the Trainer: {kids[0]['built']}; "
            f"after its compile=False run: {kids[0]['trained']}",
            "",
        ]
        print("\n".join(part), flush=True)
        lines += part
    lines.append(f"load average after: {common.load_average()}")
    common.write_report("\n".join(lines), args.out, echo=False)


if __name__ == "__main__":
    main()
