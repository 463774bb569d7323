"""Compile time (cold and warm) and per-call host overhead of functrain's one-graph step.

Compile-time variants, each in a fresh child process with its own empty inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``); compile time is the first call minus a steady
call:

    ft-cold         functrain.jit(make_train_step(...)) (forward, backward and AdamW in one graph) on
                    a machine where functrain has run before: an empty inductor cache, but functrain's
                    per-user cache (FUNCTRAIN_CACHE_DIR: the vector-ISA verdict, functrain.compile.isa_probe)
                    filled by an earlier process
    ft-first        ft-cold with functrain's per-user cache empty as well: the first compile ever
    ft-warm         the same again in a new process with the cache directory ft-cold filled
    ft-portable     a new process with an *empty* cache directory, warmed by the portable cache file
                    that ft-cold wrote (jit(..., cache_dir=...); what a run resumed elsewhere gets)
    torch-model     torch.compile(model + loss) (the backward runs through the compiled graph)
    torch-opt       torch.compile(opt.step) for torch.optim.AdamW (what the torch.compile docs show)
    torch-model-warm, torch-opt-warm
                    the same in a new process with the cache directory torch-model/torch-opt filled
                    (list them after those): what a torch user's warm start costs
    ft-trace        dynamo's trace of the step alone (a backend returning the FX graph): no inductor
    ft-flat-opt     ft-cold with AdamW on one concatenation of all leaves (optax's ``flatten``): an
                    experiment on cold compile time, not adopted (benchmarks/README.md, run F)
    ft-unfused      ft-cold with AdamW as foreach ops in the graph (``update`` + ``apply_updates``)
                    instead of torch's fused kernel as one opaque op (functrain.optim.fused, run G)
    ft-tiered       the first tier of ``compile: auto`` (functrain.compile.tiers.tiered): the eager step,
                    nothing compiled (no loop drives it to a decision): what the first step costs there

``--against DIR`` also runs ft-cold, ft-warm and ft-trace from another functrain checkout, each right
after this one's (before/after pairs in one run).

The acceptance ratio is ``ft-cold / (torch-model + torch-opt)`` (and ``ft-warm / (torch-model-warm +
torch-opt-warm)`` when those run). The workload is a tiny GPT (d 256,
4 heads, seq 64, batch 8, vocab 1024, dropout 0.1) with 2 and with 8/12 blocks.

Step time (``--step-time``, in this process): AdamW as torch's fused kernel (the default) against
AdamW as foreach ops that inductor fuses into the backward (``fused=False``), pure and donating.

Per-call overhead (``--overhead``, in this process): a 16-layer width-8 MLP with Adam (~100 state
leaves), the jitted step against the very graph inductor compiled for it, called directly with the
same flat inputs (no dynamo guards, no seeding, no pytree work); interleaved repeats, medians.

Usage:
    OMP_NUM_THREADS=1 python benchmarks/compile.py --layers 2 8          # compile children
    OMP_NUM_THREADS=1 python benchmarks/compile.py --overhead            # per-call overhead
    OMP_NUM_THREADS=1 python benchmarks/compile.py --step-time --layers 2 --repeats 15 --calls 3
    OMP_NUM_THREADS=1 python benchmarks/compile.py --profile --layers 2  # where the compile time goes
    OMP_NUM_THREADS=1 python benchmarks/compile.py --layers 2 8 --variants ft-trace --against ../old
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This checkout's functrain, or the one --against names (children get FUNCTRAIN_CHECKOUT).
sys.path.insert(0, os.environ.get("FUNCTRAIN_CHECKOUT", str(Path(__file__).resolve().parent.parent)))
import _common as common

import functrain as ft

VOCAB, D_MODEL, HEADS, SEQ, BATCH = 1024, 256, 4, 64, 8
# The variants --against runs from the other checkout too.
AGAINST = ("ft-cold", "ft-first", "ft-warm", "ft-trace")


# ------------------------------------------------------------------------------------------ model


class Block(nn.Module):
    """A pre-norm GPT block: causal self-attention (SDPA) and a 4x MLP, dropout on both residuals."""

    def __init__(self, d: int = D_MODEL, heads: int = HEADS, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2, d: int = D_MODEL) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _flat_adamw():
    """AdamW on one flat vector of all leaves, the update split back per leaf (optax's ``flatten``)."""
    inner = ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY)

    def cat(leaves):
        return torch.cat([x.reshape(-1) for x in leaves])

    def init(params):
        return inner.init({"flat": cat(ft.tree.leaves(params))})

    def update(updates, state, params=None):
        leaves, spec = ft.tree.flatten(updates)
        flat_params = None if params is None else {"flat": cat(ft.tree.leaves(params))}
        flat, state = inner.update({"flat": cat(leaves)}, state, flat_params)
        parts = flat["flat"].split([x.numel() for x in leaves])
        return ft.tree.unflatten(spec, [u.view_as(x) for u, x in zip(parts, leaves)]), state

    return ft.optim.GradientTransformation(init, update)


