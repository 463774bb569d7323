"""GPU training steps: GPT-2 small and ResNet-50 in bf16, plain PyTorch against functrain's one graph.

Workloads (``--quick`` shrinks both to a few layers and tiny inputs, for a smoke run on any device):

    gpt2        GPT-2 small: 12 layers, d_model 768, 12 heads, seq 1024, batch 16, vocab 50257, untied LM
                head (163M parameters, the model issue 10 measured); no transformers dependency
    resnet50    ResNet-50 (torchvision's when importable, else the same network defined here), 224x224,
                batch 128, channels_last weights and images

Variants (all under bf16 autocast with float32 weights, AdamW lr 1e-3, weight decay 0.01):

    eager-fused        model(x), loss.backward(), torch.optim.AdamW(fused=True)
    compile-model      torch.compile(model), fused AdamW
    compile-loss       torch.compile(model + loss), fused AdamW
    compile-opt        torch.compile(model + loss) and torch.compile(opt.step) (foreach AdamW, compiled)
    ft-eager           functrain's step uncompiled (jit(compile=False)): the cheap tier (issue #33)
    ft-jit             functrain.jit(make_train_step(..., precision="bf16")): forward, backward, AdamW, one graph
    ft-donate          the same with donate=True

functrain's states are created with ``TrainState.create(..., copy=False)`` (sharing the model's weights).
Each variant runs in a fresh process, twice with the same empty-then-filled ``TORCHINDUCTOR_CACHE_DIR``:
compile time cold (first run) and warm (second run) is the first step's time minus a steady step's.
ms/step is timed with CUDA events over ``--steps`` steps after warm-up, the median of ``--repeats``
such windows (host clock on the CPU); peak memory is ``torch.cuda.max_memory_allocated`` over the timed
steps (reset after warm-up; on the CPU the process's peak RSS instead).

Usage:
    python benchmarks/gpu.py                                   # on a GPU: writes benchmarks/results/gpu.md
    python benchmarks/gpu.py --workloads gpt2 --variants compile-loss ft-jit ft-donate
    python benchmarks/gpu.py --quick --device cpu --out /tmp/gpu-smoke.md    # smoke run, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

VARIANTS = ("eager-fused", "compile-model", "compile-loss", "compile-opt", "ft-eager", "ft-jit", "ft-donate")
EAGER = ("eager-fused", "ft-eager")  # nothing to compile: one run, no compile column
BASELINES = ("eager-fused", "compile-model", "compile-loss", "compile-opt")
WORKLOADS = ("gpt2", "resnet50")


# ------------------------------------------------------------------------------------------ GPT-2


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 (pre-norm blocks, learned positions, no dropout); the LM head is not tied to the embedding."""

    def __init__(self, vocab: int = 50257, seq: int = 1024, d: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


# ------------------------------------------------------------------------------------------ ResNet-50


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """torchvision's ResNet-50 layout (v1.5: stride in the 3x3 conv) for ``blocks=(3, 4, 6, 3)``, ``base=64``."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, cin = [], base
        for i, n in enumerate(blocks):
            width = base * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def resnet50(quick: bool) -> nn.Module:
    if quick:
        return ResNet(blocks=(1, 1, 1, 1), base=8, classes=10)
    try:
        import torchvision

        return torchvision.models.resnet50()
    except ImportError:
        return ResNet()


# ------------------------------------------------------------------------------------------ workloads


def build(
    workload: str, quick: bool, device: torch.device
) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    """``(model, batch, criterion)`` on ``device``, from fixed seeds."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if workload == "gpt2":
        vocab, seq, batch = (512, 32, 2) if quick else (50257, 1024, 16)
        model = GPT2(vocab, seq, 64, 2, 4) if quick else GPT2(vocab, seq)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return model.to(device), (tokens[:, :-1].to(device), tokens[:, 1:].to(device)), token_loss
    size, batch, classes = (32, 4, 10) if quick else (224, 128, 1000)
    model = resnet50(quick).to(device, memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, generator=g).to(device, memory_format=torch.channels_last)
    return model, (x, torch.randint(0, classes, (batch,), generator=g).to(device)), F.cross_entropy


def make_variant(name: str, workload: str, quick: bool, device: torch.device, jit_kwargs: dict) -> Any:
    """A zero-argument callable running one training step; ``.compiled`` is functrain's step, if any."""
    model, (x, y), criterion = build(workload, quick, device)
    model.train()
    if name in BASELINES:
        fused = name != "compile-opt"
        opt = torch.optim.AdamW(
            model.parameters(), lr=common.LR, weight_decay=common.WEIGHT_DECAY, fused=fused, foreach=not fused
        )
        forward = torch.compile(model) if name == "compile-model" else model

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return criterion(forward(x), y)

        if name in ("compile-loss", "compile-opt"):
            loss_of = torch.compile(loss_of)
        opt_step = torch.compile(opt.step) if name == "compile-opt" else opt.step

        def torch_step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_of(x, y).backward()
            opt_step()

        return torch_step

    if name == "ft-eager":
        jit_kwargs = {**jit_kwargs, "compile": False}
    return common.ft_step_fn(
        model, criterion, (x, y), donate=name == "ft-donate", jit_kwargs=jit_kwargs, precision="bf16"
    )


# ------------------------------------------------------------------------------------------ one variant


def window_ms(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Milliseconds per step over ``steps`` steps: CUDA events on a GPU, the host clock elsewhere."""
    if device.type != "cuda":
        return common.timed(fn, steps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child(workload: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: first-step time, steady ms/step and peak memory of one variant."""
    device = torch.device(args.device)
    fn = make_variant(variant, workload, args.quick, device, json.loads(args.jit_kwargs or "{}"))
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        common.reset_peak_rss()
    windows = [window_ms(fn, args.steps, device) for _ in range(args.repeats)]
    median, low, high = common.median_spread(windows)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = common.peak_rss_mb() / 1024
    compiled = getattr(fn, "compiled", None)
    phases = compile_phases() if variant not in EAGER else {}
    return {
        "phases": phases,
        "ms": median,
        "iqr": [low, high],
        "compile_s": max(first_s - median / 1e3, 0.0),
        "peak_gib": peak,
        "compiles": compiled.num_compiles if compiled is not None else None,
    }


def compile_phases() -> dict[str, float]:
    """Seconds of this process's compile in dynamo's trace, AOTAutograd and inductor (``compile_times``)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import compile_times

    times = dict(zip(*compile_times(repr="csv", aggregate=True)))
    names = {
        "trace": "bytecode_tracing",
        "aot": "create_aot_dispatcher_function",
        "inductor": "compile_fx_inner",
    }
    return {k: round(float(times.get(v, 0.0)), 1) for k, v in names.items()}


def run_child(workload: str, variant: str, cache_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = ["--child", workload, variant, "--device", args.device]
    cmd += ["--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--jit-kwargs", args.jit_kwargs] if args.jit_kwargs else []
    return common.run_child(__file__, cmd, f"child {workload}/{variant}", TORCHINDUCTOR_CACHE_DIR=cache_dir)


def measure(workload: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Cold then warm run of one variant (one fresh process each); the eager variant runs once."""
    with tempfile.TemporaryDirectory(prefix="functrain-inductor-") as cache:
        cold = run_child(workload, variant, cache, args)
        warm = run_child(workload, variant, cache, args) if variant not in EAGER else None
    result = dict(warm or cold, cold_s=cold["compile_s"], warm_s=warm["compile_s"] if warm else None)
    result["phases"] = {"cold": cold.get("phases", {}), "warm": (warm or {}).get("phases", {})}
    if variant in EAGER:
        result["cold_s"] = None
    return result


# ------------------------------------------------------------------------------------------ report


def table(workload: str, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    base = {v: r for v, r in results.items() if v in BASELINES}
    best_ms = min((r["ms"] for r in base.values()), default=math.nan)
    best_mem = min((r["peak_gib"] for r in base.values()), default=math.nan)
    memory = "peak GiB (max_memory_allocated)" if args.device.startswith("cuda") else "peak RSS GiB"
    rows = [
        f"**{workload}** — {describe(workload, args.quick)}",
        "",
        f"| variant | ms/step | IQR | vs best PyTorch | {memory} | vs best PyTorch | compile cold s "
        "| compile warm s | compiles | cold trace / AOT / inductor s | warm trace / AOT / inductor s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    def phases(p: dict[str, float]) -> str:
        return " / ".join(f"{p[k]:.1f}" for k in ("trace", "aot", "inductor")) if p else "-"

    for v, r in results.items():
        rows.append(
            f"| {v} | {r['ms']:.2f} | {r['iqr'][0]:.2f}–{r['iqr'][1]:.2f} | {r['ms'] / best_ms:.2f}x "
            f"| {r['peak_gib']:.2f} | {r['peak_gib'] / best_mem:.2f}x | {sec(r['cold_s'])} | {sec(r['warm_s'])} "
            f"| {r['compiles'] if r['compiles'] is not None else '-'} "
            f"| {phases(r['phases']['cold'])} | {phases(r['phases']['warm'])} |"
        )
    return "\n".join(rows)


def describe(workload: str, quick: bool) -> str:
    if workload == "gpt2":
        return "GPT-2 2x64, seq 32, batch 2 (quick)" if quick else "GPT-2 small 12x768, seq 1024, batch 16"
    return "ResNet (1,1,1,1) base 8, 32x32, batch 4 (quick)" if quick else "ResNet-50, 224x224, batch 128"


def machine(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
        return f"{name}, torch {torch.__version__} (CUDA {torch.version.cuda}); host: {common.machine()}"
    return common.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny models and inputs (a smoke run)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=5, help="timed windows (the median is reported)")
    p.add_argument("--warmup", type=int, default=5, help="steps after the first before timing")
    p.add_argument("--jit-kwargs", default=None, help="JSON dict passed to functrain.jit (experiments)")
    p.add_argument("--out", default=None, help="markdown file (default: results/gpu.md for a full GPU run)")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu.py: no CUDA device here; run it on a GPU machine or pass --quick --device cpu")

    started = time.strftime("%Y-%m-%d %H:%M")
    sections = []
    for workload in args.workloads:
        results = {}
        for variant in args.variants:
            results[variant] = r = measure(workload, variant, args)
            print(f"  {workload}/{variant}: {r['ms']:.2f} ms/step, {r['peak_gib']:.2f} GiB", flush=True)
        sections.append(table(workload, results, args))
        print(sections[-1] + "\n", flush=True)
    text = "\n\n".join(
        [
            f"Run {started} on {machine(args.device)}",
            f"Command: python benchmarks/gpu.py {' '.join(sys.argv[1:])}".rstrip(),
            *sections,
        ]
    )
    out = args.out or (None if args.quick else str(Path(__file__).parent / "results" / "gpu.md"))
    if out:
        common.write_report(text, out, echo=False)


if __name__ == "__main__":
    main()
