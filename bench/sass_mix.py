"""The instruction mix of a kernel's main loop, read statically from its SASS: what one iteration of our kernel
issues against another's (FlashAttention-4's, say), without a GPU.

Each input is a cubin, an object or shared library with embedded cubins (`cuobjdump -sass` reads them), a PTX file
(compiled first by `ptxas -arch=<its .target>`), or SASS text that cuobjdump printed. Of every kernel whose name
matches --kernel, the main loop is the backward branch whose range holds the most tensor-core instructions
(HGMMA, HMMA; the most instructions where there are none) and holds no other loop that has any (a persistent kernel's
loop over its tiles holds its main loop); its instructions are counted by class and by opcode.
The counts are static: an instruction on a path the loop skips at run time (a diagonal block's mask, say) counts as
much as one every iteration runs, and spin loops on an mbarrier, placed out of line, are not the main loop.

    python bench/sass_mix.py flash_kernel/_C*.so --kernel 'hopper_kernel<.*HopperBwdTraits<128,.*true, false>'
    python bench/sass_mix.py ours=flash_kernel/_C*.so fa4=fa4_ptx/bwd.ptx --top 25 \\
        --kernel 'ours=bwd_hopper_kernel<.*<128,.*bfloat16.*true, false>' --kernel 'fa4=Backward'

FA4 writes its kernels' PTX where CUTE_DSL_KEEP_PTX=1 and CUTE_DSL_DUMP_DIR=<dir> are set when it compiles them.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# (class, opcode pattern): the first pattern that matches an opcode (its name before the first '.') names its class.
CLASSES = [
    ("tensor core", r"HGMMA|HMMA|WARPGROUP|IMMA|QGMMA"),
    ("global / TMA", r"LDG|STG|RED|ATOMG|LDGSTS|LDGDEPBAR|UBLKRED|UBLKCP|UBLKPF|UTMA\w*|LD|ST"),
    ("uniform datapath", r"U[A-Z0-9]+|R2UR|S2UR|VOTEU"),
    ("fp32 math", r"FFMA|FMUL|FADD|FMNMX|FSEL|FSETP|FSWZADD|FCHK"),
    ("special function (MUFU)", r"MUFU"),
    ("conversion, packing", r"F2FP|F2F|F2I|I2F|FRND|PRMT"),
    ("shared memory", r"LDS|STS|LDSM|STSM|ATOMS|REDS"),
    ("local memory (spills)", r"LDL|STL"),
    ("barriers, fences", r"BAR|SYNCS|MEMBAR|FENCE|DEPBAR|WARPSYNC|CCTL|ERRBAR"),
    ("branches", r"BRA|BRX|JMP|BSSY|BSYNC|EXIT|CALL|RET|YIELD|BREAK|NANOSLEEP"),
    ("integer, predicates", r"IMAD|IADD3|IADD|LEA|LOP3|SHF|SHL|SHR|ISETP|PLOP3|SEL|P2R|R2P|VIADD\w*|IMNMX|"
                            r"POPC|FLO|BREV|IABS|BMSK|SGXT|LOP|MOV|S2R|CS2R|SHFL|VOTE|MATCH|NOP|LDC|IDP|IMUL|ELECT"),
]
TENSOR = re.compile(r"^(HGMMA|HMMA|IMMA|QGMMA)\b")
LINE = re.compile(r"^\s*/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")  # cuobjdump: "/*0470*/  OPCODE operands ;"
FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")
BRANCH_TARGET = re.compile(r"^BRA(?:\.\S+)?\s+(?:!?U?P[T0-9]+,\s*)?(0x[0-9a-f]+)")


@dataclass
class Kernel:
    """One function of the SASS listing: its (mangled) name and (address, instruction text without predicate) in
    order."""

    name: str
    code: list[tuple[int, str]] = field(default_factory=list)


def without_parameters(name: str) -> str:
    """A demangled function's name without its parameter list, the parenthesized group it ends with (scopes such as
    `(anonymous namespace)::` before it stay), and without a `void ` return type."""
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return re.sub(r"^void ", "", name)


def demangle(names: list[str]) -> list[str]:
    """C++ names as c++filt prints them (template arguments kept, the parameter list dropped); the names as they
    are without c++filt."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return names
    done = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    readable = done.stdout.splitlines() if done.returncode == 0 else []
    if len(readable) != len(names):
        return names
    return [without_parameters(r) for r in readable]


def opcode(text: str) -> str:
    """'HGMMA.64x64x16.F32.BF16 R152, ...' -> 'HGMMA.64x64x16.F32.BF16'."""
    return text.split()[0] if text.split() else ""


def class_of(op: str) -> str:
    base = op.split(".")[0]
    for name, pattern in CLASSES:
        if re.fullmatch(pattern, base):
            return name
    return "other"