# ------------------------------------------------------------------------------------------ children


def _step_fn(variant: str, layers: int, cache_dir: str | None, jit_kwargs: dict):
    torch.manual_seed(0)
    model = TinyGPT(layers)
    x, y = gpt_batch()
    model.train()
    if variant.startswith("ft"):
        if variant == "ft-tiered":
            from functrain.compile.tiers import tiered

            box = [ft.TrainState.create(model, ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY))]
            tiered_step = tiered(ft.make_train_step(model, ft.supervised_loss(lm_loss)))

            def first_tier() -> None:
                box[0], _ = tiered_step(box[0], (x, y))

            return first_tier
        if variant == "ft-trace":  # dynamo's trace alone (and functrain's own work in it): no inductor
            state = ft.TrainState.create(model, ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY))
            traced = torch.compile(
                ft.make_train_step(model, ft.supervised_loss(lm_loss)), fullgraph=True,
                backend=lambda gm, example_inputs: gm.forward,
            )  # fmt: skip

            def trace_step() -> None:
                traced(state, (x, y))

            return trace_step
        kwargs = dict(jit_kwargs)
        if "cache_dir" in inspect.signature(ft.jit).parameters:
            kwargs.setdefault("cache_dir", os.path.join(cache_dir, "functrain"))
        tx = _flat_adamw() if variant == "ft-flat-opt" else None
        if variant == "ft-unfused":
            tx = ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY, fused=False)
        return common.ft_step_fn(model, lm_loss, (x, y), jit_kwargs=kwargs, tx=tx)
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=common.WEIGHT_DECAY)
    variant = variant.removesuffix("-warm")  # the same step; compile_children gives it a filled cache
    if variant == "torch-model":
        forward = torch.compile(lambda x, y: lm_loss(model(x), y))

        def model_step() -> None:
            opt.zero_grad(set_to_none=True)
            forward(x, y).backward()
            opt.step()

        return model_step
    if variant == "torch-opt":
        lm_loss(model(x), y).backward()  # grads exist; the compiled update is what is timed
        compiled_step = torch.compile(opt.step)
        return compiled_step
    raise ValueError(variant)


def child(variant: str, layers: int, cache_dir: str | None, jit_kwargs: dict, profile: bool) -> dict:
    import torch._inductor.compile_fx  # noqa: F401  (imports are not compile time)
    from torch._dynamo.utils import compile_times, counters

    fn = _step_fn(variant, layers, cache_dir, jit_kwargs)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    for _ in range(2):
        fn()
    steady = common.timed(fn, 5) / 1e3
    out = {
        "compile_s": first - steady,
        "step_ms": steady * 1e3,
        "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
    }
    if profile:
        headers, values = compile_times(repr="csv", aggregate=True)
        out["compile_times"] = {h: float(v) for h, v in zip(headers, values)}
        out["cprofile"] = _top_functions(prof)
    return out


def _top_functions(prof, n: int = 45) -> list[tuple[str, float, float]]:
    import pstats

    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, _, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        short = "/".join(file.split("/")[-2:])
        rows.append((f"{short}:{line}({name})", tottime, cumtime))
    by_cum = sorted(rows, key=lambda r: -r[2])[:n]
    by_tot = sorted(rows, key=lambda r: -r[1])[:20]
    return [*by_cum, ("--- by own time ---", 0.0, 0.0), *by_tot]


def run_child(
    variant: str,
    layers: int,
    cache_dir: str,
    jit_kwargs: dict,
    profile: bool = False,
    env_cache: str = "",
    checkout: str = "",
    functrain_cache: str = "",
) -> dict:
    cmd = [
        "--child",
        variant,
        str(layers),
        cache_dir,
        json.dumps(jit_kwargs),
        *(["--profile"] if profile else []),
    ]
    return common.run_child(
        __file__,
        cmd,
        f"child {variant}/{layers}",
        TORCHINDUCTOR_CACHE_DIR=env_cache or cache_dir,
        TRITON_CACHE_DIR=os.path.join(env_cache or cache_dir, "triton"),
        OMP_NUM_THREADS="1",
        FUNCTRAIN_CHECKOUT=checkout or str(Path(__file__).resolve().parent.parent),
        FUNCTRAIN_CACHE_DIR=functrain_cache or os.path.join(cache_dir, "functrain-user"),
    )


