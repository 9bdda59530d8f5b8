"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's source view (its SASS with the warp-stall
samples of each instruction) for one attention case, and a summary of such views side by side.

ncu_compare.py tells how many cycles each stall reason costs per issued instruction over a whole kernel; this tells
at which instructions the samples fall. A warp held by a barrier is sampled on the instruction after it (with
BAR.SYNC.DEFER_BLOCKING, the first one that needs the barrier), so each line of the summary also shows the last
barrier or wait before it.

    python bench/ncu_source.py profile --methods ours fa4 --hdim 128 --seqlen 8192 --causal 1 --mode bwd  # GPU, ncu
    python bench/ncu_source.py summary v39=bench/results/ncu/source_ours_hd128_T8192_c1_bwd.csv.gz \\
        fa4=bench/results/ncu/source_fa4_hd128_T8192_c1_bwd.csv.gz --top 20                           # anywhere
    python bench/ncu_source.py summary ours=... fa4=... --opcodes --per 262144   # by kind of instruction, per
                                                                                 # 64 queries of a 128-key tile

`profile` runs bench/ncu_case.py under `ncu --set full --import-source yes` (the warm-up call skipped, one launch of
the method's main kernel, ncu_compare.py's patterns), exports the report's source page as CSV (`--page source --csv
--print-source sass`), gzipped, into bench/results/ncu/ (ignored by git), and prints the summary.
FLASH_KERNEL_EXT=<a candidate build> makes `ours` that build.

--opcodes adds a table by kind of instruction (the opcode with its modifiers: `HGMMA.64x64x16.F32.BF16`, `STS.64`):
how many executed, the shared-memory wavefronts they took and how many of those a conflict-free access would not
have, and their share of the samples. The page counts a wgmma's operand reads from shared memory at its HGMMA, so
the table shows what each matmul and each load or store costs the shared memory; TMA's writes into it and its reads
for bulk stores and reduces are on no instruction's line. --per N divides the counts by N (a main loop's iterations,
or any unit two kernels share).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.ncu_compare import RAW, csv_number, case_command, find_ncu, kernel_filter  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
WAVEFRONTS = "L1 Wavefronts Shared"  # shared-memory wavefronts (the SourceCounters section's)
IDEAL = "L1 Wavefronts Shared Ideal"  # what they would be without bank conflicts
STALL = re.compile(r"^stall_(\w+)$")  # a reason's samples; its "(Not Issued)" twin is left out
# The instructions a warp waits behind: barriers, wgmma and scoreboard waits, mbarrier tries.
WAITS = re.compile(r"\b(BAR\.|WARPGROUP\.DEPBAR|DEPBAR|SYNCS\.|BSYNC|WARPSYNC)")


@dataclass
class Line:
    index: int        # position in the kernel's SASS
    sass: str
    samples: float
    executed: float
    reasons: dict     # stall reason -> samples
    wavefronts: float = 0.0  # shared-memory wavefronts (0 where the page has no such column)
    ideal: float = 0.0       # the wavefronts a conflict-free access would take


@dataclass
class View:
    label: str
    kernel: str
    lines: list

    @property
    def samples(self) -> float:
        return sum(line.samples for line in self.lines)


def _count(cell: str) -> float:
    """A cell's count; "-" and empty cells count nothing."""
    return csv_number(cell) or 0.0


def read_csv_text(path: Path) -> str:
    if not path.is_file():
        raise SystemExit(f"ncu_source: {path}: no such file")
    data = path.read_bytes()
    return (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()


def parse_source_csv(text: str, label: str = "") -> View:
    """ncu's source page as CSV: a "Kernel Name" line, a header, one row per SASS instruction."""
    rows = list(csv.reader(io.StringIO(text)))
    kernel = ""
    while rows and rows[0] and rows[0][0] == "Kernel Name":
        kernel = rows[0][1] if len(rows[0]) > 1 else ""
        rows = rows[1:]
    if not rows or "Source" not in rows[0] or SAMPLES not in rows[0]:
        raise SystemExit(f"ncu_source: {label or 'the input'} is not ncu's source page with warp-stall samples "
                         "(export it with --page source --csv --print-source sass from a --set full report)")
    header = rows[0]
    reasons = [(i, m.group(1)) for i, name in enumerate(header) if (m := STALL.match(name))]
    col = {name: i for i, name in enumerate(header)}

    def cell(row: list, name: str) -> float:
        return _count(row[col[name]]) if name in col else 0.0

    lines = []
    for row in rows[1:]:
        if len(row) != len(header):
            continue
        lines.append(Line(len(lines), row[col["Source"]].strip(), _count(row[col[SAMPLES]]), cell(row, EXECUTED),
                          {name: _count(row[i]) for i, name in reasons}, cell(row, WAVEFRONTS), cell(row, IDEAL)))
    if not lines:
        raise SystemExit(f"ncu_source: {label or 'the input'} holds no instruction rows")
    return View(label, kernel, lines)


def reason_shares(view: View) -> dict:
    """Each stall reason's share of all samples (%), largest first; "no column" for the samples of reasons the page
    has no column for (the source page of ncu 2025.3 lists no gmma stall, for one)."""
    total = view.samples or 1.0
    sums: dict = {}
    for line in view.lines:
        for name, n in line.reasons.items():
            sums[name] = sums.get(name, 0.0) + n
    sums["no column"] = max(0.0, view.samples - sum(sums.values()))
    return {name: 100 * n / total for name, n in sorted(sums.items(), key=lambda kv: -kv[1]) if n}


def wait_before(view: View, index: int, reach: int = 12) -> str:
    """The closest barrier or wait among the `reach` instructions before line `index` ("" if none)."""
    for line in reversed(view.lines[max(0, index - reach):index]):
        if WAITS.search(line.sass):
            return f"{index - line.index} back: {line.sass}"
    return ""


def hottest(view: View, top: int) -> list:
    return sorted(view.lines, key=lambda line: -line.samples)[:top]


def summary(view: View, top: int) -> str:
    total = view.samples or 1.0
    out = [f"### {view.label}: `{view.kernel}`", "",
           f"{len(view.lines)} SASS instructions, {view.samples:,.0f} warp-stall samples.", "",
           "stall reasons (% of samples): " +
           ", ".join(f"{name} {share:.1f}" for name, share in list(reason_shares(view).items())[:8]), "",
           "| # | % of samples | executed | instruction | reasons (% of its samples) | last barrier or wait before |",
           "|---|---|---|---|---|---|"]
    for line in hottest(view, top):
        reasons = sorted(line.reasons.items(), key=lambda kv: -kv[1])[:3]
        said = ", ".join(f"{name} {100 * n / line.samples:.0f}" for name, n in reasons if n and line.samples)
        unnamed = line.samples - sum(line.reasons.values())  # samples of a reason the page has no column for
        if line.samples and unnamed > 0.05 * line.samples:
            said += f"{', ' if said else ''}no column {100 * unnamed / line.samples:.0f}"
        wait = wait_before(view, line.index)
        out.append(f"| {line.index} | {100 * line.samples / total:.2f} | {line.executed:,.0f} | `{line.sass}` | "
                   f"{said} | {f'`{wait}`' if wait else ''} |")
    return "\n".join(out)


def opcode(sass: str) -> str:
    """An instruction's opcode with its modifiers, without its predicate: `@!P4 STS.64 [R186], R172` -> `STS.64`."""
    words = [word for word in sass.split() if not word.startswith("@")]
    return words[0] if words else ""


def by_opcode(view: View, per: float = 1.0) -> str:
    """The view's instructions by kind: every kind that takes shared-memory wavefronts, most first, then the ten
    that take none with the most samples, and the sums of all; executed, wavefronts, those above a conflict-free
    access's, % of samples; counts divided by `per`."""
    kinds: dict = {}
    for line in view.lines:
        kind = kinds.setdefault(opcode(line.sass), [0.0, 0.0, 0.0, 0.0])
        for i, n in enumerate((line.executed, line.wavefronts, line.wavefronts - line.ideal, line.samples)):
            kind[i] += n
    total = view.samples or 1.0
    unit = "" if per == 1 else f" (per {per:,.0f})"
    out = [f"### {view.label}: by kind of instruction{unit}", "",
           "| instruction | executed | shared-memory wavefronts | above conflict-free | % of samples |",
           "|---|---|---|---|---|"]
    rows = sorted(kinds.items(), key=lambda kv: (-kv[1][1], -kv[1][3]))
    shown = [kv for kv in rows if kv[1][1] > 0] + [kv for kv in rows if kv[1][1] <= 0][:10]
    for name, (executed, waves, excess, samples) in shown:
        out.append(f"| `{name}` | {executed / per:,.1f} | {waves / per:,.1f} | {excess / per:,.1f} | "
                   f"{100 * samples / total:.1f} |")
    sums = [sum(kind[i] for kind in kinds.values()) for i in range(3)]
    out.append(f"| all {len(kinds)} kinds | {sums[0] / per:,.1f} | {sums[1] / per:,.1f} | {sums[2] / per:,.1f} | "
               "100.0 |")
    return "\n".join(out)


def read_views(specs: list[str]) -> list[View]:
    """LABEL=FILE or FILE (labelled by its name) -> the parsed views."""
    views = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = Path(spec).name.split(".")[0], spec
        views.append(parse_source_csv(read_csv_text(Path(path)), label))
    return views


def source_name(method: str, args: argparse.Namespace) -> str:
    return f"source_{method}_hd{args.hdim}_T{args.seqlen}_c{args.causal}_{args.mode}.csv.gz"


def profile_commands(ncu: str, method: str, args: argparse.Namespace, report: Path, regex: str | None = None):
    """The ncu command that profiles `method`'s main kernel into `report` (.ncu-rep), and the one that exports its
    source page."""
    run = [ncu, "--set", "full", "--import-source", "yes", *kernel_filter(method, args.mode, regex), "-f",
           "-o", str(report), *case_command(method, args.hdim, args.seqlen, args.causal, args.mode)]
    export = [ncu, "--import", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"]
    return run, export


def profile(args: argparse.Namespace, regexes: dict) -> list[View]:
    ncu = find_ncu(args.ncu)
    args.raw.mkdir(parents=True, exist_ok=True)
    views = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            run, export = profile_commands(ncu, method, args, Path(tmp) / method, regexes.get(method))
            print("$", " ".join(run), flush=True)
            done = subprocess.run(run, capture_output=True, text=True)
            if done.returncode != 0 or not (Path(tmp) / f"{method}.ncu-rep").is_file():
                print(f"note: {method} not profiled (ncu exit {done.returncode}); its output ends:\n"
                      f"{(done.stdout + done.stderr)[-1500:]}")
                continue
            page = subprocess.run(export, capture_output=True, text=True)
            if page.returncode != 0:
                raise SystemExit(f"ncu_source: exporting {method}'s source page failed: {page.stderr[-1500:]}")
            path = args.raw / source_name(method, args)
            path.write_bytes(gzip.compress(page.stdout.encode()))
            print(f"{method}: {path}")
            views.append(parse_source_csv(page.stdout, method))
    if not views:
        raise SystemExit("ncu_source: no method could be profiled here (the notes above say why)")
    return views


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("profile", help="profile methods on this GPU, save their source pages, summarize them")
    pr.add_argument("--methods", nargs="+", default=["ours", "fa4"])
    pr.add_argument("--hdim", type=int, default=128)
    pr.add_argument("--seqlen", type=int, default=8192)
    pr.add_argument("--causal", type=int, choices=[0, 1], default=0)
    pr.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    pr.add_argument("--kernel-regex", nargs="+", default=[], metavar="METHOD=REGEX")
    pr.add_argument("--ncu", default=os.environ.get("NCU", "ncu"))
    pr.add_argument("--raw", type=Path, default=RAW, help="where the gzipped source pages go")
    pr.add_argument("--top", type=int, default=25)
    su = sub.add_parser("summary", help="summarize saved source pages ([LABEL=]FILE, .csv or .csv.gz)")
    su.add_argument("inputs", nargs="+", metavar="[LABEL=]FILE")
    su.add_argument("--top", type=int, default=25)
    for parser in (pr, su):
        parser.add_argument("--opcodes", action="store_true",
                            help="also a table by kind of instruction: executed, shared-memory wavefronts, samples")
        parser.add_argument("--per", type=float, default=1.0, metavar="N",
                            help="with --opcodes: counts divided by N (a main loop's iterations)")
    args = ap.parse_args(argv)
    if args.per <= 0:
        raise SystemExit(f"ncu_source: --per {args.per:g} is not a positive count")
    if args.command == "profile":
        regexes = dict(item.split("=", 1) for item in args.kernel_regex if "=" in item)
        if len(regexes) != len(args.kernel_regex):
            raise SystemExit("ncu_source: --kernel-regex takes METHOD=REGEX items")
        views = profile(args, regexes)
    else:
        views = read_views(args.inputs)
    print("\n\n".join(summary(view, args.top) for view in views))
    if args.opcodes:
        print("\n\n" + "\n\n".join(by_opcode(view, args.per) for view in views))
    return 0


if __name__ == "__main__":
    sys.exit(main())
