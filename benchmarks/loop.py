"""fit()'s overhead over a bare ``for`` loop around the same compiled step (and Lightning, for comparison).

Workload: the MLP of ``benchmarks/steps.py`` (512-512-512-10, batch 256, AdamW). The data are
pre-made batches (one dataset item = one batch of 256), so loading costs almost nothing and what is
compared is the loop machinery around the step. Variants, each ``--steps`` optimizer steps per run:

    ft-bare        for batch in loader.epoch(0): state, metrics = step(state, batch)  (+ a loss read every 50)
    ft-fit         functrain.fit(state, step, loader, max_steps=N, log_steps=50), progress bar on
    torch-bare     torch.compile(model) + fused AdamW, for batch in DataLoader (+ loss.item() every 50)
    lightning      lightning.Trainer(max_steps=N, log_every_n_steps=50, progress bar on) on the same
                   compiled model, optimizer and DataLoader (if lightning is installed)

``ft-bare`` and ``ft-fit`` call the very same ``functrain.jit`` step on the same Loader. Runs are
interleaved (each repeat runs every variant once, in a rotated order); the table gives the median
ms/step over repeats (whole run, set-up included, divided by N), the interquartile range, and the
overhead over the matching bare loop.

Usage:
    python benchmarks/loop.py                  # writes benchmarks/results/loop.md
    python benchmarks/loop.py --profile        # cProfile of fit's host code (top functions)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

import functrain as ft

LOG_EVERY = 50


def make_batches(n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [common.WORKLOADS["mlp"].make_batch(g) for _ in range(n)]


def _first(items: list) -> object:
    return items[0]


def ft_variants(batches: list, steps: int) -> dict[str, Callable[[], None]]:
    model = common.build_model(common.WORKLOADS["mlp"])
    state0 = ft.TrainState.create(model, ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY))
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(F.cross_entropy)))
    # One dataset item is one batch; batch_size=1 with an unwrapping collate hands it over as it is.
    repeat = (steps + len(batches) - 1) // len(batches)
    loader = ft.data.Loader(batches * repeat, batch_size=1, shuffle=False, collate_fn=_first, prefetch=0)

    def bare() -> None:
        state = state0
        for i, batch in enumerate(loader.epoch(0)):
            if i == steps:
                break
            state, metrics = step(state, batch)
            if (i + 1) % LOG_EVERY == 0:
                float(metrics["loss"])

    def fit() -> None:
        ft.fit(state0, step, loader, max_steps=steps, log_steps=LOG_EVERY, progress_bar=True)

    for _ in range(2):
        step(state0, batches[0])  # compile before timing
    return {"ft-bare": bare, "ft-fit": fit}


def torch_variants(batches: list, steps: int, with_lightning: bool) -> dict[str, Callable[[], None]]:
    model = common.build_model(common.WORKLOADS["mlp"])
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=common.WEIGHT_DECAY, fused=True)
    repeat = (steps + len(batches) - 1) // len(batches)
    data = torch.utils.data.DataLoader(batches * repeat, batch_size=None, shuffle=False)

    def bare() -> None:
        for i, (x, y) in enumerate(data):
            if i == steps:
                break
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            if (i + 1) % LOG_EVERY == 0:
                loss.item()

    for _ in range(2):
        x, y = batches[0]
        F.cross_entropy(compiled(x), y).backward()
    out = {"torch-bare": bare}
    if with_lightning:
        out["lightning"] = lightning_variant(model, compiled, opt, data, steps)
    return out


def lightning_variant(model, compiled, opt, data, steps: int) -> Callable[[], None]:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.compiled = compiled

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.compiled(x), y)
            self.log("train/loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return opt

    module = Module()
    logdir = tempfile.mkdtemp(prefix="functrain-bench-lightning-")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    def run() -> None:
        trainer = L.Trainer(
            max_steps=steps, log_every_n_steps=LOG_EVERY, enable_progress_bar=True, enable_checkpointing=False,
            enable_model_summary=False, logger=L.pytorch.loggers.CSVLogger(logdir), accelerator="cpu", devices=1,
        )  # fmt: skip
        trainer.fit(module, data)

    return run


def profile(steps: int) -> str:
    import cProfile
    import pstats

    fns = ft_variants(make_batches(), steps)
    fns["ft-fit"]()
    prof = cProfile.Profile()
    prof.enable()
    fns["ft-fit"]()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-lightning", action="store_true")
    p.add_argument("--profile", action="store_true", help="print a cProfile of one fit() run and exit")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "loop.md"))
    args = p.parse_args()
    if args.profile:
        print(profile(args.steps))
        return

    try:
        import lightning  # noqa: F401

        have_lightning = not args.no_lightning
    except ImportError:
        have_lightning = False
        print("lightning is not installed: skipping it (pip install lightning)", file=sys.stderr)

    started = time.strftime("%Y-%m-%d %H:%M")
    batches = make_batches()
    fns = {**ft_variants(batches, args.steps), **torch_variants(batches, args.steps, have_lightning)}
    names = list(fns)
    for fn in fns.values():  # warm up: first Trainer, first fit
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append((time.perf_counter() - t0) * 1e3 / args.steps)
        print(
            f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {times[n][-1]:.2f}" for n in names),
            file=sys.stderr,
            flush=True,
        )

    # Overhead per repeat (paired: a variant and its bare loop ran in the same repeat, the order rotating
    # between repeats so neither always goes first), then the median.
    bare_of = {"ft-fit": "ft-bare", "lightning": "torch-bare"}
    rows = [
        "| variant | ms/step (median) | IQR | overhead vs bare loop (median of paired repeats) | IQR |",
        "|---|---:|---:|---:|---:|",
    ]
    for n in names:
        med, lo, hi = common.median_spread(times[n])
        if n in bare_of:
            pairs = [a / b - 1 for a, b in zip(times[n], times[bare_of[n]])]
            omed, olo, ohi = common.median_spread(pairs)
            over = f"{omed * 100:+.1f}% (vs {bare_of[n]}) | {olo * 100:+.1f}% – {ohi * 100:+.1f}%"
        else:
            over = "- | -"
        rows.append(f"| {n} | {med:.2f} | {lo:.2f}–{hi:.2f} | {over} |")
    text = "\n\n".join(
        [
            f"Run {started}, load average at the end {common.load_average()}; {common.machine()}",
            f"Command: python benchmarks/loop.py {' '.join(sys.argv[1:])}".rstrip(),
            f"MLP 512-512-512-10, batch 256, {args.steps} steps per run, {args.repeats} interleaved repeats, "
            f"logging every {LOG_EVERY} steps, progress bars on.",
            "\n".join(rows),
        ]
    )
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