def compile_children(
    layers: int, variants: list[str], jit_kwargs: dict, profile: bool, against: str | None
) -> dict[str, dict]:
    """Every variant in a fresh child; with ``against``, each ft variant right after the same variant
    of that other checkout (``name (before)``), each with its own caches."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="functrain-compile-") as tmp:
        # functrain's per-user cache of a machine where functrain has run before (ft-first leaves it out).
        machine = os.path.join(tmp, "functrain-user")
        _fill_user_cache(machine)
        for v in variants:
            runs = [("", "")] + ([(" (before)", against)] if against and v in AGAINST else [])
            for suffix, checkout in runs:
                tag = "-before" if suffix else ""  # no spaces: inductor's g++ command lines split on them
                ft_cache = os.path.join(tmp, "ft" + tag)  # ft-cold fills it, ft-warm reuses it
                if v in ("ft-cold", "ft-warm"):
                    r = run_child(
                        v, layers, ft_cache, jit_kwargs, profile, checkout=checkout, functrain_cache=machine
                    )
                elif v in ("torch-model-warm", "torch-opt-warm"):  # the cache its cold variant filled
                    warm = os.path.join(tmp, v.removesuffix("-warm") + tag)
                    r = run_child(
                        v, layers, warm, jit_kwargs, profile, checkout=checkout, functrain_cache=machine
                    )
                elif v == "ft-portable":
                    # jit's cache_dir from ft-cold, but an empty inductor cache: another machine (of the
                    # same kind, where functrain has run before).
                    env_cache = os.path.join(tmp, "portable" + tag)
                    r = run_child(v, layers, ft_cache, jit_kwargs, profile, env_cache, checkout, machine)
                else:
                    fresh = os.path.join(tmp, v + tag)
                    user_cache = "" if v == "ft-first" else machine  # "": an empty one of its own
                    r = run_child(
                        v, layers, fresh, jit_kwargs, profile, checkout=checkout, functrain_cache=user_cache
                    )
                results[v + suffix] = r
                print(
                    f"  layers {layers} {v}{suffix}: compile {r['compile_s']:.1f} s, step {r['step_ms']:.1f} ms, "
                    f"cache hits fx {r['fx_cache_hits']} aot {r['aot_cache_hits']} "
                    f"(load {common.load_average()})",
                    flush=True,
                )
                if profile:
                    _print_profile(r)
    return results


def _fill_user_cache(directory: str) -> None:
    """functrain's per-user cache as an earlier process on this machine leaves it (a checkout without
    ``functrain.compile.isa_probe.cache_root`` keeps its verdict elsewhere and ignores it)."""
    os.environ["FUNCTRAIN_CACHE_DIR"] = directory
    try:
        from functrain.compile.isa_probe import vec_isa_verified
    except ImportError:
        return
    vec_isa_verified()


def _print_profile(r: dict) -> None:
    print("    compile_times (aggregate s):")
    for k, v in sorted(r["compile_times"].items(), key=lambda kv: -kv[1]):
        print(f"      {v:8.2f}  {k}")
    print("    cProfile (cumulative s / own s):")
    for name, tot, cum in r["cprofile"]:
        print(f"      {cum:8.2f} {tot:8.2f}  {name}")


# ------------------------------------------------------------------------------------------ overhead


def overhead(repeats: int, calls: int, depth: int = 16) -> dict[str, tuple[float, float, float]]:
    """Per-call time of the jitted step and of its inductor graph called directly (same flat inputs)."""
    torch.manual_seed(0)
    width = 8
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    state = ft.TrainState.create(model, ft.optim.adam(1e-3))
    n_leaves = sum(isinstance(x, torch.Tensor) for x in ft.tree.leaves(state))
    batch = (torch.randn(4, width), torch.randn(4, width))
    graphs: list = []

    from torch._inductor.compile_fx import compile_fx

    def capture(gm, example_inputs):
        compiled = compile_fx(gm, example_inputs)
        graphs.append((compiled, list(example_inputs)))
        return compiled

    # The same step through a backend that keeps the compiled graph and its inputs.
    raw = torch.compile(
        ft.make_train_step(model, ft.supervised_loss(F.mse_loss)), fullgraph=True, backend=capture
    )
    raw(state, batch)
    graph, inputs = graphs[-1]
    ft_call = common.ft_step_fn(model, F.mse_loss, batch, tx=ft.optim.adam(1e-3))
    # The same step with functrain.compile.cache_hits off: every call through dynamo's frame evaluation.
    through_dynamo = common.ft_step_fn(model, F.mse_loss, batch, tx=ft.optim.adam(1e-3))
    through_dynamo.compiled._cache_hits.enabled = False  # type: ignore[attr-defined]
    fns = {"ft step": ft_call, "ft step, direct calls off": through_dynamo}

    def direct_call() -> None:
        graph(*inputs)

    box_raw = [state]

    def raw_call() -> None:
        box_raw[0], _ = raw(box_raw[0], batch)

    fns["torch.compile'd step (dynamo guards, no functrain)"] = raw_call
    fns["graph called directly"] = direct_call
    for _ in range(20):
        for fn in fns.values():
            fn()
    times = common.interleaved(fns, repeats, calls)
    print(f"  state leaves: {n_leaves}, compiles: {ft_call.compiled.num_compiles}")  # type: ignore[attr-defined]
    return {k: common.median_spread(v) for k, v in times.items()}


def step_times(layers: int, repeats: int, calls: int) -> dict[str, tuple[float, float, float]]:
    """Step time of the tiny GPT with AdamW as torch's fused kernel (one opaque op, the default) and as
    foreach ops inside the graph (``fused=False``), pure and donating, in this process, interleaved."""
    fns = {}
    for fused in (True, False):
        for donate in (False, True):
            torch.manual_seed(0)
            model = TinyGPT(layers)
            model.train()
            tx = ft.optim.adamw(common.LR, weight_decay=common.WEIGHT_DECAY, fused=fused)
            fn = common.ft_step_fn(model, lm_loss, gpt_batch(), tx=tx, donate=donate)
            for _ in range(3):
                fn()
            fns[f"{'fused' if fused else 'in-graph'} AdamW, {'donating' if donate else 'pure'}"] = fn
    times = common.interleaved(fns, repeats, calls)
    return {k: common.median_spread(v) for k, v in times.items()}


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", nargs="+", type=int, default=[2, 8])
    p.add_argument(
        "--variants", nargs="+", default=["ft-cold", "ft-warm", "ft-portable", "torch-model", "torch-opt"]
    )
    p.add_argument("--jit-kwargs", default="{}", help="JSON dict passed to functrain.jit (experiments)")
    p.add_argument("--profile", action="store_true", help="print compile_times() and a cProfile per child")
    p.add_argument("--overhead", action="store_true", help="measure per-call overhead instead")
    p.add_argument("--step-time", action="store_true", help="fused vs in-graph AdamW step time instead")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--depths", nargs="+", type=int, default=[16, 64], help="MLP depths for --overhead")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument(
        "--against", help="another functrain checkout: its ft variants run interleaved (before/after)"
    )
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)

    if args.child:
        variant, layers, cache_dir, kw = args.child
        print(json.dumps(child(variant, int(layers), cache_dir, json.loads(kw), args.profile)))
        return
    print(f"{common.machine()}; load average {common.load_average()}", flush=True)
    if args.overhead:
        print("| MLP depth | call | ms/call (median) | IQR | minus direct (ms) |\n|---:|---|---:|---:|---:|")
        for depth in args.depths:
            res = overhead(args.repeats, args.calls, depth)
            base = res["graph called directly"][0]
            for name, (med, lo, hi) in res.items():
                print(f"| {depth} | {name} | {med:.3f} | {lo:.3f}–{hi:.3f} | {med - base:+.3f} |", flush=True)
        print(f"load average at the end {common.load_average()}")
        return
    if args.step_time:
        print("| layers | AdamW, step | ms/step (median) | IQR | / in-graph |\n|---:|---|---:|---:|---:|")
        for layers in args.layers:
            res = step_times(layers, args.repeats, args.calls)
            for name, (med, lo, hi) in res.items():
                base = res[f"in-graph AdamW, {name.split(', ')[1]}"][0]
                print(f"| {layers} | {name} | {med:.1f} | {lo:.1f}–{hi:.1f} | {med / base:.3f} |", flush=True)
        print(f"load average at the end {common.load_average()}")
        return
    jit_kwargs = json.loads(args.jit_kwargs)
    table = ["| layers | variant | compile s | step ms | fx/aot cache hits | ft / (model + opt) |",
             "|---:|---|---:|---:|---|---:|"]  # fmt: skip
    for layers in args.layers:
        res = compile_children(layers, args.variants, jit_kwargs, args.profile, args.against)
        cold = sum(res[v]["compile_s"] for v in ("torch-model", "torch-opt") if v in res)
        warm = sum(res[v]["compile_s"] for v in ("torch-model-warm", "torch-opt-warm") if v in res)
        for v, r in res.items():
            denom = warm if v.startswith("ft-warm") and warm else cold
            ratio = f"{r['compile_s'] / denom:.2f}x" if denom and v.startswith("ft") else ""
            table.append(
                f"| {layers} | {v} | {r['compile_s']:.1f} | {r['step_ms']:.1f} | "
                f"{r['fx_cache_hits']}/{r['aot_cache_hits']} | {ratio} |"
            )
    print("\n".join(table))
    print(f"load average at the end {common.load_average()}")


if __name__ == "__main__":
    main()
