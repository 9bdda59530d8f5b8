#!/usr/bin/env bash
# Issue 5 sweep: compile-time kernel variants of flash_kernel/csrc/kernel_traits.h (FLASH_FWD_HD128_VARIANT,
# FLASH_BWD_HD128_VARIANT), each built, checked against the fp32 reference and timed against SDPA's FLASH
# backend in the same process, for the head dims in HDIMS. One GPU call each (the v5 sweep, six variants at
# one head dim, took about 5 minutes on an H100):
#
#   bash bench/kernel_sweep.sh                       # v3 (the default build) v1 v2 v4 v3b at hd128
#   bash bench/kernel_sweep.sh v3 v4 v3b             # some of them, by name (the first that runs is the baseline)
#
# The variants measured and deleted since (docs/kernel_notes.md): v4's backward kernel (v0, and a0/a0b
# against the tiled backward at hd 32-256) and the Hopper forward's overlapped softmax (h1 against h0/h0b).
# A new variant is a macro in the traits headers plus a line in VARIANTS below.
#
# Per variant: (1) `python3 -m flash_kernel.build` with FLASH_KERNEL_NVCC_EXTRA naming the variant (sm 90a
# only; after the first build only the .cu files recompile); (2) flash_kernel.sanitize.check_case on the
# cases below for each head dim in HDIMS (odd lengths, Tq != Tk both ways, GQA, deterministic bitwise,
# strided qkv, d = hd - 8); a failing variant is reported as FAIL and not timed; (3) bench/kernel.py
# (triton do_bench medians) for ours and sdpa_flash, each head dim in HDIMS, causal and not, T = 2048 and
# 8192 (B = 16384 / T, H = 2048 / hd), fwd, bwd and fwd+bwd. Every step has its own timeout, clipped to the
# time left before SWEEP_DEADLINE_S, so the whole sweep ends inside one 10-minute call; a variant that cannot
# start in time is reported as SKIPPED. "vs <first>" columns compare with the first variant that ran.
# Forward rows: the v* variants are sm80-forward variants, so they run with FLASH_KERNEL_FWD=sm80; any other
# line would run the Hopper forward. At the end the package holds the last variant's build (sm 90a only):
# run `make build` afterwards for the default kernels (v3 below).
#
# Output in ${OUT:-/tmp}/sweep: summary.md (the tables, also printed), results.json (every timing row),
# logs.tgz (build / check / bench logs and per-variant JSON).
#
# Environment: PYTHON (python3), FLASH_KERNEL_ARCHS (90a), MAX_JOBS (16), HDIMS (128),
# SWEEP_DEADLINE_S (560), SWEEP_REP_MS (300), SWEEP_WARMUP_MS (25), SWEEP_SEQLENS ("2048 8192").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
export FLASH_KERNEL_ARCHS=${FLASH_KERNEL_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16}
DEADLINE=${SWEEP_DEADLINE_S:-560}
REP_MS=${SWEEP_REP_MS:-300}
WARMUP_MS=${SWEEP_WARMUP_MS:-25}
SEQLENS=${SWEEP_SEQLENS:-2048 8192}
export HDIMS=${HDIMS:-128}
NHD=$(wc -w <<<"$HDIMS")  # check and bench time grow with the head dims
LOG=${OUT:-/tmp}/sweep
WORK=$LOG/logs
mkdir -p "$WORK"
rm -f "$WORK"/* "$LOG"/summary.md "$LOG"/results.json "$LOG"/logs.tgz

# name | fwd hd128 variant | bwd hd128 variant | what changes (kernel_traits.h; docs/kernel_notes.md
# "v5 candidates"). Variants run in this order; the first that runs is the baseline of the "vs" columns.
VARIANTS="
v3|1|3|default (v5 at hd128): fwd 4 warps x 2 tiles, 2 stages, 2 CTAs/SM; bwd FA2 tiling: P^T, dS^T via smem, 1 dO stage, 3 barriers (144 ldmatrix)
v1|1|1|hd128 fwd = v3 (repeat); bwd v4's tiling with stepped tile copies (184 ldmatrix)
v2|2|2|hd128 fwd 8 warps x 2 tiles (Br 256), 2 stages, 1 CTA/SM; bwd v1 + dQ warps 2x4, dK after the barrier (168 ldmatrix)
v4|0|4|hd128 fwd v4's 8 warps x 1 m16 tile, Bc 64, 3 stages; bwd v1 + dQ warps 2x4 only (176 ldmatrix)
v3b|1|3|v3 again: run-to-run drift
"
wanted=" ${*:-v3 v1 v2 v4 v3b} "

left() { echo $((DEADLINE - SECONDS)); }
step() {  # step <limit s> <log name> <command...>: run with a timeout clipped to the deadline
    local limit=$1 name=$2
    shift 2
    local room=$(($(left) - 20))
    ((room < limit)) && limit=$room
    if ((limit < 5)); then
        echo "[sweep] $name: no time left" | tee "$WORK/$name.log"
        return 124
    fi
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1  # its own process group: ninja/nvcc children too
    local rc=$?
    echo "[sweep] $name: exit $rc after $((SECONDS - t0)) s (limit $limit s)"
    return $rc
}

# The correctness gate: flash_kernel.sanitize.check_case on these cases for each head dim in HDIMS; exit 1 on
# any failure.
cat >"$WORK/check.py" <<'PY'
import os
import sys

import torch

from flash_kernel.sanitize import check_case

bf, fp = torch.bfloat16, torch.float16
cases = []
for d in map(int, os.environ["HDIMS"].split()):
    for causal in (False, True):
        cases += [
            dict(b=2, tq=1023, tk=1023, h=4, h_k=4, d=d, dtype=bf, causal=causal),
            dict(b=2, tq=113, tk=255, h=4, h_k=4, d=d, dtype=bf, causal=causal),
            dict(b=2, tq=255, tk=113, h=4, h_k=4, d=d, dtype=bf, causal=causal),
            dict(b=1, tq=2049, tk=2049, h=8, h_k=1, d=d, dtype=bf, causal=causal),
            dict(b=2, tq=333, tk=517, h=4, h_k=2, d=d, dtype=bf, causal=causal, deterministic=True),
            dict(b=2, tq=300, tk=300, h=6, h_k=2, d=d, dtype=bf, causal=causal, fused=True),
        ]
    cases += [
        dict(b=2, tq=1023, tk=1023, h=4, h_k=4, d=d, dtype=fp, causal=True),
        dict(b=2, tq=1, tk=300, h=4, h_k=4, d=d, dtype=bf, causal=True),
        dict(b=2, tq=255, tk=255, h=4, h_k=4, d=d - 8, dtype=bf, causal=True),  # hd's kernels, zero-filled columns
        # 5 splits for 12 K/V blocks: each deterministic thread block walks several K/V blocks
        dict(b=2, tq=700, tk=1500, h=16, h_k=4, d=d, dtype=bf, causal=True, deterministic=True),
    ]
ok = []
for c in cases:
    try:
        ok.append(check_case(**c))
    except Exception as e:  # a failed launch counts as a failure
        print(f"FAIL {c}: {type(e).__name__}: {e}", flush=True)
        ok.append(False)
torch.cuda.synchronize()
print(f"check (hd {os.environ['HDIMS']}): {sum(ok)}/{len(ok)} cases passed", flush=True)
sys.exit(0 if all(ok) else 1)
PY

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
echo "[sweep] sm $FLASH_KERNEL_ARCHS, MAX_JOBS=$MAX_JOBS, deadline ${DEADLINE} s, do_bench warmup ${WARMUP_MS} ms rep ${REP_MS} ms, hd = $HDIMS, T = $SEQLENS"

: >"$WORK/status.tsv"
while IFS='|' read -r name fv bv what; do
    [[ -z "$name" ]] && continue
    [[ "$wanted" != *" $name "* ]] && continue
    extra="-DFLASH_FWD_HD128_VARIANT=$fv -DFLASH_BWD_HD128_VARIANT=$bv"
    [[ "$fv$bv" == "13" ]] && extra=""  # the default build, literally
    fwd_path=auto
    [[ "$name" == v* ]] && fwd_path=sm80  # the v* variants are variants of the sm80 forward
    echo "[sweep] === $name (fwd $fv, bwd $bv, FLASH_KERNEL_FWD=$fwd_path): $what; $(left) s left"
    if (($(left) < 60)); then
        printf '%s\t%s\t%s\tSKIPPED\t%s\n' "$name" "$fv" "$bv" "$what" >>"$WORK/status.tsv"
        continue
    fi
    if ! FLASH_KERNEL_NVCC_EXTRA="$extra" step 300 "build_$name" $PY -m flash_kernel.build --require --verbose; then
        tail -n 20 "$WORK/build_$name.log"
        printf '%s\t%s\t%s\tBUILD-FAIL\t%s\n' "$name" "$fv" "$bv" "$what" >>"$WORK/status.tsv"
        continue
    fi
    grep -E "built .* in" "$WORK/build_$name.log"
    if ! FLASH_KERNEL_FWD=$fwd_path step $((150 * NHD)) "check_$name" $PY "$WORK/check.py"; then
        grep -E "^FAIL|cases passed" "$WORK/check_$name.log" | tail -n 12
        printf '%s\t%s\t%s\tFAIL\t%s\n' "$name" "$fv" "$bv" "$what" >>"$WORK/status.tsv"
        continue
    fi
    tail -n 1 "$WORK/check_$name.log"
    # shellcheck disable=SC2086
    FLASH_KERNEL_FWD=$fwd_path step $((200 * NHD)) "bench_$name" $PY bench/kernel.py --methods ours sdpa_flash --hdims $HDIMS --causal 0 1 \
        --seqlens $SEQLENS --modes fwd bwd fwd_bwd --warmup-ms "$WARMUP_MS" --rep-ms "$REP_MS" \
        --results "$WORK/bench_$name.json"
    rc=$?
    status=ok
    ((rc != 0)) && status="BENCH-EXIT-$rc"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$fv" "$bv" "$status" "$what" >>"$WORK/status.tsv"
done <<<"$VARIANTS"

# One compact table per head dim: ours TFLOP/s (ours / FLASH in the same process) per case, and each
# variant's geometric-mean speed against the first variant's for fwd, bwd and fwd+bwd.
grep -h "spill" "$WORK"/build_*.log 2>/dev/null | grep -E "ILi(${HDIMS// /|})E" | sort | uniq -c >"$WORK/spills.txt"
$PY - "$WORK" "$LOG" <<'PY'
import json, math, os, sys

work, out = sys.argv[1], sys.argv[2]
status = [line.rstrip("\n").split("\t") for line in open(os.path.join(work, "status.tsv")) if line.strip()]
rows = []
for name, *_ in status:
    path = os.path.join(work, f"bench_{name}.json")
    if os.path.exists(path):
        rows += [dict(r, variant=name) for r in json.load(open(path))["results"]]
json.dump(rows, open(os.path.join(out, "results.json"), "w"), indent=1)
idx = {(r["variant"], r["method"], r["hd"], bool(r["causal"]), r["seqlen"], r["mode"]): r["tflops"]
       for r in rows if r["status"] == "ok"}
seqlens = sorted({r["seqlen"] for r in rows})
cases = [(mode, causal, t) for mode in ("fwd", "bwd", "fwd_bwd") for causal in (False, True) for t in seqlens]
base = status[0][0] if status else None


def vs_base(variant, hd, mode):  # geometric mean over causal x T of ours(variant) / ours(base)
    pairs = [(idx.get((variant, "ours", hd, c, t, m)), idx.get((base, "ours", hd, c, t, m))) for m, c, t in cases if m == mode]
    pairs = [(x, b) for x, b in pairs if x and b]
    return math.exp(sum(math.log(x / b) for x, b in pairs) / len(pairs)) if pairs else None


lines = []
for hd in map(int, os.environ["HDIMS"].split()):
    lines += [f"## hd{hd}: ours TFLOP/s (ours / SDPA-FLASH, same process); bf16, B*T = 16k, H = {2048 // hd}", ""]
    head = ["variant", "fwd,bwd", "check"] + [f"{m} {'c' if c else 'nc'} {t // 1024}k" for m, c, t in cases]
    head += [f"fwd vs {base}", f"bwd vs {base}", f"fwd+bwd vs {base}"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, fv, bv, st, what in status:
        cells = [name, f"{fv},{bv}", st]
        for m, c, t in cases:
            o, f = idx.get((name, "ours", hd, c, t, m)), idx.get((name, "sdpa_flash", hd, c, t, m))
            cells.append("-" if o is None else f"{o:.0f} ({o / f:.2f})" if f else f"{o:.0f}")
        cells += ["-" if g is None else f"{g:.3f}" for g in (vs_base(name, hd, m) for m in ("fwd", "bwd", "fwd_bwd"))]
        lines.append("| " + " | ".join(cells) + " |")
    spread = []
    for m, c, t in cases:
        v = [idx[k] for k in idx if k[1:] == ("sdpa_flash", hd, c, t, m)]
        if len(v) > 1:
            spread.append(f"{m} {'c' if c else 'nc'} {t // 1024}k {min(v):.0f}-{max(v):.0f}")
    if spread:
        lines += ["", "SDPA-FLASH across the variants' processes (noise): " + ", ".join(spread)]
    lines.append("")
lines += ["Variants:"] + [f"- {name} (fwd {fv}, bwd {bv}): {what}" for name, fv, bv, _, what in status]
spills = open(os.path.join(work, "spills.txt")).read().strip()
if spills:
    lines += ["", f"ptxas spill warnings of the hd {os.environ['HDIMS']} kernels (all builds, count x line):", "```", spills, "```"]
text = "\n".join(lines)
open(os.path.join(out, "summary.md"), "w").write(text + "\n")
print(text)
PY
tar -czf "$LOG/logs.tgz" -C "$LOG" logs && rm -rf "$WORK"
echo "[sweep] done after $SECONDS s: $LOG/summary.md, $LOG/results.json, $LOG/logs.tgz"
