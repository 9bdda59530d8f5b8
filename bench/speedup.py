"""One build's speed-up over another from `bench/kernel.py` rows whose methods were timed in interleaved rounds.

`bench/kernel.py --candidate <build> --methods ours ours_candidate --rounds N` times the package's build (`ours`)
and another (`ours_candidate`) in turn, N rounds per cell, and keeps each round's median in `ms_rounds`. A round's
speed-up is old ms / new ms of that round, so that the two builds are compared under the same clocks and heat; a
cell's speed-up is the median of its rounds. Several result files (runs on other GPUs, or again) each give the cell a
value, and the table shows their median; the geometric mean runs over a row's cells. The lowest single round is
reported too: a cell whose every round is above 1 gained in each of them.

    python bench/speedup.py run1.json run2.json                          # ours over ours_candidate, every cell
    python bench/speedup.py run.json --new ours_candidate --old ours     # the other way round
    python bench/speedup.py run.json --mode bwd --hdims 64 128 --cells   # one line per cell, each run's value
    python bench/speedup.py varlen.json                                  # bench/kernel.py --varlen --candidate rows
    python bench/speedup.py hd64.json hd128.json --parts --new ours --old fa4  # one run saved in parts, against FA4

The table has a row per head dim and a column per sequence length, each cell "causal / non-causal"; rows of the
--varlen grids (document-masked and sliding-window) get a row per cell and a geometric mean over them. A last line
counts the cells at or above 1.00 and takes the geometric mean over all of them. --parts reads the files as parts of
one run (bench/kernel.py run once per head dim, say) instead of runs of the same cells.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# A cell of bench/kernel.py's grid, or of its --varlen grids (grid, case, window): what it times, less the method.
CELL_KEYS = ("device", "inputs", "dtype", "mode", "grid", "case", "window", "hd", "causal", "seqlen", "batch", "heads")


def cell_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in CELL_KEYS)


def round_speedups(rows: list[dict], new: str, old: str) -> dict[tuple, list[float]]:
    """Per cell of one run, old ms / new ms of each round; cells where either method did not run are left out."""
    by_cell: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if r.get("status") == "ok" and r.get("method") in (new, old):
            by_cell[cell_key(r)][r["method"]] = r
    out = {}
    for cell, methods in by_cell.items():
        if new not in methods or old not in methods:
            continue
        a, b = methods[new].get("ms_rounds") or [methods[new]["ms"]], methods[old].get("ms_rounds") or [methods[old]["ms"]]
        if len(a) != len(b):
            raise ValueError(f"cell {dict(zip(CELL_KEYS, cell))}: {new} has {len(a)} rounds and {old} {len(b)}; "
                             "interleaved rounds pair one to one")
        out[cell] = [y / x for x, y in zip(a, b)]
    return out


def combine(runs: list[dict[tuple, list[float]]]) -> dict[tuple, dict]:
    """Per cell present in every run: each run's median round, their median, and the lowest round of all."""
    cells = set.intersection(*(set(r) for r in runs)) if runs else set()
    out = {}
    for cell in cells:
        per_run = [statistics.median(r[cell]) for r in runs]
        out[cell] = {"runs": per_run, "speedup": statistics.median(per_run),
                     "lowest_round": min(min(r[cell]) for r in runs)}
    return out


