"""Variable-length sequences: how many compiles, how long, and how fast an epoch runs, per padding choice.

A Hugging Face-style NLP run: a tiny BERT classifier (``transformers``) on token sequences of skewed
lengths (log-normal, 4 to ``--max-length`` tokens), batches padded to their longest sequence by the collate
(as ``DataCollatorWithPadding`` does), then:

    longest             as they come: one shape per new longest length, ``jit(dynamic=False)``
    longest-dynamic     as they come, ``jit(dynamic=None)``: torch recompiles once with the changed sizes
                        symbolic
    multiple-8          padded to a multiple of 8 (HF's ``pad_to_multiple_of=8``)
    multiple-64         padded to a multiple of 64
    buckets-16          functrain's default: padded to 16 * 2**k (functrain.data.pad_sequences)
    max-length          padded to ``--max-length``: one shape
    multiple-8-dynamic  multiple of 8, ``jit(dynamic=None)``

Each variant trains ``--epochs`` epochs in a fresh process with an empty inductor cache (``--rounds``
rounds, rotated order): compiles, compile seconds (``CompiledStep.compile_seconds``), the wall time of
the whole run, and the median ms of a later epoch (compiled). A run that stops with an error is reported
with it. The ratios are against ``buckets-16`` of the same round.

Usage:
    python benchmarks/sequences.py            # writes benchmarks/results/sequences.md
    python benchmarks/sequences.py --variants longest buckets-16 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import functrain as ft
from functrain.data import sequences

# name -> (the padded length of a batch whose longest sequence is n, or None: as it comes; jit's dynamic)
VARIANTS = {
    "longest": (None, False),
    "longest-dynamic": (None, None),
    "multiple-8": (lambda n, m: 8 * math.ceil(n / 8), False),
    "multiple-64": (lambda n, m: 64 * math.ceil(n / 64), False),
    "buckets-16": (lambda n, m: sequences.bucket_length(n, 16), False),
    "max-length": (lambda n, m: m, False),
    "multiple-8-dynamic": (lambda n, m: 8 * math.ceil(n / 8), None),
}


def _examples(n: int, max_length: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.6 + math.log(24)).round().clamp(4, max_length)
    out = []
    for length in lengths.int().tolist():
        ids = torch.randint(1, 30, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids[0] % 3})
    return out


def _model(max_length: int) -> torch.nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=max_length, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def child(variant: str, args: argparse.Namespace) -> dict:
    """One variant's run in this process: compiles, compile seconds, wall seconds, later-epoch ms."""
    target, dynamic = VARIANTS[variant]
    model = _model(args.max_length)
    state = ft.TrainState.create(model, ft.optim.adamw(1e-3))

    def loss(call, batch):
        out = call(**batch)
        return out.loss, {}

    step = ft.jit(ft.make_train_step(model, loss), dynamic=dynamic)

    def collate(samples):
        batch = sequences.pad_to_longest(samples)
        if target is None:
            return batch
        return sequences.pad_sequences(batch, length=target(batch["input_ids"].shape[1], args.max_length))

    data = _examples(args.examples, args.max_length)
    loader = ft.data.Loader(
        data, args.batch_size, shuffle=False, drop_last=True, collate_fn=collate, prefetch=0
    )
    started, epoch_ms, error = time.perf_counter(), [], None
    try:
        for epoch in range(args.epochs):
            t = time.perf_counter()
            for batch in loader.epoch(epoch):
                state, metrics = step(state, batch)
            metrics["loss"].item()
            epoch_ms.append(1000 * (time.perf_counter() - t))
    except Exception as e:  # reported as the variant's result
        error = f"{type(e).__name__}: {' '.join(str(e).split())[:100]}"
    return {
        "compiles": step.num_compiles,
        "compile_s": step.compile_seconds,
        "wall_s": time.perf_counter() - started,
        "epoch_ms": statistics.median(epoch_ms[1:]) if len(epoch_ms) > 1 else None,
        "error": error,
    }


def run_child(variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="sequences-bench-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
        argv = [sys.executable, __file__, "--child", variant]
        for option in ("examples", "batch_size", "epochs", "max_length"):
            argv += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sequences.md")
    parser.add_argument("--child", metavar="VARIANT")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    names = list(args.variants)
    for r in range(args.rounds):
        for variant in names[r % len(names) :] + names[: r % len(names)]:
            results[variant].append(run_child(variant, args))
            print(variant, results[variant][-1], file=sys.stderr, flush=True)
    lengths = sorted({len(sequences.pad_to_longest(c)["input_ids"][0]) for c in _batches(args)})
    rows = [
        "| variant | compiles | compile s | run s | later epoch ms | error |",
        "|---|---|---|---|---|---|",
    ]
    for variant, rs in results.items():
        compiles, compile_s, wall, epoch = (
            _median(rs, k) for k in ("compiles", "compile_s", "wall_s", "epoch_ms")
        )
        error = next((r["error"] for r in rs if r.get("error")), "")
        rows.append(
            f"| {variant} | {compiles if compiles is not None else '-'} | "
            f"{'-' if compile_s is None else f'{compile_s:.1f}'} | {'-' if wall is None else f'{wall:.1f}'} | "
            f"{'-' if epoch is None else f'{epoch:.0f}'} | {error} |"
        )
    header = (
        f"# Variable-length sequences: compiles per padding choice (HF tiny BERT train step)\n\n"
        f"`python benchmarks/sequences.py --variants {' '.join(args.variants)} --examples {args.examples} --batch-size {args.batch_size} --epochs {args.epochs} --max-length "
        f"{args.max_length} --rounds {args.rounds}`; torch {torch.__version__}, CPU, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; {len(lengths)} distinct longest lengths per batch "
        f"({min(lengths)}-{max(lengths)}). Compile and run seconds are medians over rounds, each variant "
        "in a fresh process with an empty inductor cache (the machine was shared: compare within a round).\n\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(header + "\n".join(rows) + "\n")
    print(header + "\n".join(rows))


def _median(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def _batches(args: argparse.Namespace) -> list[list[dict]]:
    data = _examples(args.examples, args.max_length)
    full = len(data) // args.batch_size * args.batch_size
    return [data[i : i + args.batch_size] for i in range(0, full, args.batch_size)]


if __name__ == "__main__":
    main()
