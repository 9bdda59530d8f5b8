"""Two builds' kernels side by side, instruction by instruction, read statically from their SASS: which kernels a
source change left as they were, and how far the others moved, without a GPU.

Each input is what bench/sass_mix.py reads: a cubin, an object or shared library with embedded cubins, a PTX file, or
SASS text that `cuobjdump -sass` printed. Kernels pair by name without their parameter list (c++filt's reading; by
the mangled name where c++filt is missing), so a kernel that gains a parameter keeps its pair; --rename PATTERN
REPLACEMENT rewrites the new build's names first (re.sub), for kernels whose template arguments a change added or
renamed. Each pair is one of:

  - identical: the same instructions, registers and branch targets;
  - renamed: the same program once registers (R, UR, P, UP, B) are numbered in order of first use and branch targets
    become labels: another register allocation of the same code;
  - N lines apart: the size of a line diff of the two listings with registers erased and branch targets as labels
    (a moved instruction counts twice, once each side), with the first --show of those lines.

Each pair's main loops (bench/sass_mix.py's) are compared the same way, their branch targets taken relative to the
loop, and where each starts within a 128-byte line: the same loop starting elsewhere in its line has run the hd96
backward about 1% slower or faster for that alone (docs/results.md, section 46), so a change that moves a main loop
is timed against that spread.

    # one .cu file of each tree, compiled as the build compiles it (no torch needed), then compared
    nvcc -cubin -O3 -std=c++17 --use_fast_math -gencode arch=compute_90a,code=sm_90a -DFLASH_KERNEL_SM90A \\
        -I flash_kernel/csrc flash_kernel/csrc/flash_bwd_hdim128_bf16.cu -o new.cubin    # and old.cubin in the other
    python bench/sass_diff.py v49=old.cubin v51=new.cubin --kernel flash_bwd_hopper_kernel --show 40 --check
    python bench/sass_diff.py flash_kernel/_candidate/_C*.so flash_kernel/_C*.so --kernel hopper
    # v53's forward traits gained two template arguments (V's width and span) after v52's ten
    python bench/sass_diff.py v52=old.cubin v53=new.cubin --rename '(HopperFwdTraits<[^<>]*), \\d+, \\d+>' '\\1>' \\
        --check

--check exits 1 where a pair is neither identical nor renamed, or a kernel has no pair.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

try:
    from bench import sass_mix
except ImportError:  # run as a script: bench/ is on sys.path
    import sass_mix

# Registers by class: general (R), uniform (UR), predicate (P, UP) and convergence barrier (B); RZ, URZ, PT and UPT are
# constants and stay as they are.
REGISTER = re.compile(r"\b(UR|R|UP|P|B)(\d+)\b")
ADDRESS = re.compile(r"\b0x[0-9a-f]+\b")
# Instructions whose hexadecimal operands are code addresses.
CONTROL = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?(BRA|BRX|JMP|JMX|CALL|BSSY|BREAK|BPT|RET|WARPSYNC)\b")


@dataclass
class Listing:
    """One function: its mangled name, readable name and instructions (address, text with its predicate)."""

    name: str
    readable: str
    code: list[tuple[int, str]]


def labelled(code: list[tuple[int, str]]) -> list[str]:
    """The instructions with every branch target as a label: `Lk:` before the instruction it names (k by address
    order) and `Lk` in place of the address in the instructions that jump there."""
    addresses = {address for address, _ in code}
    targets = sorted({int(a, 16) for _, text in code if CONTROL.match(text) for a in ADDRESS.findall(text)
                      if int(a, 16) in addresses})
    label = {address: f"L{k}" for k, address in enumerate(targets)}
    out = []
    for address, text in code:
        if address in label:
            out.append(f"{label[address]}:")
        if CONTROL.match(text):
            text = ADDRESS.sub(lambda m: label.get(int(m.group(0), 16), m.group(0)), text)
        out.append(text)
    return out


def renamed(lines: list[str]) -> list[str]:
    """Registers numbered per class in order of first use: R7, R3, R7 -> R0, R1, R0."""
    names: dict[str, dict[str, str]] = {}

    def rename(m: re.Match) -> str:
        seen = names.setdefault(m.group(1), {})
        return seen.setdefault(m.group(0), f"{m.group(1)}{len(seen)}")
    return [REGISTER.sub(rename, line) for line in lines]


def erased(lines: list[str]) -> list[str]:
    """Registers erased (each class to its letter): what remains is the instruction stream and its constants."""
    return [REGISTER.sub(lambda m: m.group(1), line) for line in lines]


def line_diff(a: list[str], b: list[str]) -> list[str]:
    """The lines of a unified diff of two erased listings that one side has and the other has not."""
    return [line for line in difflib.unified_diff(erased(a), erased(b), "old", "new", n=0, lineterm="")
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def apart(diff: list[str]) -> str:
    return f"{len(diff)} line{'' if len(diff) == 1 else 's'} apart"


LINE_BYTES = 128  # instruction fetch's line: where in one a main loop starts


def main_loop(listing: Listing) -> tuple[int, list[str]] | None:
    """A listing's main loop (bench/sass_mix.py's choice): its start address, and its instructions with branch
    targets inside it as labels and those outside it as distances in bytes from its nearer end (`start-N`,
    `end+N`), so that the same loop elsewhere in its function reads the same. None without a loop."""
    stripped = sass_mix.Kernel(listing.name, [(a, sass_mix.PREDICATE.sub("", t)) for a, t in listing.code])
    loop = sass_mix.main_loop(stripped)
    if loop is None:
        return None
    lo, hi = loop

    def target(address: int) -> str:
        if address < lo:
            return f"start-{lo - address}"
        return f"end+{address - hi}" if address > hi else f"{address - lo:#x}"

    def rebased(text: str) -> str:
        return ADDRESS.sub(lambda m: target(int(m.group(0), 16)), text) if CONTROL.match(text) else text
    return lo, labelled([(a - lo, rebased(t)) for a, t in listing.code if lo <= a <= hi])


def compare_loops(old: Listing, new: Listing) -> str:
    """The main loops of a pair: "the same" (one program, up to register allocation) or how many lines apart, then
    where each starts in its 128-byte line ("at 64", or "at 64 -> 80" where the loop moved within its line)."""
    loops = [main_loop(x) for x in (old, new)]
    if None in loops:
        return "-"
    (lo_a, a), (lo_b, b) = loops
    code = "the same" if renamed(a) == renamed(b) else apart(line_diff(a, b))
    starts = [lo % LINE_BYTES for lo in (lo_a, lo_b)]
    return f"{code}, at {starts[0]}" + (f" -> {starts[1]}" if starts[1] != starts[0] else "")


@dataclass
class Comparison:
    key: str
    old: Listing | None
    new: Listing | None
    verdict: str       # identical, renamed, "N lines apart", only in old / new
    diff: list[str]    # the line diff of the erased listings (empty where identical or renamed)
    loop: str = "-"    # the main loops: "the same" or "N lines apart", and where each starts (compare_loops)


def compare(key: str, old: Listing | None, new: Listing | None) -> Comparison:
    if old is None or new is None:
        return Comparison(key, old, new, "only in new" if old is None else "only in old", [])
    loop = compare_loops(old, new)
    a, b = labelled(old.code), labelled(new.code)
    if a == b:
        return Comparison(key, old, new, "identical", [], loop)
    if renamed(a) == renamed(b):
        return Comparison(key, old, new, "renamed", [], loop)
    diff = line_diff(a, b)
    return Comparison(key, old, new, apart(diff), diff, loop)


def listings(path: Path, pattern: str) -> dict[str, Listing]:
    """The functions of one input whose mangled or readable name matches `pattern`, keyed by the readable name; where
    two functions read the same (overloads), by the readable name and the mangled one."""
    found = sass_mix.matching_kernels(path, pattern, keep_predicates=True)
    counts = Counter(readable for _, readable in found)
    return {(readable if counts[readable] == 1 else f"{readable} [{k.name}]"): Listing(k.name, readable, k.code)
            for k, readable in found}


def renamed_keys(found: dict[str, Listing], renames: list[tuple[str, str]]) -> dict[str, Listing]:
    """`found` keyed by its names after each (pattern, replacement) in turn (re.sub); two names that become one are an
    error, not a silent pair."""
    out: dict[str, Listing] = {}
    for key, listing in found.items():
        new_key = key
        for pattern, replacement in renames:
            new_key = re.sub(pattern, replacement, new_key)
        if new_key in out:
            raise SystemExit(f"sass_diff: --rename makes two kernels {new_key!r}")
        out[new_key] = listing
    return out


def pairs(old: dict[str, Listing], new: dict[str, Listing]) -> list[Comparison]:
    keys = list(old) + [k for k in new if k not in old]
    return [compare(k, old.get(k), new.get(k)) for k in keys]


def report(comparisons: list[Comparison], labels: tuple[str, str], show: int) -> str:
    """Markdown: one row per kernel, then the first `show` differing lines of each pair that differs."""
    lines = [f"| kernel | {labels[0]} instructions | {labels[1]} instructions | "
             f"| main loop, its start mod {LINE_BYTES} |", "|---|---|---|---|---|"]
    for c in comparisons:
        count = [str(len(x.code)) if x else "-" for x in (c.old, c.new)]
        lines.append(f"| `{c.key}` | {count[0]} | {count[1]} | {c.verdict} | {c.loop} |")
    for c in comparisons:
        if c.diff and show > 0:
            lines += ["", f"`{c.key}` (- {labels[0]}, + {labels[1]}):", "```", *c.diff[:show]]
            if len(c.diff) > show:
                lines.append(f"... {len(c.diff) - show} more")
            lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", metavar="[LABEL=]OLD", help="cubin, .o, .so, .ptx or cuobjdump's .sass text")
    p.add_argument("new", metavar="[LABEL=]NEW")
    p.add_argument("--kernel", default=".", metavar="REGEX", help="the kernels to compare (default: all)")
    p.add_argument("--show", type=int, default=20, help="differing lines printed per pair (default 20)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 where a pair is neither identical nor renamed, or a kernel has no pair")
    p.add_argument("--rename", nargs=2, action="append", default=[], metavar=("PATTERN", "REPLACEMENT"),
                   help="rewrite the new build's kernel names by re.sub before pairing (repeatable)")
    args = p.parse_args(argv)
    specs = [sass_mix.split_spec(s) for s in (args.old, args.new)]
    labels = tuple(label or default for (label, _), default in zip(specs, ("old", "new")))
    found = [listings(path, args.kernel) for _, path in specs]
    found[1] = renamed_keys(found[1], args.rename)
    if not found[0] and not found[1]:
        raise SystemExit(f"sass_diff: no kernel matches {args.kernel!r}")
    comparisons = pairs(*found)
    print(report(comparisons, labels, args.show))
    moved = [c for c in comparisons if c.verdict not in ("identical", "renamed")]
    return 1 if args.check and moved else 0


if __name__ == "__main__":
    sys.exit(main())
