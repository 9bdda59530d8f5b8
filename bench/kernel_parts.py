"""Each kernel of one attention call, timed on its own: where a method's forward or backward time goes.

bench/kernel.py times whole calls, so a change that speeds one kernel of a call and slows another (the backward's
preprocess, main kernel and dQ convert) shows there only as their sum. This runs the same cases and methods
(bench/kernel.make_method: B*T = 16k, H = 2048 / hd, bf16; ours_candidate through --candidate) under torch.profiler
and prints each kernel's GPU time per call in a column per method, with the sum of them all.

    python bench/kernel_parts.py --hdims 128 --causal 0 --seqlens 8192
    python -m flash_kernel.build --out /tmp/b && python bench/kernel_parts.py --candidate /tmp/b/_C*.so \\
        --methods ours ours_candidate --rounds 7
    python bench/kernel_parts.py --methods ours fa4 --modes bwd --flush-l2 --seqlens 2048   # as kernel.py's bwd

--modes fwd profiles forward calls, fwd_bwd (the default) forward + backward calls, whose forward kernels are rows
of their own, and bwd backward calls alone, as bench/kernel.py times them (one forward, then backward calls that
reuse its graph). Every round profiles each method in turn (interleaved rounds, so that a drift of the GPU's clocks
reaches every method alike), --iters calls after two warm-up calls; a kernel's time is the median over the rounds of
its time per call. Kernels are named without their return type, template arguments and parameters, and CuTe DSL's
(FA4's) by their class, e.g. FlashAttentionBackwardSm90; kernels that share a name add up (a kernel's instantiations
are one row). --results writes the rows as JSON.

Below the kernels, per call: "all kernels", their sum; "first start to last end", the GPU time from the call's first
kernel to the end of its last, which adds the idle time between its kernels; and with --flush-l2, which zeroes a
256 MB buffer before each call as triton.testing.do_bench does between its timed calls (so every call meets the L2
that bench/kernel.py's calls meet), "idle after the L2 flush": from the end of that zeroing to the call's first
kernel, the GPU waiting for the host to launch it, which do_bench's time per call includes.
"""

from __future__ import annotations

import argparse
import itertools
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
SPAN = "first start to last end"
FLUSH_IDLE = "idle after the L2 flush"
SUMMARY = (TOTAL, SPAN, FLUSH_IDLE)  # the rows below the kernels, in this order
FLUSH_BYTES = 256 * 10**6  # triton.testing.do_bench's L2 flush buffer
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


Event = tuple[str, float, float]  # a GPU kernel, memset or copy: (profiler name, start µs, end µs)


def split_calls(events: list[Event], calls: int, flushed: bool) -> list[list[Event]]:
    """The events of `calls` calls on one stream -> one list per call, in start order; with `flushed`, each call's
    list begins with the L2 flush launched before it. Every call must run the same kernels in the same order (else
    ValueError): the events are cut into equal runs of launches."""
    events = sorted(events, key=lambda e: e[1])
    if calls < 1 or not events or len(events) % calls:
        raise ValueError(f"{len(events)} GPU events do not split into {calls} calls of equal length")
    size = len(events) // calls
    if flushed and size < 2:
        raise ValueError(f"{size} GPU event per call: the L2 flush and no kernel of the call")
    groups = [events[i:i + size] for i in range(0, len(events), size)]
    names = [[kernel_name(e[0]) for e in g] for g in groups]
    for i, n in enumerate(names[1:], start=1):
        if n != names[0]:
            raise ValueError(f"call {i} ran {n}, call 0 {names[0]}: the calls differ, so they cannot be told apart")
    return groups


def call_times(events: list[Event], flushed: bool) -> dict[str, float]:
    """One call's events in start order (split_calls) -> {kernel_name: µs}, then TOTAL, SPAN and, with `flushed`
    (events[0] is the L2 flush), FLUSH_IDLE."""
    flush, kernels = (events[0], events[1:]) if flushed else (None, events)
    out: dict[str, float] = {}
    for name, start, end in kernels:
        key = kernel_name(name)
        out[key] = out.get(key, 0.0) + (end - start)
    out[TOTAL] = sum(out.values())
    out[SPAN] = max(end for _, _, end in kernels) - kernels[0][1]
    if flush is not None:
        out[FLUSH_IDLE] = kernels[0][1] - flush[2]
    return out


