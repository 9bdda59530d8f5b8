"""Nsight Compute on two attention kernels for the same case, side by side: where one spends the cycles the other
does not (our kernel against FlashAttention-4's on the same shape: tensor pipe, stalls, traffic).

Each method's main kernel of the case (bench/ncu_case.py: B*T = 16k, hidden 2048, bf16) is profiled once by
`ncu --set full` after the warm-up call, and a chosen set of its metrics is printed beside the other methods' with
the ratio to the first method (a method that cannot run here, such as FA4 where `flash_attn.cute` does not import,
is left out with a note): the time, how busy the tensor cores' wgmma pipe and the other pipes are, the
instructions issued, the warps' stall reasons per issued instruction, L2, DRAM and shared-memory traffic, the
launch (registers, shared memory, grid). FLASH_KERNEL_EXT=<a candidate build> makes `ours` that build.

    python bench/ncu_compare.py --hdim 128 --seqlen 8192 --causal 0 --mode fwd            # ours against fa4
    python bench/ncu_compare.py --hdim 64 --seqlen 16384 --causal 1 --mode bwd --methods ours sdpa_cudnn \\
        --kernel-regex sdpa_cudnn=cudnn                                                     # a pattern of your own

Rows merge into bench/results/ncu.json, keyed by device, method, case and kernel; the raw CSV of each profile
stays beside it in bench/results/ncu/ (ignored by git).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import shutil
import subprocess
import sys
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import merge_file  # noqa: E402
from bench.kernel import METHODS, MODES, BackendUnsupported, make_method  # noqa: E402

RESULTS = REPO / "bench" / "results" / "ncu.json"
RAW = REPO / "bench" / "results" / "ncu"

# The main kernel of each method and pass (ncu -k regex:, ECMAScript: no inline flags): the attention kernel itself,
# not a backward's preprocess (D_i) or dQ convert. Other methods take --kernel-regex.
KERNELS = {
    ("ours", "fwd"): r"flash_fwd_(hopper_)?kernel",
    ("ours", "bwd"): r"flash_bwd_(hopper|tiled)_kernel",
    ("fa4", "fwd"): r"([Ff]wd|Forward)(?!.*[Pp](re|ost)[Pp]rocess)",
    ("fa4", "bwd"): r"([Bb]wd|Backward)(?!.*[Pp](re|ost)[Pp]rocess)",
    ("sdpa_flash", "fwd"): r"flash_fwd_kernel",
    ("sdpa_flash", "bwd"): r"flash_bwd_dq_dk_dv",
}

# (label, ncu metric): what the table shows, in its order; a metric a GPU or ncu version lacks shows "–".
METRICS = [
    ("time (µs)", "gpu__time_duration.sum"),
    ("wgmma pipe active (%)", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue slots busy (%)", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("FMA pipe active (%)", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("ALU pipe active (%)", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    ("XU (MUFU) pipe active (%)", "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active"),
    ("instructions (M)", "smsp__inst_executed.sum"),
    ("L2 traffic (MB)", "lts__t_bytes.sum"),
    ("DRAM traffic (MB)", "dram__bytes.sum"),
    ("shared-memory wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"),
    ("shared-memory bank conflicts (M)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"),
    ("registers per thread", "launch__registers_per_thread"),
    ("dynamic shared memory (KiB)", "launch__shared_mem_per_block_dynamic"),
    ("grid", "launch__grid_size"),
    ("block", "launch__block_size"),
]
# The base units under --print-units base, as ncu versions spell them (2025.3.1: "ns", "byte", "byte/block").
NSECOND, BYTE = ("nsecond", "ns"), ("byte", "B")
SCALE = {"gpu__time_duration.sum": (NSECOND, 1e-3), "smsp__inst_executed.sum": (None, 1e-6),
         "lts__t_bytes.sum": (BYTE, 1e-6), "dram__bytes.sum": (BYTE, 1e-6),
         "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": (None, 1e-6),
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": (None, 1e-6),
         "launch__shared_mem_per_block_dynamic": (BYTE + ("byte/block",), 1 / 1024)}
# Stall reasons: cycles a warp waited on each, per instruction it issued (ncu's "Warp State" section).
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def ncu_command(ncu: str, method: str, hdim: int, seqlen: int, causal: int, mode: str,
                regex: str | None = None) -> list[str]:
    """The ncu command that profiles `method`'s main kernel once, after ncu_case.py's warm-up call (-s 1)."""
    pattern = regex or KERNELS.get((method, mode))
    if pattern is None:
        raise SystemExit(f"no kernel pattern for {method} {mode}: give --kernel-regex")
    return [ncu, "--set", "full", "--page", "raw", "--csv", "--print-units", "base", "--kernel-name-base", "demangled",
            "-k", f"regex:{pattern}",
            "-s", "1", "-c", "1", sys.executable, str(REPO / "bench" / "ncu_case.py"), "--method", method,
            "--hdim", str(hdim), "--seqlen", str(seqlen), "--causal", str(causal), "--mode", mode, "--iters", "1",
            "--inputs", "bthd"]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's `--page raw --csv`: a header row of metric names, a row of their units, one row per kernel profiled.
    Returns per kernel {"kernel": name, "units": {metric: unit}, "values": {metric: float}} (numbers only)."""
    rows = list(csv.reader(io.StringIO(text[text.find('"ID"'):] if '"ID"' in text else text)))
    if not rows or "Kernel Name" not in rows[0]:
        raise ValueError("no ncu raw CSV header (a row naming \"Kernel Name\") in the profiler's output")
    header, body = rows[0], rows[1:]
    units = dict(zip(header, body[0])) if body and not body[0][header.index("Kernel Name")] else {}
    kernels = []
    for row in body[1 if units else 0:]:
        if len(row) != len(header):
            continue
        cells = dict(zip(header, row))
        values = {m: v for m, v in ((m, _number(c)) for m, c in cells.items()) if v is not None}
        kernels.append({"kernel": cells["Kernel Name"], "units": units, "values": values})
    return kernels


