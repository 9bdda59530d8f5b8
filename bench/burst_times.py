"""Each call's GPU time by its place in a burst that starts from an idle GPU: whether a method's speed follows the
GPU's power state, and how far from it a sustained measurement runs.

bench/kernel.py's do_bench runs a method without a pause for --rep-ms, and at long sequences an H200 spends that time
at its 700 W cap, the SM clock read at 1665-1710 MHz instead of 1980; torch.profiler's 20-call bursts in
bench/kernel_parts.py start from whatever the method before left (docs/results.md, section 57). Here every method
runs --bursts bursts of --calls calls of one case, in turn, each burst after --gap-ms of idle GPU; each call is timed
alone by CUDA events around it, after do_bench's L2 flush (outside the events; --no-flush leaves it out). Call i of
every burst starts from the same state, so the time of calls 1, 2-3, 4-7, ... (windows that double) shows how the
method's speed moves as the GPU heats and reaches its cap, and the last window is what do_bench's sustained
measurement sees. A method whose early calls are faster than its late ones is held back by the power state; two
methods whose ratio changes across the windows trade differently against it.

    python bench/burst_times.py --methods ours fa4 --hdim 128 --causal 1 --seqlen 8192 --mode bwd
    python bench/burst_times.py --calls 512 --gap-ms 2000 --results /tmp/bursts.json

The table has a row per window: its calls, the time from the burst's first call to the window's first (the first
method's), each method's median µs per call (per burst the median over the window's calls, then the median over the
bursts) and the first method's speed over each other's. --results writes one row per method and burst, with every
call's time and start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kernel as bk  # noqa: E402
from bench import kernel_parts as kp  # noqa: E402


def windows(calls: int) -> list[tuple[int, int]]:
    """[start, end) call ranges that double: (0, 1), (1, 2), (2, 4), (4, 8), ..., the last ending at `calls`."""
    out, start = [], 0
    while start < calls:
        end = min(calls, max(1, 2 * start))
        out.append((start, end))
        start = end
    return out


def window_medians(bursts: list[list[float]], spans: list[tuple[int, int]]) -> list[float]:
    """Per window, the median over bursts of each burst's median over the window's calls."""
    return [statistics.median(statistics.median(burst[a:b]) for burst in bursts) for a, b in spans]


def format_table(case: str, calls_ms: dict[str, list[list[float]]], starts_ms: list[list[float]]) -> str:
    """calls_ms: {method: per burst, each call's ms}; starts_ms: the first method's per burst, each call's start in
    ms from its burst's first call. A markdown table, a row per window."""
    methods = list(calls_ms)
    spans = windows(len(starts_ms[0]))
    per_method = {m: window_medians(b, spans) for m, b in calls_ms.items()}
    starts = window_medians(starts_ms, [(a, a + 1) for a, _ in spans])
    head = ["calls", f"ms into the burst ({methods[0]})"] + [f"{m} (µs)" for m in methods]
    head += [f"{methods[0]} / {m} speed" for m in methods[1:]]
    lines = [f"{case}: GPU µs per call by its place in a burst", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for i, (a, b) in enumerate(spans):
        calls = f"{a + 1}" if b == a + 1 else f"{a + 1}-{b}"
        cells = [calls, f"{starts[i]:.1f}"] + [f"{1000 * per_method[m][i]:.1f}" for m in methods]
        cells += [f"{per_method[m][i] / per_method[methods[0]][i]:.3f}" for m in methods[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_burst(call, calls: int, flush=None) -> tuple[list[float], list[float]]:
    """(each call's ms, each call's start in ms from the first call's) for `calls` calls in a row, flush() before
    each where given, outside its events."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        if flush is not None:
            flush()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    first = events[0][0]
    return [s.elapsed_time(e) for s, e in events], [first.elapsed_time(s) for s, _ in events]


def run_case(methods: list[str], hd: int, causal: bool, seqlen: int, mode: str, bursts: int, calls: int,
             gap_ms: float, flush_l2: bool) -> dict[str, list[tuple[list[float], list[float]]]]:
    """{method: per burst, time_burst's pair}; a method that cannot run the case is left out with a note."""
    steps = kp.make_calls(methods, hd, causal, seqlen, mode)
    flush = kp.l2_flush() if flush_l2 else None
    for call in steps.values():  # the first calls build each method's state (and compile, for FA4)
        for _ in range(2):
            call()
    out: dict[str, list[tuple[list[float], list[float]]]] = {m: [] for m in steps}
    for _burst in range(bursts):
        for method, call in steps.items():
            torch.cuda.synchronize()
            time.sleep(gap_ms / 1000)
            out[method].append(time_burst(call, calls, flush))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=bk.METHODS, default=["ours", "fa4"])
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", type=int, choices=[0, 1], default=1)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--mode", choices=bk.MODES, default="bwd",
                   help="fwd: forward calls; fwd_bwd: forward + backward; bwd: backward calls alone (kernel.py's)")
    p.add_argument("--bursts", type=int, default=5, help="bursts per method, taken in turn")
    p.add_argument("--calls", type=int, default=256, help="calls per burst")
    p.add_argument("--gap-ms", type=float, default=1000.0, help="idle GPU before each burst")
    p.add_argument("--no-flush", dest="flush_l2", action="store_false",
                   help="leave out the L2 flush (a 256 MB zeroing, as do_bench's) before each call")
    p.add_argument("--results", type=Path, default=None, help="write every call's time as JSON")
    bk.add_candidate_arguments(p)
    args = p.parse_args(argv)
    if args.bursts < 1 or args.calls < 1 or args.gap_ms < 0:
        p.error(f"--bursts and --calls must be >= 1 and --gap-ms >= 0, got {args.bursts}, {args.calls} and "
                f"{args.gap_ms}")
    bk.read_candidate_arguments(p, args, args.methods)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/burst_times.py: needs a CUDA GPU (torch.cuda.is_available() is False)")
    bk.use_candidate(args.candidate, args.candidate_overrides, args.methods)
    torch.manual_seed(0)
    per_method = run_case(args.methods, args.hdim, bool(args.causal), args.seqlen, args.mode, args.bursts,
                          args.calls, args.gap_ms, args.flush_l2)
    if not per_method:
        sys.exit("bench/burst_times.py: no method could run this case")
    case = (f"hd={args.hdim} causal={args.causal} T={args.seqlen} {args.mode}, {args.bursts} bursts after "
            f"{args.gap_ms:g} ms idle" + (", L2 flushed" if args.flush_l2 else ""))
    first = next(iter(per_method.values()))
    print(format_table(case, {m: [ms for ms, _ in b] for m, b in per_method.items()}, [s for _, s in first]))
    if args.results:
        device = torch.cuda.get_device_name()
        rows = [{"device": device, "hd": args.hdim, "causal": bool(args.causal), "seqlen": args.seqlen,
                 "mode": args.mode, "method": m, "burst": i, "gap_ms": args.gap_ms, "flush_l2": args.flush_l2,
                 "call_ms": ms, "start_ms": starts}
                for m, b in per_method.items() for i, (ms, starts) in enumerate(b)]
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(rows) + "\n")
        print(f"rows: {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
