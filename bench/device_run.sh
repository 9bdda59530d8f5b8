#!/usr/bin/env bash
# The GPU checks and benchmarks by stage, each stage a run of at most 10 minutes on a GPU machine (offline, its
# own system python with torch + CUDA). Logs and result files are packed into $OUT.
#
#   bash bench/device_run.sh check                 # build, the whole test suite, sanitizers, train.py per attention
#   bash bench/device_run.sh sanitize              # build, memcheck and racecheck (python -m flash_kernel.sanitize)
#   bash bench/device_run.sh python                # build, the GPU tests of the model, fusion, loss and training
#                                                    # runs (tests/test_*.py, tests/kernel/test_model_flash.py),
#                                                    # one training run per attention
#   bash bench/device_run.sh kernel [kernel.py args] # make bench-kernel, one part per (head dim, causal)
#   bash bench/device_run.sh varlen [kernel.py --varlen args]  # document-masked / sliding-window grid, one part per
#                                                    # head dim; run the docs and window cases as separate stages:
#                                                    # `varlen --cases corpus lognormal fixed1k fixed2k fixed4k`, `varlen --cases window`
#   bash bench/device_run.sh ncu [ncu_compare.py args]  # Nsight Compute on ours and FA4 (where it imports) for one
#                                                    # case, side by side (e.g. --hdim 128 --seqlen 8192 --causal 0)
#   bash bench/device_run.sh source [ncu_source.py profile args]  # Nsight Compute's source view of ours and FA4
#                                                    # (where it imports): warp-stall samples per SASS instruction,
#                                                    # gzipped CSVs in $OUT (e.g. --hdim 128 --seqlen 8192 --causal 1
#                                                    # --mode bwd); bench/ncu_source.py summary reads them anywhere
#   bash bench/device_run.sh bursts [burst_times.py args]  # each call's time by its place in a burst after an idle
#                                                    # gap, ours and FA4 (where it imports) in turn (e.g. --hdim 128
#                                                    # --causal 0 --seqlen 16384)
#   bash bench/device_run.sh sass [kernel.py args]   # FA4's kernels of that case as PTX in $OUT/fa4_ptx, for
#                                                    # bench/sass_mix.py to count their main loops beside ours
#                                                    # (e.g. --hdims 128 --causal 1 --seqlens 8192 --modes bwd)
#   bash bench/device_run.sh e2e [e2e.py args]       # make bench-e2e with the arguments given (repeatable)
#   bash bench/device_run.sh multi [loss_curves.py args]  # >= 2 GPUs: DDP/FSDP tests, loss curves 1 vs N GPUs
#   bash bench/device_run.sh candidate "NVCC FLAGS" test   # a second build with these nvcc flags (e.g.
#                                                    # "-DFLASH_FWD_INTRA_WG_OVERLAP_BC128=1") in flash_kernel/_candidate:
#                                                    # the GPU kernel tests on it (`... sanitize`: memcheck and
#                                                    # racecheck on it)
#   bash bench/device_run.sh candidate "NVCC FLAGS" kernel [kernel.py args]  # the same build timed in turn with
#                                                    # the package's (and FA4 where it imports) on the same tensors
#   bash bench/device_run.sh candidates "FLAGS A" "FLAGS B" ... -- [kernel.py args]  # several candidates built at
#                                                    # once (the package's build beside them, the cores shared), then
#                                                    # each timed as `candidate ... kernel` times one
#   bash bench/device_run.sh candidates "FLAGS A" "FLAGS B" ... -- test   # the same builds (a warm machine keeps
#                                                    # them), the GPU kernel tests on all of them at once
#                                                    # (`-- sanitize`: memcheck on all at once, then racecheck)
#   CANDIDATE_SRC=.baseline bash bench/device_run.sh candidate "" kernel ...  # the candidate built from another
#                                                    # tree's flash_kernel/ instead: `make baseline REV=<commit>`
#                                                    # puts a commit's in .baseline/ (ignored: carry it), so the
#                                                    # version before a change is timed beside it in one run
#   bash bench/device_run.sh launchers [launchers.py args]  # >= 2 GPUs: the DDP step's profile, then per-GPU
#                                                    # throughput per launch (e.g. --cases gpt3-1.3b:8192:2
#                                                    # --launches 1gpu python ddp_sm_carveout_4)
#
# Stages chain: `bash bench/device_run.sh check && bash bench/device_run.sh kernel --methods ours sdpa_flash`.
# Run nothing that asks git about the tree on the GPU machine: a copy of the working tree there may carry an
# older commit's .git (a `git checkout`/`stash` would silently put back that commit's sources). To run without
# a file of the working tree, copy the committed version in before building.
# Every step has its own time limit, so one that hangs costs its limit, not the stage.
set -uo pipefail
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results/device-logs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the candidate build runs in another directory
usage="bench/device_run.sh check|sanitize|python|kernel|varlen|candidate|candidates|ncu|source|bursts|sass|e2e|multi|launchers [args]"
stage=${1:?usage: $usage}
shift