def summary(kernel: dict) -> dict:
    """The METRICS (scaled to the table's units) and every stall reason of one parsed kernel."""
    values, units = kernel["values"], kernel["units"]
    out = {}
    for label, metric in METRICS:
        if metric not in values:
            continue
        spellings, scale = SCALE.get(metric, (None, 1.0))
        if spellings is not None and units.get(metric) not in (None, "", *spellings):
            raise ValueError(f"{metric} in {units[metric]!r}, expected one of {spellings} (ncu's --print-units base)")
        out[label] = values[metric] * scale
    stalls = {m.group(1): v for name, v in values.items() if (m := STALL.match(name))}
    return {"kernel": kernel["kernel"], "metrics": out, "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1]))}


def table(rows: list[dict], top_stalls: int = 10) -> str:
    """Markdown: one column per method, the first method's ratio to each other one where both are numbers."""
    methods = [r["method"] for r in rows]
    head = ["| metric | " + " | ".join(methods) + " | " + " | ".join(f"{methods[0]} / {m}" for m in methods[1:]) + " |",
            "|---|" + "---|" * (2 * len(methods) - 1)]

    def line(label: str, get) -> str:
        vals = [get(r) for r in rows]
        cells = ["–" if v is None else f"{v:.3g}" for v in vals]
        ratios = ["–" if vals[0] is None or v in (None, 0) else f"{vals[0] / v:.3f}" for v in vals[1:]]
        return f"| {label} | " + " | ".join(cells + ratios) + " |"

    lines = [line(label, lambda r, k=label: r["metrics"].get(k)) for label, _ in METRICS]
    worst = {s: max(r["stalls"].get(s, 0.0) for r in rows) for r in rows for s in r["stalls"]}
    stall_names = sorted(worst, key=lambda s: -worst[s])
    lines += [line(f"stall: {s} (cycles per instruction)", lambda r, k=s: r["stalls"].get(k))
              for s in stall_names[:top_stalls]]
    names = [f"- {r['method']}: `{r['kernel'][:150]}`" for r in rows]
    return "\n".join(head + lines + ["", "Kernels:", *names])


def _key(r: dict) -> tuple:
    return (r["device"], r["method"], r["hdim"], r["seqlen"], r["causal"], r["mode"], r.get("extension") or "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=["ours", "fa4"])
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", type=int, choices=[0, 1], default=0)
    ap.add_argument("--mode", choices=[m for m in MODES if m != "fwd_bwd"], default="fwd",
                    help="the pass whose main kernel is profiled")
    ap.add_argument("--kernel-regex", nargs="+", default=[], metavar="METHOD=REGEX",
                    help="a method's kernel pattern in place of KERNELS' (ncu -k regex:)")
    ap.add_argument("--ncu", default=os.environ.get("NCU", "ncu"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    regexes = dict(item.split("=", 1) for item in args.kernel_regex if "=" in item)
    if len(regexes) != len(args.kernel_regex):
        raise SystemExit("--kernel-regex takes METHOD=REGEX items")
    ncu = shutil.which(args.ncu)
    if ncu is None:
        raise SystemExit(f"{args.ncu!r} is not on PATH: Nsight Compute's ncu profiles the kernels (or set NCU)")

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/ncu_compare.py profiles CUDA kernels; no CUDA device here")
    device = torch.cuda.get_device_name()
    RAW.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods:
        try:  # a method that cannot run here (FA4 not installed, our kernel not built) is left out, with a note
            make_method(method, 1, 1, 128, args.hdim, bool(args.causal), torch.bfloat16, "bthd")
        except BackendUnsupported as e:
            print(f"note: {method} skipped: {e}")
            continue
        cmd = ncu_command(ncu, method, args.hdim, args.seqlen, args.causal, args.mode, regexes.get(method))
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        name = f"{method}_hd{args.hdim}_T{args.seqlen}_c{args.causal}_{args.mode}.csv"
        (RAW / name).write_text(proc.stdout)
        kernels = parse_raw_csv(proc.stdout) if proc.returncode == 0 and '"ID"' in proc.stdout else []
        if not kernels:
            raise SystemExit(f"ncu profiled no kernel of {method} (exit {proc.returncode}); its stderr ends:\n"
                             f"{proc.stderr[-2000:]}\nthe pattern was {cmd[cmd.index('-k') + 1]!r}: --kernel-regex")
        rows.append({"device": device, "date": date.today().isoformat(), "method": method, "hdim": args.hdim,
                     "seqlen": args.seqlen, "causal": args.causal, "mode": args.mode,
                     **({"extension": os.environ["FLASH_KERNEL_EXT"]} if method == "ours" and
                        os.environ.get("FLASH_KERNEL_EXT") else {}), **summary(kernels[0])})
    if not rows:
        raise SystemExit("no method could run here (the notes above say why)")
    merge_file(args.out, rows, _key)
    print(f"\n{device}: hd{args.hdim} T={args.seqlen} causal={args.causal} {args.mode}, one profiled launch each\n")
    print(table(rows))


if __name__ == "__main__":
    main()
