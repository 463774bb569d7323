"""Seeded hostile config files for the reading fuzz test and ``benchmarks/config_fuzz.py``.

:func:`mutations` turns a valid run.yaml into ``count`` seeded variants (byte flips, truncation, inserted
YAML syntax, huge numbers, deep nesting, anchors and aliases, binary junk, other encodings);
:func:`bombs` lists hand-written worst cases (alias bombs, self-reference, deep nesting, huge files).
"""

from __future__ import annotations

import functools
import random

VALID = """\
output_dir: runs/fuzz
seed: 7
epochs: 3
batch_size: 16
shuffle: true
optimizer:
  name: adamw
  lr: 3e-4
  weight_decay: 0.01
  args: {betas: [0.9, 0.999], eps: 1.0e-8}
scheduler: {name: warmup_cosine, warmup_ratio: 0.1}
criterion: {name: CrossEntropyLoss, args: {label_smoothing: 0.1}}
max_grad_norm: 1.0
metrics: [accuracy]
eval_strategy: epoch
metric_for_best_model: accuracy
early_stopping: {monitor: accuracy, patience: 2}
save_strategy: epoch
save_total_limit: 2
compile: false
progress_bar: false
model: {target: "collections:OrderedDict", kwargs: {width: 8}}
train_dataset: "collections:OrderedDict"
"""

_SYNTAX = [
    ": ", ":", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "*nope", "!!python/object:os.system ", "!!int ",
    "!!float ", "!!bool ", "!!binary ", "!!timestamp ", "!!set ", "!!omap ", "? ", "|", ">", "'", '"', "#",
    "---\n", "...\n", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "<<: *a\n", "\t", "\n  ", "\\x", "\\u12",
    "~", "null", ".inf", "-.inf", ".nan", "0x1F", "0o17", "1_000", "1:20:30", "2001-13-45", "2001-02-30 25:00:00",
    "\ufeff", "\x00", "\x1b[31m", "\u2028", "\ud7ff", "😀",
]  # fmt: skip


def _huge_number(rng: random.Random) -> str:
    digits = rng.choice([30, 64, 65, 310, 400, 4300, 5000, 20000])
    sign = rng.choice(["", "-", "+"])
    tail = rng.choice(["", ".5", "e400", "e-400", "e99999"])
    return sign + "1" + "0" * (digits - 1) + tail


def _deep(rng: random.Random) -> str:
    depth = rng.choice([10, 63, 65, 200, 999, 1001, 3000])
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return "{a: " * depth + "1" + "}" * depth


def _aliases(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:  # a self-reference
        return rng.choice(["&s [*s]", "&s {k: *s}", "&s [1, [2, *s]]"])
    if kind == 1:  # a small bomb: width ** levels nodes
        width, levels = rng.choice([(2, 5), (9, 4), (9, 9), (10, 7)])
        lines = ["{l0: &l0 [x]"] + [
            f", l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)
        ]
        return "".join(lines) + "}"
    if kind == 2:
        return "{<<: *nope}"
    return "&a " + rng.choice(["1", "[1, 2]", "{x: 1}"])


def _mutate_text(text: str, rng: random.Random) -> str:
    op = rng.randrange(6)
    pos = rng.randrange(len(text) + 1)
    if op == 0:  # YAML syntax inserted
        return text[:pos] + rng.choice(_SYNTAX) + text[pos:]
    if op == 1:  # a value replaced by a huge number
        line = rng.choice([line for line in text.splitlines() if ": " in line])
        key = line.split(": ")[0]
        return text.replace(line, f"{key}: {_huge_number(rng)}", 1)
    if op == 2:  # deep nesting as a value
        line = rng.choice([line for line in text.splitlines() if ": " in line])
        return text.replace(line, f"{line.split(': ')[0]}: {_deep(rng)}", 1)
    if op == 3:  # anchors and aliases
        line = rng.choice([line for line in text.splitlines() if ": " in line])
        return text.replace(line, f"{line.split(': ')[0]}: {_aliases(rng)}", 1)
    if op == 4:  # a line duplicated (duplicate key) or removed
        lines = text.splitlines(keepends=True)
        i = rng.randrange(len(lines))
        return (
            "".join(lines[: i + 1] + lines[i:]) if rng.random() < 0.5 else "".join(lines[:i] + lines[i + 1 :])
        )
    return text[:pos] + rng.choice(["", " ", "\n", "  "]) * rng.randrange(1, 40) + text[pos:]


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    op = rng.randrange(4)
    if op == 0:  # bit flips
        out = bytearray(data)
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out)
    if op == 1:  # truncation
        return data[: rng.randrange(len(data) + 1)]
    if op == 2:  # binary junk
        pos = rng.randrange(len(data) + 1)
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        return data[:pos] + junk + data[pos:]
    return data[: len(data) // 2] + data  # a repeated head (duplicate keys, broken structure)


def _encode(text: str, rng: random.Random) -> bytes:
    encoding = rng.choice(
        ["utf-8", "utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1"]
    )
    if encoding == "latin-1":
        text = text.replace("runs/fuzz", "runs/fuzé")
    return text.encode(encoding, errors="surrogatepass" if encoding.startswith("utf") else "replace")


def mutations(count: int, seed: int = 0) -> list[bytes]:
    """``count`` seeded variants of `VALID`, each made of one to three mutations (text, encoding, bytes)."""
    out = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        text = VALID
        for _ in range(rng.randrange(1, 4)):
            text = _mutate_text(text, rng)
        data = _encode(text, rng)
        if rng.random() < 0.4:
            data = _mutate_bytes(data, rng)
        out.append(data)
    return out


def _laughs(levels: int, width: int) -> str:
    lines = ['lol0: &lol0 "lol"'] + [
        f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * width) + "]" for i in range(1, levels)
    ]
    return "\n".join(lines) + "\n"


