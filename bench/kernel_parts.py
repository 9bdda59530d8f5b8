"""Each kernel of one attention call, timed on its own: where a method's forward or backward time goes.

bench/kernel.py times whole calls, so a change that speeds one kernel of a call and slows another (the backward's
preprocess, main kernel and dQ convert) shows there only as their sum. This runs the same cases and methods
(bench/kernel.make_method: B*T = 16k, H = 2048 / hd, bf16; ours_candidate through --candidate) under torch.profiler
and prints each kernel's GPU time per call in a column per method, with the sum of them all.

    python bench/kernel_parts.py --hdims 128 --causal 0 --seqlens 8192
    python -m flash_kernel.build --out /tmp/b && python bench/kernel_parts.py --candidate /tmp/b/_C*.so \\
        --methods ours ours_candidate --rounds 7

--modes fwd profiles forward calls, fwd_bwd (the default) forward + backward calls, whose forward kernels are rows
of their own. Every round profiles each method in turn (interleaved rounds, so that a drift of the GPU's clocks
reaches every method alike), --iters calls after two warm-up calls; a kernel's time is the median over the rounds of
its time per call. Kernels are named without their return type, template arguments and parameters, and CuTe DSL's
(FA4's) by their class, e.g. FlashAttentionBackwardSm90; kernels that share a name add up (a kernel's instantiations
are one row). --results writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kernel as bk  # noqa: E402

TOTAL = "all kernels"
# CuTe DSL's kernel names: its module path and class run together, then the class object and its arguments, e.g.
# kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__tensor0000o1110..._0
CUTE_DSL_KERNEL = re.compile(r"^kernel_cutlass_kernel_[a-z0-9_]*?([A-Z]\w*?)_object_at_")


def kernel_name(name: str) -> str:
    """A profiler's kernel name without its return type, template arguments and parameters:
    `void flash::bwd_convert_dq_kernel<...>(flash::BwdParams)` -> `flash::bwd_convert_dq_kernel`; a CuTe DSL kernel's
    by its class (CUTE_DSL_KERNEL)."""
    if (cute := CUTE_DSL_KERNEL.match(name)) is not None:
        return cute.group(1)
    depth, out = 0, []
    for ch in name:
        if ch == "(" and depth == 0:  # the parameters (or a memset's or copy's "(Device)")
            break
        if ch in "<>":
            depth += 1 if ch == "<" else -1
        elif depth == 0:
            out.append(ch)
    base = "".join(out).strip()
    return base.removeprefix("void ").strip() or name


def per_call(kernels: list[tuple[str, float]], calls: int) -> dict[str, float]:
    """[(profiler kernel name, µs)] of `calls` calls -> {kernel_name: µs per call}, first-seen order, TOTAL last."""
    out: dict[str, float] = {}
    for name, us in kernels:
        key = kernel_name(name)
        out[key] = out.get(key, 0.0) + us / calls
    out[TOTAL] = sum(out.values())
    return out


def kernel_order(tables: list[dict[str, float]]) -> list[str]:
    """The kernels of all `tables` in first-seen order, TOTAL last."""
    return list(dict.fromkeys(k for t in tables for k in t if k != TOTAL)) + [TOTAL]


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each kernel's median over the rounds (a round without the kernel counts 0 µs), in first-seen order."""
    return {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in kernel_order(rounds)}


def format_case(case: str, per_method: dict[str, dict[str, float]]) -> str:
    """A markdown table: a row per kernel (the methods' kernels in first-seen order), a column per method in µs
    per call, '–' where a method runs no such kernel."""
    methods = list(per_method)
    names = kernel_order(list(per_method.values()))
    lines = [f"{case}: GPU µs per call", "", "| kernel | " + " | ".join(methods) + " |",
             "|---|" + "---|" * len(methods)]
    for name in names:
        cells = [f"{per_method[m][name]:.1f}" if name in per_method[m] else "–" for m in methods]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_calls(call, iters: int) -> list[tuple[str, float]]:
    """(name, µs) of every GPU kernel, memset and copy that `iters` calls of `call` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def run_case(methods: list[str], hd: int, causal: bool, seqlen: int, mode: str, rounds: int,
             iters: int) -> dict[str, dict[str, float]]:
    """{method: {kernel: median µs per call}} of one case; a method that cannot run it is left out with a note."""
    batch, heads = bk.shape_for(seqlen, hd)
    calls = {}
    for method in methods:
        try:
            (q, k, v, do), fn, context = bk.make_method(method, batch, heads, seqlen, hd, causal, torch.bfloat16,
                                                        "bthd")
        except bk.BackendUnsupported as e:
            print(f"note: {method} skipped: {e}")
            continue

        def call(fn=fn, context=context, q=q, k=k, v=v, do=do):
            with context():
                o = fn()
                if mode != "fwd":
                    o.backward(do)
            q.grad = k.grad = v.grad = None
        calls[method] = call
    per_round: dict[str, list[dict[str, float]]] = {m: [] for m in calls}
    for _round in range(rounds):
        for method, call in calls.items():
            for _ in range(2):  # warm-up: the first call of a method builds its state (and compiles, for FA4)
                call()
            torch.cuda.synchronize()
            per_round[method].append(per_call(profile_calls(call, iters), iters))
    return {m: medians(r) for m, r in per_round.items()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=bk.METHODS, default=None,
                   help="default: ours, and ours_candidate where --candidate or --candidate-overrides is given")
    p.add_argument("--hdims", nargs="+", type=int, default=[128])
    p.add_argument("--causal", nargs="+", type=int, choices=[0, 1], default=[0, 1])
    p.add_argument("--seqlens", nargs="+", type=int, default=[8192])
    p.add_argument("--modes", nargs="+", choices=["fwd", "fwd_bwd"], default=["fwd_bwd"],
                   help="fwd: forward calls; fwd_bwd: forward + backward calls")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="profiled calls per method and round")
    p.add_argument("--results", type=Path, default=None, help="write the rows here as JSON")
    bk.add_candidate_arguments(p)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        p.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    bk.read_candidate_arguments(p, args, ["ours", "ours_candidate"])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernel_parts.py: needs a CUDA GPU (torch.cuda.is_available() is False)")
    bk.use_candidate(args.candidate, args.candidate_overrides, args.methods)
    # torch.profiler warns that it keeps only the last cycle's events; each profile here is a single cycle
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    rows = []
    for hd in args.hdims:
        for causal in args.causal:
            for seqlen in args.seqlens:
                for mode in args.modes:
                    per_method = run_case(args.methods, hd, bool(causal), seqlen, mode, args.rounds, args.iters)
                    case = f"hd={hd} causal={causal} T={seqlen} {mode}"
                    print(format_case(case, per_method) + "\n")
                    rows += [{"device": device, "hd": hd, "causal": bool(causal), "seqlen": seqlen, "mode": mode,
                              "method": m, "kernel": k, "us_per_call": us, "rounds": args.rounds, "iters": args.iters}
                             for m, kernels in per_method.items() for k, us in kernels.items()]
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"rows: {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