def per_call(events: list[Event], calls: int, flushed: bool = False) -> dict[str, float]:
    """The events of `calls` calls -> each row's mean µs per call (call_times), the kernels in first-seen order,
    then the SUMMARY rows."""
    times = [call_times(g, flushed) for g in split_calls(events, calls, flushed)]
    return {k: sum(t[k] for t in times) / calls for k in kernel_order(times)}


def kernel_order(tables: list[dict[str, float]]) -> list[str]:
    """The kernels of all `tables` in first-seen order, then the SUMMARY rows that any of them has."""
    kernels = dict.fromkeys(k for t in tables for k in t if k not in SUMMARY)
    return list(kernels) + [k for k in SUMMARY if any(k in t for t in tables)]


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each row's median over the rounds (a round without the kernel counts 0 µs), in kernel_order."""
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


def profile_calls(call, iters: int, flush=None) -> list[Event]:
    """The Event of every GPU kernel, memset and copy that `iters` calls of `call` ran, each call after flush()
    where one is given."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if flush is not None:
                flush()
            call()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def make_call(fn, context, q, k, v, do, mode: str):
    """One call of `mode` as bench/kernel.py times it (bk.mode_step; bwd's forward runs here), in the method's
    context, grads cleared after it."""
    with context():
        step = bk.mode_step(mode, fn, do)

    def call():
        with context():
            step()
        q.grad = k.grad = v.grad = None
    return call


def make_calls(methods: list[str], hd: int, causal: bool, seqlen: int, mode: str) -> dict:
    """{method: one call of the case (make_call)} on (B, T, H, D) bf16 inputs of bench/kernel.py's shape; a method
    that cannot run the case is left out with a note."""
    batch, heads = bk.shape_for(seqlen, hd)
    calls = {}
    for method in methods:
        try:
            (q, k, v, do), fn, context = bk.make_method(method, batch, heads, seqlen, hd, causal, torch.bfloat16,
                                                        "bthd")
        except bk.BackendUnsupported as e:
            print(f"note: {method} skipped: {e}")
            continue
        calls[method] = make_call(fn, context, q, k, v, do, mode)
    return calls


def l2_flush():
    """do_bench's L2 flush: zeroing a FLUSH_BYTES buffer, as a callable."""
    return torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").zero_


def run_case(methods: list[str], hd: int, causal: bool, seqlen: int, mode: str, rounds: int,
             iters: int, flush_l2: bool = False) -> dict[str, dict[str, float]]:
    """{method: {row: median µs per call}} of one case; a method that cannot run it is left out with a note."""
    calls = make_calls(methods, hd, causal, seqlen, mode)
    flush = l2_flush() if flush_l2 else None
    per_round: dict[str, list[dict[str, float]]] = {m: [] for m in calls}
    for _round in range(rounds):
        for method, call in calls.items():
            for _ in range(2):  # warm-up: the first call of a method builds its state (and compiles, for FA4)
                call()
            torch.cuda.synchronize()
            per_round[method].append(per_call(profile_calls(call, iters, flush), iters, flushed=flush is not None))
    return {m: medians(r) for m, r in per_round.items()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=bk.METHODS, default=None,
                   help="default: ours, and ours_candidate where --candidate or --candidate-overrides is given")
    p.add_argument("--hdims", nargs="+", type=int, default=[128])
    p.add_argument("--causal", nargs="+", type=int, choices=[0, 1], default=[0, 1])
    p.add_argument("--seqlens", nargs="+", type=int, default=[8192])
    p.add_argument("--modes", nargs="+", choices=bk.MODES, default=["fwd_bwd"],
                   help="fwd: forward calls; fwd_bwd: forward + backward calls; bwd: backward calls alone")
    p.add_argument("--flush-l2", action="store_true",
                   help="zero a 256 MB buffer before each call, as triton.testing.do_bench does (bench/kernel.py)")
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
    for hd, causal, seqlen, mode in itertools.product(args.hdims, args.causal, args.seqlens, args.modes):
        per_method = run_case(args.methods, hd, bool(causal), seqlen, mode, args.rounds, args.iters, args.flush_l2)
        case = f"hd={hd} causal={causal} T={seqlen} {mode}" + (" L2 flushed" if args.flush_l2 else "")
        print(format_case(case, per_method) + "\n")
        rows += [{"device": device, "hd": hd, "causal": bool(causal), "seqlen": seqlen, "mode": mode, "method": m,
                  "kernel": k, "us_per_call": us, "rounds": args.rounds, "iters": args.iters, "flush_l2": args.flush_l2}
                 for m, kernels in per_method.items() for k, us in kernels.items()]
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"rows: {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