def parse_sass(text: str, keep_predicates: bool = False) -> list[Kernel]:
    """The functions of a `cuobjdump -sass` listing, each with its instructions (predicates stripped, unless kept)."""
    kernels: list[Kernel] = []
    for line in text.splitlines():
        if m := FUNCTION.match(line):
            kernels.append(Kernel(m.group(1)))
        elif (m := LINE.match(line)) and kernels:
            text_here = m.group(2) if keep_predicates else PREDICATE.sub("", m.group(2))
            kernels[-1].code.append((int(m.group(1), 16), text_here.strip()))
    return kernels


def loops(kernel: Kernel) -> list[tuple[int, int]]:
    """Every backward branch as (first address, branch address), the loop's range; not the jumps back from the
    out-of-line blocks past the kernel's EXIT (an mbarrier's spin wait returns to the code that waited), whose range
    holds an EXIT."""
    exits = [address for address, text in kernel.code if opcode(text) == "EXIT"]
    found = []
    for address, text in kernel.code:
        if (m := BRANCH_TARGET.match(text)) and (target := int(m.group(1), 16)) < address:
            if not any(target <= e <= address for e in exits):
                found.append((target, address))
    return found


def body(kernel: Kernel, loop: tuple[int, int]) -> list[str]:
    lo, hi = loop
    return [text for address, text in kernel.code if lo <= address <= hi]


def main_loop(kernel: Kernel) -> tuple[int, int] | None:
    """Of the innermost loops over tensor-core instructions (none of their nested loops has any), the one with the
    most of them, then the most instructions: a persistent kernel's loop over its tiles holds the main loop with each
    tile's prologue and epilogue, so it is not the main loop. Without tensor-core instructions, the loop with the most
    instructions; None without a loop."""
    weight = {}  # loop -> (tensor-core instructions, instructions)
    for loop in loops(kernel):
        code = body(kernel, loop)
        weight[loop] = sum(1 for text in code if TENSOR.match(text)), len(code)

    def holds_tensor_loop(outer):
        return any(inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1] and weight[inner][0]
                   for inner in weight)

    innermost = [loop for loop in weight if weight[loop][0] and not holds_tensor_loop(loop)]
    return max(innermost or weight, key=weight.get) if weight else None


@dataclass
class Mix:
    """The instruction counts of one kernel's main loop."""

    label: str
    kernel: str  # demangled where c++filt can
    loop: tuple[int, int] | None
    total: int
    classes: collections.Counter
    opcodes: collections.Counter


def mix(label: str, kernel: Kernel, readable_name: str) -> Mix:
    loop = main_loop(kernel)
    code = body(kernel, loop) if loop else [text for _, text in kernel.code]
    ops = collections.Counter(opcode(text) for text in code)
    classes = collections.Counter()
    for op, n in ops.items():
        classes[class_of(op)] += n
    return Mix(label, readable_name, loop, len(code), classes, ops)


# ------------------------------------------------------------------------------------------------ reading inputs
def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"sass_mix: {name} is not on PATH (it comes with the CUDA toolkit)")
    return path


def _checked(done: subprocess.CompletedProcess) -> str:
    """A tool's output, or its failure as an error naming the tool and its last line."""
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise SystemExit(f"sass_mix: {' '.join(done.args[:2])} failed: {said[-1] if said else done.returncode}")
    return done.stdout


def _run(args: list[str]) -> str:
    return _checked(subprocess.run(args, capture_output=True, text=True))


def ptx_arch(ptx: str) -> str:
    """The sm_XX[a] of a PTX file's .target line (sm_90a without one)."""
    m = re.search(r"^\s*\.target\s+(sm_\d+[a-z]?)", ptx, re.MULTILINE)
    return m.group(1) if m else "sm_90a"


# ptxas's refusal of a PTX ISA newer than its own, e.g. "Unsupported .version 9.4; current version is '9.0'"
NEWER_PTX = re.compile(r"Unsupported \.version (\d+\.\d+); current version is '(\d+\.\d+)'")


def ptx_at_version(ptx: str, version: str) -> str:
    """The PTX with its .version line set to `version`."""
    return re.sub(r"^(\s*\.version\s+)\d+\.\d+", lambda m: m.group(1) + version, ptx, count=1, flags=re.MULTILINE)


def assemble_ptx(path: Path, cubin: Path) -> None:
    """ptxas on a PTX file. PTX of a newer ISA than this ptxas reads (FA4's CuTe DSL writes its own toolkit's) is
    assembled again as this ptxas's version, with a note: instructions the older ISA lacks still fail then."""
    ptx = path.read_text()
    cmd = [_tool("ptxas"), f"-arch={ptx_arch(ptx)}", "-O3", "-o", str(cubin)]
    done = subprocess.run(cmd + [str(path)], capture_output=True, text=True)
    newer = NEWER_PTX.search(done.stderr + done.stdout) if done.returncode != 0 else None
    if newer is None:
        _checked(done)
        return
    print(f"sass_mix: note: {path.name} is PTX {newer.group(1)}, this ptxas reads up to {newer.group(2)}: "
          f"assembled as {newer.group(2)}", file=sys.stderr)
    older = cubin.with_suffix(".ptx")
    older.write_text(ptx_at_version(ptx, newer.group(2)))
    _run(cmd + [str(older)])


