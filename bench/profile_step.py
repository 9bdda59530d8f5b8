"""Where one GPT training step's GPU time goes: kernel time per step by category, and the largest kernels.

Profiles the benchmark's bare step (bench/e2e.py `bare_step`: the same model, loss, AdamW and clipping as
the pipeline, without Lightning) under `torch.profiler` after a few warm-up steps, and sums every CUDA
kernel's time into the categories below by its name. The sum is GPU busy time, not wall time: the table
prints the wall time of the profiled steps beside it, and the gaps in the GPU's timeline (no kernel, copy or
memset running), where the GPU waits for the host.

    python bench/profile_step.py --model gpt3-1.3b --seq-len 2048 --attention flash
    python bench/profile_step.py --seq-len 8192 --compile --set fp32_residual=true
    python bench/profile_step.py --seq-len 8192 --micro-batches 8   # 8 accumulated micro-batches per optimizer step

Under torchrun (WORLD_SIZE > 1) the step runs in DDP with conf/trainer/strategy/data_parallel.yaml's settings
(--reduce-dtype and --sm-carveout are its keys of the same names; --hook torch runs torch's own all-reduce
instead of model/allreduce.py's, --hook copy_engine the copy engines', as comm_hook=copy_engine), and rank 0
also reports how the gradient all-reduce meets compute: the time NCCL kernels run, the part of it with no other
kernel running (exposed), and the CTAs (SMs) NCCL takes. The compute categories beside the one-GPU profile of the
same case show what the overlap costs compute.

    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --sm-carveout 4
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --hook torch
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --hook copy_engine
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --strategy fsdp
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --micro-batches 8 --strategy fsdp2 \
        --sharding-strategy FULL_SHARD    # FSDP2 (trainer=fsdp2): one reduce-scatter per step

Rows merge into bench/results/profile.json, keyed by device and case (model, T, micro-batches, attention, compile,
--set, and the world size, strategy, sharding, all-reduce, reduce dtype, carve-out and NCCL protocol).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import join_torchrun_group, parse_sets  # noqa: E402
from bench.e2e import TOKENS_PER_STEP  # noqa: E402
from bench.strategies import STRATEGY_FILES, wrap_for  # noqa: E402

RESULTS = REPO / "bench" / "results"
KEEP_KERNELS = 40  # the JSON keeps this many of the largest kernels (the categories sum them all)

# First match wins, so the specific names come before the generic ones ("copy", "elementwise"). Inductor's
# kernels carry the aten ops they fused in their names (triton_red_fused_native_layer_norm_...), so they fall
# into the category of the first op named here.
CATEGORIES: list[tuple[str, str]] = [
    ("communication", r"nccl"),
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


def _merged(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _common_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two _merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def communication_overlap(kernels: list[dict], steps: int) -> dict:
    """From chrome-trace kernel events ({"name", "ts", "dur" in µs, "args": {"grid"}}): ms per step during
    which NCCL kernels run, and how much of it no other kernel runs beside them (exposed); the most CTAs one
    NCCL kernel launched."""
    comm = [k for k in kernels if category(k["name"]) == "communication"]
    nccl = _merged((k["ts"], k["ts"] + k["dur"]) for k in comm)
    compute = _merged((k["ts"], k["ts"] + k["dur"]) for k in kernels if category(k["name"]) != "communication")
    busy = sum(end - start for start, end in nccl)
    hidden = _common_length(nccl, compute)
    return {"nccl_ms": busy / 1e3 / steps, "exposed_ms": (busy - hidden) / 1e3 / steps,
            "nccl_ctas": max((math.prod(k.get("args", {}).get("grid", [0])) for k in comm), default=0)}


def gpu_timeline(events: list[dict], steps: int) -> dict:
    """From chrome-trace GPU events (kernels, memcpys, memsets): ms per step from the first one's start to the
    last one's end (span), and how much of the span no GPU work runs (idle: the gaps the host leaves)."""
    busy = _merged((e["ts"], e["ts"] + e["dur"]) for e in events)
    if not busy:
        return {"span_ms": 0.0, "idle_ms": 0.0}
    span = busy[-1][1] - busy[0][0]
    return {"span_ms": span / 1e3 / steps, "idle_ms": (span - sum(end - start for start, end in busy)) / 1e3 / steps}


