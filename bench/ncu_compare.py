"""Nsight Compute on two attention kernels for the same case, side by side: where one spends the cycles the other
does not (our kernel against FlashAttention-4's on the same shape: tensor pipe, stalls, traffic).

Each method's main kernel of the case (bench/ncu_case.py: B*T = 16k, hidden 2048, bf16) is profiled once by
`ncu --set full` after the warm-up call, and a chosen set of its metrics is printed beside the other methods' with
the ratio to the first method (a method that cannot run here, such as FA4 where `flash_attn.cute` does not import,
is left out with a note): the time, how busy the tensor pipe, the issue slots and the FMA / ALU / XU pipes are,
the instructions executed, the warps' stall reasons per issued instruction, L2 traffic, DRAM bytes read and
written, shared-memory wavefronts and bank conflicts, the launch (registers, shared memory, grid).
FLASH_KERNEL_EXT=<a candidate build> makes `ours` that build.

    python bench/ncu_compare.py --hdim 128 --seqlen 8192 --causal 0 --mode fwd            # ours against fa4
    python bench/ncu_compare.py --hdim 64 --seqlen 16384 --causal 1 --mode bwd --methods ours sdpa_cudnn \\
        --kernel-regex sdpa_cudnn=cudnn                                                     # a pattern of your own
    python bench/ncu_compare.py --hdim 128 --seqlen 8192 --from-raw                       # the saved profiles again

Rows merge into bench/results/ncu.json, keyed by device, method, case and kernel; the raw CSV of each profile
stays beside it in bench/results/ncu/ (ignored by git). --from-raw summarizes those saved CSVs in place of
profiling (no GPU, torch CUDA or ncu needed): the same rows and table, the device as the CSV names it
(device__attribute_display_name), the date that of the CSV file.
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

# (label, ncu metric names): what the table shows, in its order. A row's names are alternatives, the first one a
# kernel's profile holds is shown: the name ncu 2025.3.1 reports on the H200 first, then the names of other ncu
# versions. A metric none of whose names the profile holds shows "–".
METRICS = [
    ("time (µs)", ("gpu__time_duration.sum",)),
    # all the tensor pipe's work (wgmma and mma); the second name counts wgmma alone
    ("tensor pipe active (%)", ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                                "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active")),
    ("issue slots busy (%)", ("smsp__issue_active.avg.pct_of_peak_sustained_active",
                              "sm__inst_issued.avg.pct_of_peak_sustained_active")),
    ("FMA pipe active (%)", ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",)),
    ("ALU pipe active (%)", ("sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",)),
    # the XU pipe's instructions executed against its peak rate; the second name counts its active cycles
    ("XU (MUFU) pipe use (% of peak)", ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
                                        "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active")),
    ("instructions (M)", ("smsp__inst_executed.sum",)),
    # every L2 access (reads, writes, atomics): 32-byte sectors, or their bytes
    ("L2 traffic (MB)", ("lts__t_sectors.sum", "lts__t_bytes.sum")),
    ("DRAM read (MB)", ("dram__bytes_read.sum",)),
    ("DRAM written (MB)", ("dram__bytes_write.sum",)),
    ("shared-memory wavefronts (M)", ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",)),
    ("shared-memory bank conflicts (M)", ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",)),
    ("registers per thread", ("launch__registers_per_thread",)),
    ("dynamic shared memory (KiB)", ("launch__shared_mem_per_block_dynamic",)),
    ("grid", ("launch__grid_size",)),
    ("block", ("launch__block_size",)),
]
# metric name: (the units it may come in, None for any; the factor to the table's unit). The base units under
# --print-units base, as ncu versions spell them (2025.3.1: "ns", "byte", "byte/block", "sector", "%"). Every
# alternative name of a row that scales or checks its unit has its own entry.
NSECOND, BYTE, SECTOR, PERCENT = ("nsecond", "ns"), ("byte", "B"), ("sector",), ("%",)
SECTOR_BYTES = 32
SCALE = {"gpu__time_duration.sum": (NSECOND, 1e-3), "smsp__inst_executed.sum": (None, 1e-6),
         "lts__t_sectors.sum": (SECTOR, SECTOR_BYTES * 1e-6), "lts__t_bytes.sum": (BYTE, 1e-6),
         "dram__bytes_read.sum": (BYTE, 1e-6), "dram__bytes_write.sum": (BYTE, 1e-6),
         "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": (None, 1e-6),
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": (None, 1e-6),
         "launch__shared_mem_per_block_dynamic": (BYTE + ("byte/block",), 1 / 1024),
         **{name: (PERCENT, 1.0) for _, names in METRICS for name in names if ".pct_of_peak_" in name}}
# The raw page's column naming the profiled GPU, as torch.cuda.get_device_name() names it.
DEVICE_COLUMN = "device__attribute_display_name"
# Stall reasons: cycles a warp waited on each, per instruction it issued (ncu's "Warp State" section).
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def find_ncu(name: str) -> str:
    """The path of Nsight Compute's ncu, `name` looked up on PATH."""
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name!r} is not on PATH: Nsight Compute's ncu profiles the kernels (or set NCU)")
    return path


def kernel_filter(method: str, mode: str, regex: str | None = None) -> list[str]:
    """ncu's options that profile `method`'s main kernel once, after ncu_case.py's warm-up call (-s 1)."""
    pattern = regex or KERNELS.get((method, mode))
    if pattern is None:
        raise SystemExit(f"no kernel pattern for {method} {mode}: give --kernel-regex")
    return ["-k", f"regex:{pattern}", "-s", "1", "-c", "1"]