step() {  # step <seconds> <log name> <command...>: run, keep the log, say how it ended
    local limit=$1 name=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "[device_run] $name: exit $rc after $((SECONDS - t0)) s (log $name.log)"
    return $rc
}

pack() {  # results and run summaries in one file, to copy back from the GPU machine
    tar -czf "$OUT/results.tgz" bench/results/*.json bench/results/*.md bench/results/*.png \
        $(find outputs -name 'wandb-summary.json' -o -name 'metrics.csv' 2>/dev/null) \
        $(find bench/results/runs -name 'train.log' -o -name 'metrics.json' -o -name 'metrics.csv' 2>/dev/null) 2>/dev/null
}
trap pack EXIT

build_quietly() {  # the benchmark stages: the build's log only if it fails
    make PYTHON="$PY" build >"$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 1; }
}

train_per_attention() {  # train_per_attention <limit s> <steps> <attention...>: train.py on the default model each
    local limit=$1 steps=$2
    shift 2
    for attn in "$@"; do
        step "$limit" "train_$attn" $PY train.py attention=$attn trainer.max_steps=$steps \
            trainer.val_check_interval=$((steps / 2)) ~callbacks.progress_bar
        grep -E "^done:|error" "$OUT/train_$attn.log" | tail -n 2
    done
}

BUILDS=()  # the candidate stages' builds, as <name>=<path of its .so>

on_each_build() {  # on_each_build <limit s> <log prefix> <command...>: the command on every build of BUILDS at once
    local limit=$1 prefix=$2 pair pid pids=() rc=0
    shift 2
    for pair in "${BUILDS[@]}"; do
        FLASH_KERNEL_EXT="${pair#*=}" step "$limit" "${prefix}_${pair%%=*}" "$@" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    return $rc
}

candidate_tests() {  # the GPU kernel tests on every build of BUILDS, all at once
    # pytest-xdist, where installed: the small cases leave one GPU mostly idle, so TEST_WORKERS processes per build
    # (default 4; 0 runs them in the build's own process) share it.
    local workers=() pair rc=0
    if [ "${TEST_WORKERS:-4}" != 0 ] && $PY -c "import xdist" 2>/dev/null; then workers=(-n "${TEST_WORKERS:-4}"); fi
    # The sanitizers' small cases first, under a short limit: a build whose kernel hangs (a synchronisation that
    # never completes) costs 90 s here, not the suite's 480.
    if ! on_each_build 90 smoke $PY -m flash_kernel.sanitize; then
        for pair in "${BUILDS[@]}"; do echo "${pair%%=*}: smoke: $(tail -n 1 "$OUT/smoke_${pair%%=*}.log")"; done
        return 1
    fi
    on_each_build 480 test $PY -m pytest -q -x "${workers[@]}" -m gpu -rfEs tests/kernel || rc=1
    for pair in "${BUILDS[@]}"; do echo "${pair%%=*}: $(tail -n 1 "$OUT/test_${pair%%=*}.log")"; done
    return $rc
}

candidate_sanitizers() {  # memcheck on every build of BUILDS at once, then racecheck
    local tool pair rc=0
    for tool in memcheck racecheck; do
        on_each_build 540 $tool compute-sanitizer --tool $tool --error-exitcode 1 $PY -m flash_kernel.sanitize || rc=1
        for pair in "${BUILDS[@]}"; do
            echo "${pair%%=*}: $(grep -E "cases passed|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/${tool}_${pair%%=*}.log" \
                | tail -n 2 | paste -sd ' ')"
        done
    done
    return $rc
}

time_candidate() {  # time_candidate <name> <.so> [kernel.py args]: the build beside the package's (and FA4)
    local name=$1 so=$2
    shift 2
    step 540 "kernel_$name" $PY bench/kernel.py --candidate "$so" --methods ours ours_candidate fa4 --rounds 3 \
        --results "$OUT/$name.json" "$@"  # a run's output: beside its logs, not in bench/results
    grep -E "^\||^###" "$OUT/kernel_$name.log" | tail -n 60
}

data_quietly() {  # the stages that train through the real pipeline need the default data prepared
    step 300 data make PYTHON="$PY" data >/dev/null || { tail "$OUT/data.log"; exit 1; }
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
$PY -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"

case "$stage" in
check)
    step 300 build make PYTHON="$PY" build || exit 1
    tail -n 3 "$OUT/build.log"
    step 420 test make PYTHON="$PY" test ARGS="-q -rfEs --durations=10"
    tail -n 25 "$OUT/test.log"
    step 420 sanitize make PYTHON="$PY" sanitize  # racecheck alone takes about 200 s on an H200
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|error" "$OUT/sanitize.log" | tail -n 6
    # The pipeline per attention on the default model, W&B offline: the run files must carry perf/mfu.
    train_per_attention 240 150 flash sdpa naive
    # Naive attention's OOM frontier must come back as advice, not a bare traceback.
    step 180 train_naive_oom $PY train.py attention=naive model=gpt3-1.3b seq_len=8192 data.batch_size=2 \
        trainer.max_steps=2 logger=none
    tail -n 2 "$OUT/train_naive_oom.log"
    ;;
sanitize)
    # compute-sanitizer on the package's build, memcheck then racecheck: the candidate stages' steps on one build
    build_quietly
    BUILDS=("package=$(ls "$PWD"/flash_kernel/_C*.so)")
    candidate_sanitizers
    ;;
python)
    build_quietly
    data_quietly
    # tests/test_*.py, and of tests/kernel only the model through the kernel (training, sampling with RoPE)
    step 420 test_python $PY -m pytest -q -m gpu -rfEs tests/test_*.py tests/kernel/test_model_flash.py
    tail -n 6 "$OUT/test_python.log"
    train_per_attention 180 100 flash sdpa
    ;;
kernel)
    build_quietly
    for hd in 128 64; do
        for causal in 1 0; do
            step 300 "kernel_hd${hd}_c${causal}" $PY bench/kernel.py --hdims $hd --causal $causal "$@"
            grep -E "^\|" "$OUT/kernel_hd${hd}_c${causal}.log" | tail -n 30
        done
    done
    ;;
varlen)
    build_quietly
    run=$(ls "$OUT"/varlen_*.log 2>/dev/null | wc -l)  # one log per part when stages are chained
    for hd in 128 64; do
        step 250 "varlen_${run}_hd${hd}" $PY bench/kernel.py --varlen --hdims $hd "$@"
        grep -E "^\||^- |^note|^skip|^error" "$OUT/varlen_${run}_hd${hd}.log" | tail -n 40
    done
    ;;
candidate)
    flags=${1?usage: bench/device_run.sh candidate "NVCC FLAGS" test|sanitize|kernel [kernel.py args]}  # may be ""
    what=${2:?usage: bench/device_run.sh candidate "NVCC FLAGS" test|sanitize|kernel [kernel.py args]}
    shift 2
    build_quietly
    # Inside the tree and ignored: a warm machine keeps it between calls, and ninja rebuilds only what changed.
    dir=$PWD/flash_kernel/_candidate
    # CANDIDATE_SRC: the tree whose flash_kernel/ (sources and build script) the candidate is built from.
    # CANDIDATE_ARCHS (default 90a): a candidate runs on this Hopper machine only, so one target instead of the
    # package's two halves its compile (its sm80 kernels, run by kernel_overrides, are compiled for sm_90a).
    (cd "${CANDIDATE_SRC:-.}" && FLASH_KERNEL_ARCHS="${CANDIDATE_ARCHS:-90a}" FLASH_KERNEL_NVCC_EXTRA="$flags" \
        step 300 build_candidate $PY -m flash_kernel.build --out "$dir") || exit 1
    so=$(ls "$dir"/_C*.so)
    BUILDS=("candidate=$so")
    case "$what" in
    test)
        candidate_tests
        ;;
    sanitize)
        candidate_sanitizers
        ;;
    kernel)
        time_candidate candidate "$so" "$@"
        ;;
    *)
        echo "candidate: say test, sanitize or kernel after the flags" >&2
        exit 2
        ;;
    esac
    ;;
candidates)
    sets=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do sets+=("$1"); shift; done
    [ $# -gt 0 ] && shift  # the "--" before kernel.py's arguments, or test, or sanitize
    [ ${#sets[@]} -gt 0 ] || { echo "candidates: name at least one set of nvcc flags" >&2; exit 2; }
    # One compile per core: each of the builds gets its share (a candidate alone takes the package's build's time).
    jobs=$(( $(nproc) / (${#sets[@]} + 1) ))
    [ "$jobs" -ge 1 ] || jobs=1
    MAX_JOBS=$jobs make PYTHON="$PY" build >"$OUT/build.log" 2>&1 &
    pids=($!)
    for n in "${!sets[@]}"; do
        FLASH_KERNEL_ARCHS="${CANDIDATE_ARCHS:-90a}" FLASH_KERNEL_NVCC_EXTRA="${sets[$n]}" MAX_JOBS=$jobs timeout 600 \
            $PY -m flash_kernel.build --out "$PWD/flash_kernel/_candidate_$n" >"$OUT/build_candidate_$n.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || { echo "candidates: a build failed" >&2; tail -n 5 "$OUT"/build*.log; exit 1; }
    done
    for n in "${!sets[@]}"; do
        echo "candidate_$n: ${sets[$n]}"
        BUILDS+=("candidate_$n=$(ls "$PWD/flash_kernel/_candidate_$n"/_C*.so)")
    done
    case "${1:-}" in
    test) candidate_tests ;;
    sanitize) candidate_sanitizers ;;
    *)
        for pair in "${BUILDS[@]}"; do
            echo "### ${pair%%=*}"
            time_candidate "${pair%%=*}" "${pair#*=}" "$@"
        done
        ;;
    esac
    ;;
ncu)
    build_quietly
    log="ncu_$(ls "$OUT"/ncu_*.log 2>/dev/null | wc -l)"  # one log per stage run when stages are chained
    step 540 "$log" $PY bench/ncu_compare.py --out "$OUT/ncu.json" "$@"
    grep -E "^\||^[A-Z].*: hd" "$OUT/$log.log"
    ;;
source)
    build_quietly
    step 540 ncu_source $PY bench/ncu_source.py profile --raw "$OUT" "$@"
    grep -E "^###|^stall reasons|^\| [0-9]|^note" "$OUT/ncu_source.log" | head -n 80
    ;;
bursts)
    build_quietly
    log="bursts_$(ls "$OUT"/bursts_*.log 2>/dev/null | wc -l)"  # one log per stage run when stages are chained
    step 540 "$log" $PY bench/burst_times.py --results "$OUT/$log.json" "$@"
    grep -E "^\||^hd=|^note" "$OUT/$log.log"
    ;;
sass)
    # FA4's kernels for kernel.py's case as PTX (CUTE_DSL_KEEP_PTX: the DSL writes each kernel it compiles into
    # CUTE_DSL_DUMP_DIR), back in $OUT/fa4_ptx for bench/sass_mix.py to set beside ours (no GPU needed there)
    mkdir -p "$OUT/fa4_ptx"
    step 300 fa4_ptx env CUTE_DSL_KEEP_PTX=1 CUTE_DSL_DUMP_DIR="$OUT/fa4_ptx" $PY bench/kernel.py --methods fa4 \
        --results "$OUT/fa4_ptx/kernel.json" "$@"
    grep -E "^\||note" "$OUT/fa4_ptx.log" | tail -n 8
    step 120 fa4_ptx_kernels $PY bench/sass_mix.py --list "$OUT"/fa4_ptx/*.ptx
    grep -v "^ " "$OUT/fa4_ptx_kernels.log"
    ;;
e2e)
    build_quietly
    data_quietly
    log="e2e_$(ls "$OUT"/e2e_*.log 2>/dev/null | wc -l)"  # one log per stage run when stages are chained
    step 540 "$log" $PY bench/e2e.py "$@"
    grep -E "^\[e2e\]|^\|" "$OUT/$log.log"
    ;;
multi)
    build_quietly
    data_quietly
    nvidia-smi topo -m | head -n 4
    # train.py launched as users launch it: DDP with both attentions, FSDP checkpoints resumed (sharded, full)
    step 420 multi_tests $PY -m pytest -q -rfEs tests/test_train.py tests/test_allreduce.py tests/test_distributed.py \
        tests/kernel/test_document_mask_flash.py -k "gpus or fsdp or two_gpu"
    tail -n 8 "$OUT/multi_tests.log"
    step 420 loss_curves $PY bench/loss_curves.py "$@"
    grep -E "^\[loss\]" "$OUT/loss_curves.log"
    ;;
launchers)
    build_quietly
    data_quietly
    nvidia-smi topo -m | head -n 4
    step 120 profile_ddp $PY -m torch.distributed.run --standalone --nproc_per_node=2 bench/profile_step.py \
        --seq-len 8192 --top 5
    grep -E "wall|NCCL kernels|^\| (communication|matmul|elementwise|all kernels) " "$OUT/profile_ddp.log"
    step 540 launchers $PY bench/launchers.py "$@"
    grep -E "^\[launchers\]|^\|" "$OUT/launchers.log"
    ;;
*)
    echo "unknown stage $stage; usage: $usage" >&2
    exit 2
    ;;
esac