def profile(step, warmup: int, steps: int) -> tuple[dict[str, float], float, list[dict]]:
    """(kernel ms per step by name, wall ms per profiled step, the GPU's chrome-trace events: kernels, memcpys
    and memsets)."""
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
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    return kernel_times(prof, steps), wall_ms, gpu


def table(row: dict, top: int) -> str:
    wall = row["wall_ms_per_step"]
    world = row.get("world_size", 1)
    proto = f", NCCL_PROTO={row['nccl_protocol']}" if row.get("nccl_protocol") else ""
    hook = {"torch": ", torch's all-reduce", "copy_engine": ", on the copy engines"}.get(row.get("hook"), "")
    if world == 1:
        where = row["device"]
    elif row.get("strategy") in ("fsdp", "fsdp2"):
        sharding = f", {row['sharding_strategy']}" if row.get("sharding_strategy") else ""
        strategy = row["strategy"].upper()
        conf = STRATEGY_FILES[row["strategy"]]
        where = f"{world} × {row['device']} ({strategy}, conf/trainer/strategy/{conf}.yaml{sharding}{proto})"
    else:
        where = f"{world} × {row['device']} (DDP, {row['reduce_dtype']} all-reduce{hook}{proto})"
    carveout = f" sm_carveout={row['sm_carveout']}" if row.get("sm_carveout") else ""
    micro = f" × {row['accumulation']} micro-batches" if row.get("accumulation", 1) > 1 else ""
    lines = [f"{row['model']} {row['batch']}×{row['seq_len']}{micro} attention={row['attention']} "
             f"compile={row['compile']} {row['set'] or ''}{carveout} on {where}: wall {wall:.1f} ms per step",
             "", "| kernels | ms per step | share of kernel time |", "|---|---|---|"]
    total = row["categories"]["all kernels"]
    for cat, ms in row["categories"].items():
        lines.append(f"| {cat} | {ms:.1f} | {100 * ms / total:.1f}% |")
    if "timeline" in row:
        t = row["timeline"]
        lines += ["", f"The GPU's timeline: {t['span_ms']:.1f} ms per step from the first kernel to the last, "
                      f"{t['idle_ms']:.1f} ms of it with nothing running (the gaps the host leaves)."]
    if "overlap" in row:
        o = row["overlap"]
        lines += ["", f"NCCL kernels run {o['nccl_ms']:.1f} ms per step on up to {o['nccl_ctas']} CTAs; "
                      f"{o['exposed_ms']:.1f} ms of it with no other kernel running (exposed)."]
    lines += ["", f"| largest kernels (top {top}) | ms per step |", "|---|---|"]
    for name, ms in sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {ms:.2f} |")
    return "\n".join(lines)