def table(cells: dict[tuple, dict]) -> str:
    """Markdown: a row per (device, mode, head dim), a column per sequence length, "causal / non-causal" cells; the
    --varlen grids' cells (every one causal) a row each."""
    idx = {k: i for i, k in enumerate(CELL_KEYS)}
    varlen = {c: v for c, v in cells.items() if c[idx["grid"]] is not None}
    cells = {c: v for c, v in cells.items() if c[idx["grid"]] is None}
    lines = varlen_table(varlen).splitlines() if varlen else []
    rows: dict[tuple, dict[int, dict[bool, float]]] = defaultdict(lambda: defaultdict(dict))
    for cell, v in cells.items():
        rows[(cell[idx["device"]], cell[idx["mode"]], cell[idx["hd"]])][cell[idx["seqlen"]]][bool(cell[idx["causal"]])] = (
            v["speedup"])
    seqlens = sorted({cell[idx["seqlen"]] for cell in cells})
    label = lambda t: f"{t // 1024}k" if t % 1024 == 0 else str(t)
    for device, mode in sorted({(d, m) for d, m, _ in rows}):
        lines += [f"{device}, {mode}: speed-up, causal / non-causal", "",
                  "| head dim | " + " | ".join(label(t) for t in seqlens) + " | geometric mean |",
                  "|---" * (len(seqlens) + 2) + "|"]
        for (d, m, hd) in sorted(k for k in rows if k[:2] == (device, mode)):
            by_t = rows[(d, m, hd)]
            fmt = lambda x: "-" if x is None else f"{x:.3f}"
            row = [" / ".join(fmt(by_t.get(t, {}).get(c)) for c in (True, False)) for t in seqlens]
            means = [[x for t in seqlens if (x := by_t.get(t, {}).get(c)) is not None] for c in (True, False)]
            row.append(" / ".join(fmt(statistics.geometric_mean(v) if v else None) for v in means))
            lines.append(f"| {hd} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def named(cells: dict[tuple, dict]) -> list[tuple[dict, dict]]:
    """(the cell's fields by name, its values) per cell, by device, mode, grid, head dim, causal first, case, window
    and sequence length."""
    pairs = [(dict(zip(CELL_KEYS, cell)), v) for cell, v in cells.items()]
    return sorted(pairs, key=lambda p: (str(p[0]["device"]), str(p[0]["mode"]), str(p[0]["grid"]), p[0]["hd"],
                                        not p[0]["causal"], str(p[0]["case"]), p[0]["window"] or 0, p[0]["seqlen"] or 0))


def varlen_table(cells: dict[tuple, dict]) -> str:
    """Markdown: a row per --varlen cell (grid, case, window: -1 for none), its speed-up and lowest round."""
    fields = named(cells)
    lines = []
    for device, mode in sorted({(str(d["device"]), str(d["mode"])) for d, _ in fields}):
        here = [(d, v) for d, v in fields if (str(d["device"]), str(d["mode"])) == (device, mode)]
        lines += [f"{device}, {mode}: speed-up, --varlen grids (causal)", "",
                  "| grid | case | window | head dim | speed-up | lowest round |", "|---|---|---|---|---|---|"]
        lines += [f"| {d['grid']} | {d['case']} | {d['window']} | {d['hd']} | {v['speedup']:.3f} | "
                  f"{v['lowest_round']:.3f} |" for d, v in here]
        lines.append(f"\ngeometric mean over {len(here)} cells: "
                     f"{statistics.geometric_mean([v['speedup'] for _, v in here]):.3f}\n")
    return "\n".join(lines)


def summary(cells: dict[tuple, dict]) -> str:
    """How many cells are at or above 1.00, of how many, and the geometric mean over all of them."""
    values = [v["speedup"] for v in cells.values()]
    return (f"{sum(x >= 1.0 for x in values)} of {len(values)} cells at or above 1.00; geometric mean "
            f"{statistics.geometric_mean(values):.3f}")


def cell_lines(cells: dict[tuple, dict]) -> str:
    out = []
    for d, v in named(cells):
        where = f"{d['grid']} {d['case']} w{d['window']}" if d["grid"] is not None else d["seqlen"]
        out.append(f"{d['mode']} hd{d['hd']} {'causal' if d['causal'] else 'non-causal'} {where}: "
                   f"{v['speedup']:.3f} (runs {' '.join(f'{x:.3f}' for x in v['runs'])}; lowest round "
                   f"{v['lowest_round']:.3f})")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="bench/kernel.py result files, one per run")
    p.add_argument("--new", default="ours", help="the method whose speed-up is shown (default: ours)")
    p.add_argument("--old", default="ours_candidate", help="the method it is over (default: ours_candidate)")
    p.add_argument("--mode", nargs="+", default=None, help="only these modes (fwd, bwd, fwd_bwd)")
    p.add_argument("--hdims", nargs="+", type=int, default=None, help="only these head dims")
    p.add_argument("--cells", action="store_true", help="one line per cell with each run's value, after the table")
    p.add_argument("--parts", action="store_true",
                   help="the files are parts of one run (e.g. one per head dim), not runs of the same cells")
    args = p.parse_args(argv)
    if args.new == args.old:
        p.error(f"--new and --old are both {args.new!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    files = []
    for path in args.results:
        try:
            rows = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"bench/speedup.py: {path}: not a bench/kernel.py result file ({e})")
        files.append((path, [r for r in rows if (args.mode is None or r.get("mode") in args.mode)
                             and (args.hdims is None or r.get("hd") in args.hdims)]))
    if args.parts:
        seen: dict[tuple, int] = {}
        for n, (path, rows) in enumerate(files):
            for r in rows:
                key = (cell_key(r), r.get("method"))
                if seen.setdefault(key, n) != n:
                    sys.exit(f"bench/speedup.py: {path} and {files[seen[key]][0]} both time {r.get('method')} in "
                             f"cell {dict(zip(CELL_KEYS, key[0]))}: parts of one run do not overlap (runs of the "
                             "same cells: leave out --parts)")
        files = [(", ".join(str(p) for p, _ in files), [r for _, rows in files for r in rows])]
    runs = []
    for path, rows in files:
        try:
            runs.append(round_speedups(rows, args.new, args.old))
        except ValueError as e:
            sys.exit(f"bench/speedup.py: {path}: {e}")
    cells = combine(runs)
    if not cells:
        sys.exit(f"bench/speedup.py: no cell has both {args.new!r} and {args.old!r} in every file")
    print(f"{args.new} over {args.old}: median of per-round speed-ups (old ms / new ms), then the median over "
          f"{len(runs)} run(s)\n")
    print(table(cells))
    print(summary(cells))
    if args.cells:
        print(cell_lines(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
