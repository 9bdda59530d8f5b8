"""Where one GPT training step's GPU time goes: kernel time per step by category, and the largest kernels.

Profiles the benchmark's bare step (bench/e2e.py `bare_step`: the same model, loss, AdamW and clipping as
the pipeline, without Lightning) under `torch.profiler` after a few warm-up steps, and sums every CUDA
kernel's time into the categories below by its name. The sum is GPU busy time, not wall time: the table
prints the wall time of the profiled steps beside it.

    python bench/profile_step.py --model gpt3-1.3b --seq-len 2048 --attention flash
    python bench/profile_step.py --seq-len 8192 --compile --set fp32_residual=true

Rows merge into bench/results/profile.json, keyed by device and case (model, T, attention, compile, --set).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e import TOKENS_PER_STEP  # noqa: E402

RESULTS = REPO / "bench" / "results"
KEEP_KERNELS = 40  # the JSON keeps this many of the largest kernels (the categories sum them all)

# First match wins, so the specific names come before the generic ones ("copy", "elementwise"). Inductor's
# kernels carry the aten ops they fused in their names (triton_red_fused_native_layer_norm_...), so they fall
# into the category of the first op named here.
CATEGORIES: list[tuple[str, str]] = [
    ("attention", r"flash|fmha|sdpa|attn"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|\bmm\b|addmm"),
    ("AdamW", r"adam"),
    ("LayerNorm", r"layer_norm|layernorm|gammabeta"),
    ("GELU", r"gelu"),
    ("cross-entropy", r"softmax|nll_loss|cross_entropy"),
    ("dtype casts and copies", r"copy|cast|_to_"),
    ("reductions", r"reduce|norm|sum"),
    ("elementwise", r"elementwise|vectorized|add|mul|fill|where|triton_poi"),
]


def category(kernel: str) -> str:
    """The CATEGORIES name of a kernel (or aten op) name, case-insensitive; 'other' if none matches."""
    name = kernel.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, name)), "other")


def kernel_times(prof, steps: int) -> dict[str, float]:
    """Milliseconds per step of each CUDA kernel name in a finished profiler."""
    out: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.key] += evt.self_device_time_total / 1e3 / steps  # microseconds -> ms
    return dict(out)


def summarize(kernels: dict[str, float]) -> dict[str, float]:
    """ms per step by category, largest first, plus 'all kernels'."""
    cats: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        cats[category(name)] += ms
    out = dict(sorted(cats.items(), key=lambda kv: -kv[1]))
    out["all kernels"] = sum(kernels.values())
    return out


def profile(step, warmup: int, steps: int) -> tuple[dict[str, float], float]:
    """(kernel ms per step by name, wall ms per profiled step)."""
    from torch.profiler import ProfilerActivity

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    return kernel_times(prof, steps), wall_ms


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected key=value, a GPTConfig field (e.g. fp32_residual=true)")
        out[key] = yaml.safe_load(value)  # as Hydra reads an override: true -> True, 0.1 -> 0.1, sdpa -> 'sdpa'
    return out


def table(row: dict, top: int) -> str:
    wall = row["wall_ms_per_step"]
    lines = [f"{row['model']} {row['batch']}×{row['seq_len']} attention={row['attention']} compile={row['compile']} "
             f"{row['set'] or ''} on {row['device']}: wall {wall:.1f} ms per step",
             "", "| kernels | ms per step | share of kernel time |", "|---|---|---|"]
    total = row["categories"]["all kernels"]
    for cat, ms in row["categories"].items():
        lines.append(f"| {cat} | {ms:.1f} | {100 * ms / total:.1f}% |")
    lines += ["", f"| largest kernels (top {top}) | ms per step |", "|---|---|"]
    for name, ms in sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {ms:.2f} |")
    return "\n".join(lines)


def _key(r: dict) -> tuple:
    return (r["device"], r["model"], r["seq_len"], r["batch"], r["attention"], r["compile"], r["set"], r.get("kernel"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt3-1.3b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP, help="batch = this // seq-len")
    ap.add_argument("--attention", default="flash")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="GPTConfig fields, e.g. fp32_residual=true")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (the table is per step)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=Path, default=RESULTS / "profile.json")
    args = ap.parse_args(argv)
    overrides = parse_sets(args.set)
    if not torch.cuda.is_available():
        raise SystemExit("bench/profile_step.py profiles CUDA kernels; no CUDA device here")

    from bench.e2e import bare_step
    from flash_kernel import KERNEL_VERSION

    batch = max(1, args.tokens_per_step // args.seq_len)
    step, _ = bare_step(args.model, args.seq_len, batch, args.attention, args.compile, **overrides)
    kernels, wall_ms = profile(step, args.warmup, args.steps)
    row = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date.today().isoformat(),
        "model": args.model, "seq_len": args.seq_len, "batch": batch, "attention": args.attention,
        "compile": args.compile, "set": " ".join(sorted(args.set)),
        **({"kernel": KERNEL_VERSION} if args.attention == "flash" else {}),
        "wall_ms_per_step": wall_ms, "categories": summarize(kernels),
        "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:KEEP_KERNELS]),
    }
    rows = json.loads(args.out.read_text()) if args.out.is_file() else []
    rows = [r for r in rows if _key(r) != _key(row)] + [row]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(row, args.top))


if __name__ == "__main__":
    main()
