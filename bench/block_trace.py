"""Where the Hopper backward's thread blocks spend their lives, from the phase stamps of a FLASH_BWD_TRACE build.

In a build with -DFLASH_BWD_TRACE=1, thread 0 of every thread block of the Hopper backward stamps the SM's cycle
counter as the prologue's loads land, at the main loop's start and end, after the dK / dV stores and at exit, and
the global timer at its start and exit (flash_kernel/csrc/block_trace.h). This runs one case of the kernel benchmark
(bench/kernel.py's shapes: B*T = 16k, hidden 2048, bf16, (B, T, H, D) inputs) on such a build, once to warm up and
once traced, and reports:

- each phase's share of the blocks' cycles: the prologue (K_j, V_j and the first query blocks' loads), the first
  S^T (issued before the loop at kBlockM = 64), the loop, the dK / dV stores, the wait for the last dQ reduce;
- the cycles per loop trip and each block's fixed cost (its cycles outside the loop) in trips' worth, also as the
  intercept of a least-squares line through (trips, cycles);
- from the global timer, the SMs' time between one block's exit and the next one's start, and after their last
  block: the share of the kernel's span that runs no block;
- what a persistent kernel could make of the same blocks (persistent_model): the blocks replayed in the order they
  started onto as many SMs, each taken by the first SM free, with each block's cycles as traced, less its prologue
  where the schedule loads it while the SM's block before it runs: under that block's epilogue (loads issued as
  its loop ends), or wholly (loads issued during its last trips, into a second K / V buffer); and, as a bound, with
  nothing outside the loop but each SM's first block's. The replay has no gaps between blocks (the SM time
  "between blocks" above comes on top).

    FLASH_KERNEL_NVCC_EXTRA=-DFLASH_BWD_TRACE=1 python -m flash_kernel.build --out flash_kernel/_candidate_trace
    python bench/block_trace.py --ext flash_kernel/_candidate_trace/_C*.so --hdim 80 --seqlen 4096 --causal 1
    python bench/block_trace.py --from-json bench/results/stage3_rounds/v49/block_traces/trace_hd80_T4096_c1.json.gz

The stamps hold a few registers across the loop (no spills at the head dims built): the loop's own cycles may differ
a little from the default build's; the phases around it are what this is for.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.block_order_model import greedy_makespan  # noqa: E402
from bench.kernel import make_method, shape_for  # noqa: E402
from flash_kernel.interface import load_extension, using_extension  # noqa: E402

# block_trace.h's row: SM, batch, head, block, loop trips, start and exit (ns), then the phases' cycles from the start
COLUMNS = ["sm", "batch", "head", "block", "trips", "start_ns", "exit_ns",
           "loaded", "loop_start", "loop_end", "stored", "exit"]
PHASES = [  # (name, the stamp it ends at, the stamp it starts at; None: the block's start)
    ("prologue: K_j, V_j and the first query blocks loaded", "loaded", None),
    ("first S^T, before the loop", "loop_start", "loaded"),
    ("main loop", "loop_end", "loop_start"),
    ("dK_j and dV_j through shared memory to global", "stored", "loop_end"),
    ("the last dQ reduce's reads", "exit", "stored"),
]


def summarize(rows: list[dict]) -> dict:
    """The report's numbers from the blocks' rows (COLUMNS); blocks with no loop trip are left out of the per-trip
    figures, not out of the SMs' timelines."""
    worked = [r for r in rows if r["trips"] > 0]
    if not worked:
        raise ValueError("no block ran a loop trip")
    total = sum(r["exit"] for r in worked)
    phases = {}
    for name, end, begin in PHASES:
        phases[name] = sum(r[end] - (r[begin] if begin else 0) for r in worked) / total
    trips = sum(r["trips"] for r in worked)
    loop = sum(r["loop_end"] - r["loop_start"] for r in worked)
    per_trip = loop / trips
    fixed = (total - loop) / len(worked)
    # least squares: cycles = a + b * trips
    n = len(worked)
    mx = trips / n
    my = total / n
    sxx = sum((r["trips"] - mx) ** 2 for r in worked)
    fit = None  # every block the same trips (a non-causal grid): no line to fit
    if sxx > 0:
        b = sum((r["trips"] - mx) * (r["exit"] - my) for r in worked) / sxx
        a = my - b * mx
        fit = {"fixed_cycles": a, "cycles_per_trip": b, "fixed_in_trips": a / b if b else None}
    ghz = sorted(r["exit"] / (r["exit_ns"] - r["start_ns"]) for r in worked if r["exit_ns"] > r["start_ns"])
    # SM timelines
    span0 = min(r["start_ns"] for r in rows)
    span1 = max(r["exit_ns"] for r in rows)
    by_sm: dict[int, list[dict]] = {}
    for r in rows:
        by_sm.setdefault(r["sm"], []).append(r)
    between = after = before = busy = 0
    for blocks in by_sm.values():
        blocks.sort(key=lambda r: r["start_ns"])
        before += blocks[0]["start_ns"] - span0
        after += span1 - blocks[-1]["exit_ns"]
        busy += sum(r["exit_ns"] - r["start_ns"] for r in blocks)
        between += sum(max(0, nxt["start_ns"] - cur["exit_ns"]) for cur, nxt in zip(blocks, blocks[1:]))
    sm_time = len(by_sm) * (span1 - span0)
    return {
        "blocks": len(rows),
        "blocks_with_trips": n,
        "trips_per_block": trips / n,
        "sm_ghz": ghz[len(ghz) // 2] if ghz else None,
        "phase_share": phases,
        "cycles_per_trip": per_trip,
        "fixed_cycles_per_block": fixed,
        "fixed_in_trips": fixed / per_trip if per_trip else None,
        "fit": fit,
        "sms": len(by_sm),
        "span_us": (span1 - span0) / 1e3,
        "sm_time_share": {"blocks": busy / sm_time, "between blocks": between / sm_time,
                          "before the first block": before / sm_time, "after the last block": after / sm_time},
        "persistent_model": persistent_model(rows),
    }


# (name, a block's cycles given the block before it on its SM: None for the SM's first)
SCHEDULES = [
    ("one block per tile, as traced", lambda b, prev: b["exit"]),
    ("persistent, the next tile's loads under the epilogue",
     lambda b, prev: b["exit"] - (min(b["loaded"], prev["exit"] - prev["loop_end"]) if prev else 0)),
    ("persistent, the next tile's loads landed before it starts", lambda b, prev: b["exit"] - (b["loaded"] if prev else 0)),
    ("bound: the loop alone after each SM's first block",
     lambda b, prev: b["loop_end"] - b["loop_start"] if prev else b["exit"]),
]


def persistent_model(rows: list[dict]) -> dict:
    """The makespan (cycles) of each of SCHEDULES, replaying the blocks in the order they started onto as many SMs as
    ran them, each block to the SM free first; and each one's speed-up over the first."""
    order = sorted(rows, key=lambda r: (r["start_ns"], r["sm"]))
    sms = len({r["sm"] for r in rows})
    makespans = {name: greedy_makespan(order, sms, cycles) for name, cycles in SCHEDULES}
    base = makespans[SCHEDULES[0][0]]
    return {"makespan_cycles": makespans, "speedup": {name: base / m for name, m in makespans.items()}}


def report(case: str, s: dict) -> str:
    lines = [f"## {case}",
             f"{s['blocks']} blocks on {s['sms']} SMs, {s['trips_per_block']:.1f} loop trips per block, span "
             f"{s['span_us']:.0f} µs, SM clock {s['sm_ghz']:.2f} GHz (cycles / global timer)",
             "", "| phase | share of the blocks' cycles |", "|---|---|"]
    lines += [f"| {name} | {share * 100:.1f}% |" for name, share in s["phase_share"].items()]
    fit = s["fit"]
    line = (f"cycles per loop trip {s['cycles_per_trip']:.0f}; outside the loop {s['fixed_cycles_per_block']:.0f} per "
            f"block = {s['fixed_in_trips']:.2f} trips; least squares over the blocks: ")
    if fit is None:
        line += "none (every block runs the same trips)"
    else:
        line += (f"{fit['fixed_cycles']:.0f} + {fit['cycles_per_trip']:.0f} x trips "
                 f"({fit['fixed_in_trips']:.2f} trips)")
    lines += ["", line, "", "| SM time | share of SMs x span |", "|---|---|"]
    lines += [f"| {name} | {share * 100:.1f}% |" for name, share in s["sm_time_share"].items()]
    model = s["persistent_model"]
    if s["sm_ghz"]:  # the replay as traced beside the traced span, in cycles
        share = model["makespan_cycles"][SCHEDULES[0][0]] / (s["span_us"] * 1e3 * s["sm_ghz"])
        lines += ["", f"The replay of the blocks as traced takes {share * 100:.1f}% of the traced span (it has no gaps "
                  "between blocks, and it takes them in the order they started)."]
    lines += ["", "| the same blocks replayed (persistent_model) | makespan, k cycles | speed-up |", "|---|---|---|"]
    lines += [f"| {name} | {model['makespan_cycles'][name] / 1e3:.0f} | {model['speedup'][name]:.3f} |"
              for name in model["makespan_cycles"]]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Each SM's blocks on the global timer, shaded by their trips."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["start_ns"] for r in rows)
    most = max(r["trips"] for r in rows) or 1
    fig, ax = plt.subplots(figsize=(12, 6))
    for r in rows:
        ax.broken_barh([((r["start_ns"] - t0) / 1e3, (r["exit_ns"] - r["start_ns"]) / 1e3)], (r["sm"] - 0.4, 0.8),
                       color=plt.cm.viridis(r["trips"] / most), linewidth=0)
    ax.set_xlabel("µs from the first block's start")
    ax.set_ylabel("SM")
    ax.set_title(title + " (colour: the block's loop trips)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def trace(ext: str, hdim: int, seqlen: int, causal: bool) -> tuple[str, list[dict]]:
    """Run the case once to warm up and once traced on the build in `ext`; returns its name and the blocks' rows."""
    module = load_extension(ext)
    batch, heads = shape_for(seqlen, hdim)
    blocks = batch * heads * -(-seqlen // 64)  # at least the grid: no backward block is narrower than 64 keys
    buffer = torch.zeros(blocks, len(COLUMNS), dtype=torch.int64, device="cuda")
    with using_extension(module):
        (q, k, v, do), fn, context = make_method("ours", batch, heads, seqlen, hdim, causal, torch.bfloat16, "bthd")
        for traced in (False, True):
            with context():
                o = fn()
                module.set_block_trace(buffer.data_ptr() if traced else 0, blocks if traced else 0)
                try:
                    o.backward(do)
                finally:
                    module.set_block_trace(0, 0)
            q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    rows = [dict(zip(COLUMNS, r)) for r in buffer.tolist() if r[6] != 0]  # exit_ns: the rows the kernel wrote
    if not rows:
        raise SystemExit(f"{ext} wrote no stamps: build it with FLASH_KERNEL_NVCC_EXTRA=-DFLASH_BWD_TRACE=1 "
                         "(and run on a Hopper GPU, whose backward is the traced kernel)")
    case = f"hd{hdim} {'causal' if causal else 'non-causal'} T={seqlen} B={batch} H={heads} backward"
    return case, rows


def load(path: Path) -> tuple[str, list[dict]]:
    """A trace that --out saved (gzipped or not): its case and the blocks' rows."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        saved = json.load(f)
    return saved["case"], [dict(zip(saved["columns"], r)) for r in saved["rows"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ext", help="a build with -DFLASH_BWD_TRACE=1 (python -m flash_kernel.build --out)")
    p.add_argument("--from-json", type=Path, help="report a trace that --out saved (.json or .json.gz): no GPU needed")
    p.add_argument("--hdim", type=int, default=80)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--causal", type=int, choices=[0, 1], default=1)
    p.add_argument("--out", type=Path, help="write the summary and the blocks' rows here (JSON)")
    p.add_argument("--plot", type=Path, help="draw the SMs' timelines here (PNG)")
    args = p.parse_args(argv)
    if (args.ext is None) == (args.from_json is None):
        p.error("give --ext (trace a case on a GPU) or --from-json (report a saved trace)")
    if args.from_json is not None:
        case, rows = load(args.from_json)
        device = None
    else:
        if not torch.cuda.is_available():
            p.error("--ext needs a CUDA GPU")
        case, rows = trace(args.ext, args.hdim, args.seqlen, bool(args.causal))
        device = torch.cuda.get_device_name()
    summary = summarize(rows)
    print(report(case, summary))
    if args.out:
        args.out.write_text(json.dumps({"case": case, "device": device, "summary": summary, "columns": COLUMNS,
                                        "rows": [[r[c] for c in COLUMNS] for r in rows]}) + "\n")
    if args.plot:
        plot(rows, args.plot, case)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