def _key(r: dict) -> tuple:
    return (r["device"], r["model"], r["seq_len"], r["batch"], r["attention"], r["compile"], r["set"], r.get("kernel"),
            r.get("world_size", 1), r.get("reduce_dtype"), r.get("sm_carveout", 0), r.get("nccl_protocol"), r.get("hook"),
            r.get("strategy", "ddp"), r.get("accumulation", 1), r.get("sharding_strategy"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt3-1.3b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP, help="batch = this // seq-len")
    ap.add_argument("--micro-batches", type=int, default=1, metavar="K",
                    help="forwards and backwards of that batch per optimizer step, gradients accumulated (under DDP "
                         "all-reduced after the last, as Lightning); the table stays per optimizer step")
    ap.add_argument("--attention", default="flash")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="GPTConfig fields, e.g. fp32_residual=true")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (the table is per step)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32", help="the dtype on DDP's wire (torchrun)")
    ap.add_argument("--sm-carveout", type=int, default=0, help="SMs left to NCCL (model/distributed.set_sm_carveout)")
    ap.add_argument("--hook", choices=["average", "torch", "copy_engine"], default="average",
                    help="DDP's all-reduce: model/allreduce.py's (the pipeline's), torch's own, or the copy engines'")
    ap.add_argument("--strategy", choices=["ddp", "fsdp", "fsdp2"], default="ddp",
                    help="under torchrun: the pipeline's DDP (with --reduce-dtype, --sm-carveout, --hook), its FSDP, "
                         "or its FSDP2 (trainer=fsdp2: a reduce-scatter per optimizer step, not per micro-batch)")
    ap.add_argument("--sharding-strategy", choices=["FULL_SHARD", "SHARD_GRAD_OP"], default=None,
                    help="fsdp and fsdp2: the sharding_strategy of fsdp.yaml or fsdp2.yaml replaced")
    ap.add_argument("--nccl-protocol", choices=["LL", "LL128", "Simple"], default=None,
                    help="NCCL_PROTO (default: NCCL's choice per message size)")
    ap.add_argument("--out", type=Path, default=RESULTS / "profile.json")
    args = ap.parse_args(argv)
    overrides = parse_sets(args.set)
    if args.micro_batches < 1:
        raise SystemExit(f"--micro-batches {args.micro_batches}: an optimizer step takes at least one")
    if not torch.cuda.is_available():
        raise SystemExit("bench/profile_step.py profiles CUDA kernels; no CUDA device here")

    from bench.e2e import bare_step
    from flash_kernel import KERNEL_VERSION
    from model.distributed import set_sm_carveout

    set_sm_carveout(args.sm_carveout)
    if args.nccl_protocol:
        os.environ["NCCL_PROTO"] = args.nccl_protocol  # read when the communicator starts
    world = int(os.environ.get("WORLD_SIZE", "1"))
    wrap, fsdp = None, world > 1 and args.strategy != "ddp"
    if fsdp and (args.reduce_dtype != "fp32" or args.sm_carveout or args.hook != "average"):
        conf = STRATEGY_FILES[args.strategy]
        raise SystemExit(f"--strategy {args.strategy} takes conf/trainer/strategy/{conf}.yaml's settings: no "
                         "--reduce-dtype, --sm-carveout or --hook")
    if args.sharding_strategy and not fsdp:
        raise SystemExit("--sharding-strategy is FSDP's: run under torchrun with --strategy fsdp or fsdp2")
    sharding = {"sharding_strategy": args.sharding_strategy} if args.sharding_strategy else {}
    if world > 1:  # the pipeline's DDP or FSDP (bench/strategies.py) in torchrun's process group
        local = join_torchrun_group()
        ddp = {"reduce_dtype": args.reduce_dtype, "sm_carveout": args.sm_carveout, "comm_hook": args.hook}
        wrap = wrap_for(args.strategy, local, sharding if fsdp else ddp)
    batch = max(1, args.tokens_per_step // args.seq_len)
    step, _ = bare_step(args.model, args.seq_len, batch, args.attention, args.compile, wrap=wrap,
                        accumulation=args.micro_batches, **overrides)
    kernels, wall_ms, events = profile(step, args.warmup, args.steps)
    if world > 1:
        torch.distributed.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    row = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date.today().isoformat(),
        "model": args.model, "seq_len": args.seq_len, "batch": batch,
        **({"accumulation": args.micro_batches} if args.micro_batches > 1 else {}), "attention": args.attention,
        "compile": args.compile, "set": " ".join(sorted(args.set)),
        **({"kernel": KERNEL_VERSION} if args.attention == "flash" else {}),
        "sm_carveout": args.sm_carveout,
        **({"sharding_strategy": args.sharding_strategy} if args.sharding_strategy else {}),
        **({"world_size": world, "strategy": args.strategy, "reduce_dtype": args.reduce_dtype, "hook": args.hook,
            "nccl_protocol": os.environ.get("NCCL_PROTO"),
            "overlap": communication_overlap([e for e in events if e["cat"] == "kernel"], args.steps)}
           if world > 1 else {}),
        "timeline": gpu_timeline(events, args.steps),
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