def case_command(method: str, hdim: int, seqlen: int, causal: int, mode: str) -> list[str]:
    """bench/ncu_case.py running the case once after its warm-up call, the program ncu profiles."""
    return [sys.executable, str(REPO / "bench" / "ncu_case.py"), "--method", method, "--hdim", str(hdim),
            "--seqlen", str(seqlen), "--causal", str(causal), "--mode", mode, "--iters", "1", "--inputs", "bthd"]


def ncu_command(ncu: str, method: str, hdim: int, seqlen: int, causal: int, mode: str,
                regex: str | None = None) -> list[str]:
    """The ncu command that profiles `method`'s main kernel once and prints its metrics as the raw page's CSV."""
    return [ncu, "--set", "full", "--page", "raw", "--csv", "--print-units", "base", "--kernel-name-base", "demangled",
            *kernel_filter(method, mode, regex), *case_command(method, hdim, seqlen, causal, mode)]


def csv_number(text: str) -> float | None:
    """An ncu CSV cell as a number ("1,024" -> 1024.0); None for "-", "n/a" and empty cells."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's `--page raw --csv`: a header row of metric names, a row of their units, one row per kernel profiled.
    Returns per kernel {"kernel": name, "device": the GPU's name or None, "units": {metric: unit},
    "values": {metric: float}} (numbers only)."""
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
        values = {m: v for m, v in ((m, csv_number(c)) for m, c in cells.items()) if v is not None}
        kernels.append({"kernel": cells["Kernel Name"], "device": cells.get(DEVICE_COLUMN) or None, "units": units,
                        "values": values})
    return kernels


def summary(kernel: dict) -> dict:
    """The METRICS (each from the first of its names the kernel has, scaled to the table's units) and every stall
    reason of one parsed kernel."""
    values, units = kernel["values"], kernel["units"]
    out = {}
    for label, names in METRICS:
        metric = next((name for name in names if name in values), None)
        if metric is None:
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


def _row(device: str, when: date, method: str, args: argparse.Namespace, kernel: dict) -> dict:
    """One method's row of ncu.json: the case, the build (FLASH_KERNEL_EXT for ours) and its kernel's summary."""
    return {"device": device, "date": when.isoformat(), "method": method, "hdim": args.hdim,
            "seqlen": args.seqlen, "causal": args.causal, "mode": args.mode,
            **({"extension": os.environ["FLASH_KERNEL_EXT"]} if method == "ours" and
               os.environ.get("FLASH_KERNEL_EXT") else {}), **summary(kernel)}


def raw_name(method: str, args: argparse.Namespace) -> str:
    """The file under RAW that holds `method`'s ncu output for the case."""
    return f"{method}_hd{args.hdim}_T{args.seqlen}_c{args.causal}_{args.mode}.csv"


def rows_from_raw(args: argparse.Namespace) -> list[dict]:
    """The rows of the saved raw CSVs of args.methods (what profiling runs wrote to RAW), without ncu or a GPU:
    the device as each CSV names it, the date that of the file. A method without its file is an error."""
    rows = []
    for method in args.methods:
        path = RAW / raw_name(method, args)
        if not path.is_file():
            raise SystemExit(f"no saved profile of {method} for this case: {path} does not exist (profile it first, "
                             "without --from-raw)")
        text = path.read_text()
        kernels = parse_raw_csv(text) if '"ID"' in text else []
        if not kernels:
            raise SystemExit(f"{path} holds no ncu raw CSV (its profile failed): profile {method} again")
        device = kernels[0]["device"]
        if device is None:
            raise SystemExit(f"{path} does not name its GPU (no {DEVICE_COLUMN} column)")
        rows.append(_row(device, date.fromtimestamp(path.stat().st_mtime), method, args, kernels[0]))
    devices = sorted({r["device"] for r in rows})
    if len(devices) > 1:
        raise SystemExit(f"the saved profiles are of different GPUs ({', '.join(devices)}): profile them again on one")
    return rows


def profile(args: argparse.Namespace, regexes: dict[str, str]) -> list[dict]:
    """Each method of args.methods profiled by ncu on this GPU, its raw CSV saved under RAW: the rows."""
    ncu = find_ncu(args.ncu)

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
        (RAW / raw_name(method, args)).write_text(proc.stdout)
        kernels = parse_raw_csv(proc.stdout) if proc.returncode == 0 and '"ID"' in proc.stdout else []
        if not kernels:
            raise SystemExit(f"ncu profiled no kernel of {method} (exit {proc.returncode}); its stderr ends:\n"
                             f"{proc.stderr[-2000:]}\nthe pattern was {cmd[cmd.index('-k') + 1]!r}: --kernel-regex")
        rows.append(_row(device, date.today(), method, args, kernels[0]))
    if not rows:
        raise SystemExit("no method could run here (the notes above say why)")
    return rows


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
    ap.add_argument("--from-raw", action="store_true",
                    help="summarize the raw CSVs a profiling run of the case saved in bench/results/ncu/ instead of "
                         "profiling (no GPU or ncu needed)")
    args = ap.parse_args(argv)
    regexes = dict(item.split("=", 1) for item in args.kernel_regex if "=" in item)
    if len(regexes) != len(args.kernel_regex):
        raise SystemExit("--kernel-regex takes METHOD=REGEX items")
    rows = rows_from_raw(args) if args.from_raw else profile(args, regexes)
    merge_file(args.out, rows, _key)
    print(f"\n{rows[0]['device']}: hd{args.hdim} T={args.seqlen} causal={args.causal} {args.mode}, "
          "one profiled launch each\n")
    print(table(rows))


if __name__ == "__main__":
    main()