@functools.cache
def bombs() -> dict[str, bytes]:
    """Hand-written worst cases by name."""
    number = "1" + "0" * 399
    texts = {
        "billion laughs": _laughs(10, 10),
        "billion laughs under a field": "optimizer:\n  args:\n"
        + "".join("    " + line + "\n" for line in _laughs(10, 10).splitlines()),
        "merge-key bomb": "a: &a {x: 1, y: 2}\n"
        + "".join(
            f"{c}: &{c} {{<<: [{', '.join(['*' + p] * 1)}], {c}1: *{p}, {c}2: *{p}}}\n"
            for p, c in zip("abcdefghijklmnopqrst", "bcdefghijklmnopqrstu", strict=True)
        ),
        "self-referencing sequence": "metrics: &m [accuracy, *m]\n",
        "self-referencing mapping": "optimizer: &o {name: sgd, args: *o}\n",
        "3000-deep flow": "optimizer: {args: {x: " + "[" * 3000 + "]" * 3000 + "}}\n",
        "3000-deep block": "".join(" " * i + f"k{i}:\n" for i in range(3000)),
        "100-deep mapping": "sweep: " + "{a: " * 100 + "1" + "}" * 100 + "\n",
        "5000-digit integer": "seed: " + "9" * 5000 + "\n",
        "400-digit optimizer.lr": f"optimizer: {{name: sgd, lr: {number}}}\n",
        "400-digit float lr": f"optimizer: {{lr: {number}.5}}\n",
        "lr 1e400": "optimizer: {lr: 1e400}\n",
        "lr .nan": "optimizer: {lr: .nan}\n",
        "huge epochs": f"epochs: {number[:60]}\n",
        "bad timestamp": "output_dir: 2001-13-45\n",
        "bad !!int": "epochs: !!int abc\n",
        "bad !!bool": "shuffle: !!bool maybe\n",
        "bad !!binary": "output_dir: !!binary '###'\n",
        "python tag": "model: !!python/object/apply:os.system ['true']\n",
        "unhashable key": "? [a, b]\n: 1\n",
        "non-string key": "1: 2\nnull: 3\n",
        "undefined alias": "epochs: *nope\n",
        "two documents": "epochs: 1\n---\nepochs: 2\n",
        "a list document": "- epochs: 1\n",
        "a scalar document": "hello\n",
        "NUL byte": "epochs: 1\x00\n",
        "empty": "",
        "only a BOM": "\ufeff",
        "tabs": "optimizer:\n\tlr: 0.1\n",
        "10 MB of a list": "sweep:\n  seed: [" + ", ".join(["1"] * 5_000_000) + "]\n",
        "3 MB comment": "epochs: 1\n" + "# " + "x" * 3_000_000 + "\n",
        "1 MB key": "k" * 1_000_000 + ": 1\n",
        "100k unknown keys": "".join(f"k{i}: {i}\n" for i in range(100_000)),
        "49,000 values (valid)": "epochs: 1\noptimizer: {args: {w: [" + ", ".join(["0.5"] * 49_000) + "]}}\n",
    }
    out = {name: text.encode("utf-8") for name, text in texts.items()}
    out["utf-16 with BOM"] = VALID.encode("utf-16")
    out["utf-16-le without BOM"] = VALID.encode("utf-16-le")
    out["utf-32"] = VALID.encode("utf-32")
    out["latin-1"] = VALID.replace("runs/fuzz", "runs/caf\u00e9").encode("latin-1")
    out["lone surrogate bytes"] = b"output_dir: \xed\xa0\x80\n"
    out["random bytes"] = random.Random(0).randbytes(4096)
    out["zip header"] = b"PK\x03\x04" + bytes(range(256))
    return out
