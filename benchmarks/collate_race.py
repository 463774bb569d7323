"""Stress: short compiled runs with dict batches whose prefetch thread collates while the step compiles.

The first-week crash with a Hugging Face model in ``ft.Trainer`` (issue 31, item 3): the prefetch thread's
``collate`` raised ``CollateError`` between two structures that print identically, while the main thread
(re)compiled the step. Cause: ``torch.compiler.is_compiling()`` reads a process-global flag, and
``functrain.tree.flatten`` took its traced fast path (a ``DictSpec``) for some samples of a batch on
the prefetch thread. Each run here is a fresh process (a fresh dynamo), a tiny BERT trained by
``ft.Trainer`` with its defaults on dict samples (40 examples, batch 16: a short last batch and a
recompile at the epoch boundary), or the same with ``ft.fit`` (``--job fit``). Those hit the race only
where a compile starts or ends while the prefetch thread is inside a collate: 4 of 4 Trainer runs on a
quiet machine, 0 of 4 here under a load of 6 on 2 cores. ``--job threads`` makes the window wide: one
process in which a thread collates 64-sample dict batches in a loop while the main thread compiles
fresh functions (dynamo's ``eager`` backend), counting the batches that raised.

    python benchmarks/collate_race.py --runs 8 [--job trainer|fit|threads]

Prints one line per run (ok, or the error) and the count of failures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap

JOB = textwrap.dedent(
    """
    import sys, torch, transformers
    import functrain as ft
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 30, (40, 8), generator=g)
    data = [{"input_ids": ids[i], "labels": ids[i, 0] % 3} for i in range(40)]
    config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    job, out = sys.argv[1], sys.argv[2]
    if job == "trainer":
        cfg = ft.TrainerConfig(output_dir=out, epochs=2, batch_size=16, progress_bar=False,
            print_summary=False, overwrite_output_dir=True)
        ft.Trainer(model, cfg, train_dataset=data, eval_dataset=data[:16]).train()
    else:
        state = ft.TrainState.create(model, ft.optim.adamw(1e-3), seed=0)
        step = ft.jit(ft.make_train_step(model, lambda out, batch: out.loss))
        ft.fit(state, step, ft.data.Loader(data, batch_size=16, key=ft.random.key(0)), epochs=2,
            progress_bar=False)
    print("ok")
    """
)

THREADS = textwrap.dedent(
    """
    import threading, torch
    from functrain.data import collate, CollateError
    samples = [{"input_ids": torch.arange(8) + i, "labels": torch.tensor(i % 3)} for i in range(64)]
    stop, counts = threading.Event(), {"batches": 0, "errors": 0}
    def host():
        while not stop.is_set():
            try:
                collate(samples)
            except CollateError:
                counts["errors"] += 1
            counts["batches"] += 1
    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    for i in range(10):
        torch._dynamo.reset()
        def f(x):
            for j in range(100):
                x = torch.sin(x) + j
            return x
        torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    stop.set()
    thread.join()
    print(f"{counts['errors']} of {counts['batches']} batches raised CollateError")
    print("ok" if counts["errors"] == 0 else "raised")
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--job", choices=["trainer", "fit", "threads"], default="trainer")
    args = parser.parse_args()
    failures = 0
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run(
                [sys.executable, "-c", THREADS if args.job == "threads" else JOB, args.job, out],
                capture_output=True,
                text=True,
                timeout=900,
            )
        ok = done.returncode == 0 and done.stdout.strip().endswith("ok")
        failures += not ok
        said = done.stdout.strip().splitlines()[:-1] if args.job == "threads" else []
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        print(f"run {i + 1}: {'ok' if ok else 'FAILED: ' + last[:300]}", *said, flush=True)
    print(f"{args.job}: {failures} of {args.runs} runs failed")


if __name__ == "__main__":
    main()