def sass_text(path: Path) -> str:
    """The SASS listing of a .sass / .txt file as it is, of a .ptx after ptxas, of anything else by cuobjdump."""
    if path.suffix in (".sass", ".txt"):
        return path.read_text()
    if path.suffix == ".ptx":
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / (path.stem + ".cubin")
            assemble_ptx(path, cubin)
            return _run([_tool("cuobjdump"), "-sass", str(cubin)])
    return _run([_tool("cuobjdump"), "-sass", str(path)])


def kernel_patterns(specs: list[str]) -> tuple[str, dict[str, str]]:
    """--kernel values -> (the pattern for every input, {label: its own pattern}): REGEX or LABEL=REGEX."""
    shared, own = ".", {}
    for spec in specs:
        label, sep, pattern = spec.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][\w-]*", label):
            own[label] = pattern
        else:
            shared = spec
    return shared, own


def named_kernels(path: Path, keep_predicates: bool = False) -> list[tuple[Kernel, str]]:
    """The kernels of one input with their readable (demangled) names."""
    if not path.exists():
        raise SystemExit(f"sass_mix: {path}: no such file")
    kernels = parse_sass(sass_text(path), keep_predicates)
    return list(zip(kernels, demangle([k.name for k in kernels])))


def matching_kernels(path: Path, pattern: str, keep_predicates: bool = False) -> list[tuple[Kernel, str]]:
    """named_kernels of one input whose mangled or readable name matches `pattern`."""
    return [(k, readable) for k, readable in named_kernels(path, keep_predicates)
            if re.search(pattern, k.name) or re.search(pattern, readable)]


def split_spec(spec: str) -> tuple[str | None, Path]:
    """LABEL=PATH or PATH: (the label, or None, and the path)."""
    label, sep, path = spec.rpartition("=")
    return (label if sep else None), Path(path)


def read_inputs(specs: list[str], pattern: str, own: dict[str, str] | None = None) -> list[Mix]:
    """LABEL=PATH or PATH per input; the mix of each kernel that matches the label's own pattern, else `pattern`."""
    mixes = []
    for spec in specs:
        label, path = split_spec(spec)
        pattern_here = (own or {}).get(label, pattern)
        named = matching_kernels(path, pattern_here)
        if not named:
            raise SystemExit(f"sass_mix: no kernel of {path} matches {pattern_here!r} (--list shows their names)")
        mixes += [mix(label or path.name, k, readable) for k, readable in named]
    return mixes


# ------------------------------------------------------------------------------------------------ output
def table(mixes: list[Mix], top: int) -> str:
    """Markdown: each kernel's loop, its instructions per class, then the most frequent opcodes."""
    lines = ["| | " + " | ".join(m.label for m in mixes) + " |", "|---" * (len(mixes) + 1) + "|"]
    lines.append("| kernel | " + " | ".join(f"`{m.kernel}`" for m in mixes) + " |")
    where = [f"{m.loop[0]:#x}-{m.loop[1]:#x}" if m.loop else "no loop: the whole kernel" for m in mixes]
    lines.append("| loop (addresses) | " + " | ".join(where) + " |")
    lines.append("| instructions | " + " | ".join(str(m.total) for m in mixes) + " |")
    for name in [c for c, _ in CLASSES] + ["other"]:
        if any(m.classes[name] for m in mixes):
            cells = [f"{m.classes[name]} ({100 * m.classes[name] / max(m.total, 1):.0f}%)" for m in mixes]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    common = collections.Counter()
    for m in mixes:
        common.update(m.opcodes)
    lines += ["", "| opcode | " + " | ".join(m.label for m in mixes) + " |", "|---" * (len(mixes) + 1) + "|"]
    for op, _ in common.most_common(top):
        lines.append(f"| {op} | " + " | ".join(str(m.opcodes[op]) for m in mixes) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="[LABEL=]FILE", help="cubin, .o, .so, .ptx or cuobjdump's .sass text")
    p.add_argument("--kernel", action="append", default=[], metavar="[LABEL=]REGEX",
                   help="the kernels to count: a regular expression on their names (mangled or not), for every "
                        "input or, as LABEL=REGEX, for that input's; repeatable; default: all")
    p.add_argument("--list", action="store_true", help="print the kernels' names and loops, then stop")
    p.add_argument("--top", type=int, default=20, help="opcodes listed (the most frequent over all inputs)")
    args = p.parse_args(argv)
    if args.list:
        for spec in args.inputs:
            path = split_spec(spec)[1]
            for k, readable in named_kernels(path):
                print(f"{path.name}: {readable} ({len(k.code)} instructions, {len(loops(k))} loops)\n    {k.name}")
        return 0
    print(table(read_inputs(args.inputs, *kernel_patterns(args.kernel)), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
