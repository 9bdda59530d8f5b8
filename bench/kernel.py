"""Attention kernel benchmark: the FlashAttention-2 paper's Figure 5 protocol, our kernel against PyTorch's.

Protocol (Dao 2023, section 4.1): B*T = 16k tokens, hidden 2048 (heads = 2048 / hd), hd 64 and 128, causal
and not, T = 512 ... 16k, bf16. FLOPs: fwd = 4*B*H*T^2*hd, halved when causal; bwd = 2.5 * fwd;
fwd+bwd = 3.5 * fwd. Times are CUDA-event medians after warm-up (triton.testing.do_bench, which also
flushes L2 between runs; a torch.cuda.Event loop when triton is missing); inputs require grad in every
mode so the forward is the training forward (it saves what the backward needs).

Methods: naive (matmul + mask + softmax + matmul), SDPA default dispatch, SDPA forced to each backend
(FLASH = FA2, CUDNN, EFFICIENT = mem-efficient), ours (flash_kernel; skipped, with a note, when not built) and
fa4, FlashAttention-4 (PyPI flash-attn-4, `flash_attn.cute.flash_attn_func`; on Hopper it runs FlashAttention-3's
algorithm; skipped, with a note, when `flash_attn.cute` does not import). `--inputs` picks what they read:
  native  each method its own layout: (B, H, T, D) tensors for PyTorch, (B, T, H, D) for ours (the default);
  bthd    every method the same (B, T, H, D) tensors, PyTorch's through (B, H, T, D) views of them: what the
          GPT's qkv projection produces and passes to either attention, and what the FA2 paper's benchmark
          gives FlashAttention. The two differ: on the H100, FA2's backward ran 0-31% faster on these, most at
          short T (docs/results.md, section 1).
`--gqa G` gives k and v heads / G heads (grouped-query attention; the FLOPs are the same, counted per query head;
naive does not take it). OOM is recorded as "OOM", a backend that refuses the shape as "n/a".

    python bench/kernel.py                                   # everything (~10 min on an H100)
    python bench/kernel.py --hdims 128 --causal 1 --methods sdpa_flash ours   # one part
    python bench/kernel.py --plot-only                       # redraw table + figure from the JSON
    python bench/kernel.py --inputs bthd --methods ours_sm80 sdpa_flash   # the same tensors for both
    python bench/kernel.py --hdims 128 --causal 1 --seqlens 2048 --methods ours sdpa_cudnn --rounds 5 --rep-ms 30
                                                             # in turn, 5 times per mode: ratios that clock drift spares

    python -m flash_kernel.build --out /tmp/b && python bench/kernel.py --candidate /tmp/b/_C*.so \\
        --methods ours ours_candidate --rounds 5 --hdims 128 --causal 1
                                                             # another build (other nvcc flags) against the
                                                             # package's, in turn on the same tensors
    python bench/kernel.py --candidate-overrides bwd_causal_group_heads=1 --methods ours ours_candidate --rounds 3
                                                             # the package's build under other kernel_overrides
                                                             # (the backward's grid order here) as ours_candidate

    python bench/kernel.py --hdims 128 --causal 0 --seqlens 4096 --methods ours fa4 --rounds 5 --clocks
                                                             # with each method's SM clock and power draw while
                                                             # timed (nvidia-smi; bench/gpu_clocks.py)

    python bench/kernel.py --varlen                          # document-masked (varlen) and sliding-window grid
    python bench/kernel.py --varlen --help                   # its own options (bench/kernel_varlen.py)

Parts merge into bench/results/kernel.json (one entry per device, inputs, GQA, method, hd, causal, T, mode), so a
benchmark can be run in pieces of a few minutes each. The figure goes to
bench/results/kernel_<device>.png, or kernel_<device>_bthd.png for --inputs bthd (rows: fwd+bwd, fwd, bwd;
one panel per hd x causal). --varlen writes bench/results/kernel_varlen.json and kernel_varlen_<device>.png.

--clocks: one nvidia-smi samples the GPU's SM clock and power draw every 10 ms for the whole run; each method's
run_mode call (each mode, each round: its untimed peak-memory call, and do_bench's estimate, warm-up and timed calls)
takes the samples stamped while it runs, and each ok row gains sm_clock_mhz and power_w, the medians of all samples
of the cell's rounds pooled, clock_samples, their count, and with --rounds > 1 sm_clock_mhz_rounds, each round's
median clock. The tables then show "clock / power" per method under each TFLOP/s table. Without nvidia-smi (or when
it fails) the run goes on without them, after a note. nvidia-smi's readings trail the load by about 100 ms, so
--clocks times each measurement over 1000 ms unless --rep-ms says otherwise: over do_bench's default 100 ms the
samples often read the idle GPU before it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/kernel.py` from anywhere imports the repo's flash_kernel

from bench import gpu_clocks  # noqa: E402
from bench.common import can_plot, device_slug, parse_sets, save_figure  # noqa: E402

RESULTS = REPO / "bench" / "results" / "kernel.json"
TOKENS = 16 * 1024  # B * T, the paper's fixed token count
HIDDEN = 2048  # heads = HIDDEN // hd
HEAD_DIMS = [64, 128]
SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
REP_MS = 100.0  # do_bench's timed calls per measurement
# With --clocks: nvidia-smi's clock and power readings trail the load by about 100 ms, so a 100 ms measurement often
# reads whatever ran before it (the GPU idle between methods); over a second they read the kernel under test.
CLOCKS_REP_MS = 1000.0
MODES = ["fwd", "bwd", "fwd_bwd"]
METHODS = ["naive", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "fa4", "ours", "ours_sm80", "ours_candidate"]
LABELS = {
    "naive": "naive (PyTorch)",
    "sdpa": "SDPA default",
    "sdpa_flash": "SDPA FLASH (FA2)",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_efficient": "SDPA EFFICIENT",
    "fa4": "FlashAttention-4",
    "ours": "ours (flash_kernel)",
    "ours_sm80": "ours, sm80 kernels",
    "ours_candidate": "ours, candidate (--candidate, --candidate-overrides)",
}
INPUTS = ["native", "bthd"]  # --inputs (module docstring); rows without the field are "native"
# ours_sm80: the mma.sync kernels a Hopper GPU can also run (set_kernel_overrides); ours_candidate: the build that
# --candidate names (`python -m flash_kernel.build --out DIR`), run through the same ops (interface.using_extension).
OURS = ("ours", "ours_sm80", "ours_candidate")
CANDIDATE = None  # the --candidate build's module (flash_kernel.interface.load_extension)
CANDIDATE_OVERRIDES: dict[str, int | str] = {}  # --candidate-overrides: kernel_overrides for ours_candidate
BTHD_METHODS = (*OURS, "fa4")  # the methods that take (B, T, H, D) tensors in every --inputs kind
MODE_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}
BWD_FLOPS_RATIO = 2.5  # FA2 paper: the backward does 2.5x the forward's matmul FLOPs
GIB = 1024**3
DEVICE = "cuda"


# ------------------------------------------------------------------------------------------------ FLOPs
def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, mode: str) -> float:
    """FA2 paper convention: fwd = 4 B H T^2 D (two matmuls), halved when causal; bwd = 2.5 fwd."""
    fwd = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return {"fwd": fwd, "bwd": BWD_FLOPS_RATIO * fwd, "fwd_bwd": (1 + BWD_FLOPS_RATIO) * fwd}[mode]


def shape_for(seqlen: int, head_dim: int) -> tuple[int, int]:
    """(batch, heads) of the paper's protocol for this length and head dim."""
    return max(1, TOKENS // seqlen), HIDDEN // head_dim


# ---------------------------------------------------------------------------------------------- methods
class BackendUnsupported(Exception):
    """The method cannot run this shape/dtype here (recorded as "n/a", not as a failure)."""


def _naive(q, k, v, causal, mask):
    # q, k, v: (B, H, T, D). The textbook attention the paper's "PyTorch" baseline is.
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, T)
    if causal:
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v  # (B, H, T, D)


def _sdpa_backend(method: str):
    from torch.nn.attention import SDPBackend

    return {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[method]


def _fa4_function():
    """flash_attn.cute.flash_attn_func, or BackendUnsupported saying why it does not import."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
        raise BackendUnsupported(f"flash_attn.cute (FlashAttention-4) does not import: {type(e).__name__}: {e}") from None
    return flash_attn_func


def inputs_of(kind: str, method: str, batch: int, heads: int, seqlen: int, head_dim: int, dtype, device=DEVICE,
              gqa: int = 1):
    """(q, k, v, do) as the method reads them, and the leaves (q, k, v storage, requires_grad) whose .grad the
    backward fills: the same tensors unless PyTorch reads (B, H, T, D) views of (B, T, H, D) storage (bthd).
    k and v have heads / gqa heads."""
    stored_bthd = kind == "bthd" or method in BTHD_METHODS

    def shape(h: int) -> tuple[int, ...]:
        return (batch, seqlen, h, head_dim) if stored_bthd else (batch, h, seqlen, head_dim)

    heads_qkv = (heads, heads // gqa, heads // gqa)
    leaves = [torch.randn(shape(h), device=device, dtype=dtype, requires_grad=True) for h in heads_qkv]
    do = torch.randn(shape(heads), device=device, dtype=dtype)
    if method in BTHD_METHODS or not stored_bthd:
        return (*leaves, do), leaves
    return tuple(x.transpose(1, 2) for x in (*leaves, do)), leaves


def make_method(method: str, batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, dtype, inputs="native",
                gqa: int = 1):
    """The leaves (q, k, v as stored, requires_grad) and dO as o is shaped, a closure computing o, and a factory of
    the context to run it in (a factory: sdpa_kernel's context manager is single-use). inputs: INPUTS; k and v have
    heads / gqa heads."""
    import torch.nn.functional as F

    if inputs not in INPUTS:
        raise ValueError(f"unknown inputs {inputs!r}; choose from {INPUTS}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    require_candidate(method)
    if heads % gqa:
        raise ValueError(f"--gqa {gqa} does not divide the {heads} heads")
    if method == "naive" and gqa > 1:
        raise BackendUnsupported("naive attention here has no grouped-query form")
    if method in OURS:
        import flash_kernel

        if not flash_kernel.is_available():
            raise BackendUnsupported(f"flash_kernel unavailable: {flash_kernel.unavailable_reason()}")
    if method == "fa4":
        fa4_attn = _fa4_function()
    (q, k, v, do), leaves = inputs_of(inputs, method, batch, heads, seqlen, head_dim, dtype, gqa=gqa)
    context = contextlib.nullcontext
    sdpa_gqa = {"enable_gqa": True} if gqa > 1 else {}
    if method == "naive":
        # A constant buffer, as nanoGPT registers its causal mask: built once, not timed.
        mask = torch.ones(seqlen, seqlen, device=DEVICE, dtype=torch.bool).triu(1) if causal else None
        fn = lambda: _naive(q, k, v, causal, mask)  # noqa: E731
    elif method == "sdpa":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **sdpa_gqa)  # noqa: E731
    elif method.startswith("sdpa_"):
        from torch.nn.attention import sdpa_kernel

        context = lambda: sdpa_kernel(_sdpa_backend(method))  # noqa: E731
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **sdpa_gqa)  # noqa: E731
    elif method == "fa4":
        fn = lambda: fa4_attn(q, k, v, causal=causal)[0]  # noqa: E731  (out, lse) -> out
    elif method in OURS:
        from flash_kernel import flash_attn_func

        fn = lambda: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        if method == "ours_sm80":
            from flash_kernel.interface import kernel_overrides

            context = lambda: kernel_overrides(fwd="sm80", bwd="sm80")  # noqa: E731
        elif method == "ours_candidate":
            context = _candidate_context
    return (*leaves, do), fn, context


def require_candidate(method: str) -> None:
    """ours_candidate runs only where a --candidate build or --candidate-overrides was given."""
    if method == "ours_candidate" and CANDIDATE is None and not CANDIDATE_OVERRIDES:
        raise BackendUnsupported("no --candidate build or --candidate-overrides given")


def use_candidate(path: Path | None, overrides: dict[str, int | str], methods: list[str]) -> None:
    """Make ours_candidate the build at `path` (else the package's) under `overrides` (else the defaults)."""
    global CANDIDATE, CANDIDATE_OVERRIDES
    CANDIDATE_OVERRIDES = overrides
    if path is not None:
        from flash_kernel.interface import load_extension

        CANDIDATE = load_extension(path)
    elif "ours_candidate" in methods and not CANDIDATE_OVERRIDES:
        print("note: ours_candidate skipped: no --candidate build or --candidate-overrides given")


@contextlib.contextmanager
def _candidate_context():
    """ours_candidate: the --candidate build (else the package's) under --candidate-overrides (else the defaults)."""
    from flash_kernel.interface import kernel_overrides, using_extension

    # No overrides, no set_overrides call: a --candidate build from older sources may take other switches.
    with using_extension(CANDIDATE) if CANDIDATE is not None else contextlib.nullcontext(), \
            kernel_overrides(**CANDIDATE_OVERRIDES) if CANDIDATE_OVERRIDES else contextlib.nullcontext():
        yield


def kernel_names(head_dim: int) -> dict:
    """Which forward and backward kernels ours runs here, under the method's context ("sm90a-wgmma" / "sm80-mma")."""
    from flash_kernel.interface import _load_C

    C, device = _load_C(), torch.cuda.current_device()
    return dict(fwd_kernel=C.fwd_kernel_name(head_dim, device), bwd_kernel=C.bwd_kernel_name(head_dim, device, False))


# ---------------------------------------------------------------------------------------------- timing
def bench_ms(fn, grad_to_none, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of fn() on the GPU, after warm-up."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))
    # Fallback with the same shape as do_bench: estimate one call, warm up for warmup_ms, time rep_ms worth.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    times = []
    for _ in range(max(5, int(rep_ms / estimate))):
        for t in grad_to_none:
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def _storage_gib(tensors) -> float:
    """GiB held by the storages under tensors (views of one storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / GIB


def mode_step(mode: str, fn, do):
    """The call that mode times: fn (fwd), fn().backward(do) (fwd_bwd), or for bwd a backward of one forward run
    here, whose graph every call reuses."""
    if mode == "fwd":
        return fn
    if mode == "bwd":
        o = fn()
        return lambda: o.backward(do, retain_graph=True)
    return lambda: fn().backward(do)


def run_mode(mode: str, tensors, fn, warmup_ms: float, rep_ms: float) -> tuple[float, float]:
    """(median ms, peak GiB of one untimed call) for mode in fwd / bwd / fwd_bwd. The peak is the method's inputs
    plus what the call allocates on top of what was live before it, so other methods' inputs (--rounds keeps every
    method of a case alive) do not count."""
    q, k, v, do = tensors
    leaves = [q, k, v]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # before bwd's forward too: the graph it keeps counts, as it always did
    step = mode_step(mode, fn, do)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / GIB + _storage_gib(tensors)
    for t in leaves:
        t.grad = None
    ms = bench_ms(step, leaves, warmup_ms, rep_ms)
    return ms, peak


def _is_unsupported(err: RuntimeError) -> bool:
    # SDPA with a forced backend that cannot take the inputs says "No available kernel" (CUDA) or
    # "No viable backend" (newer torch).
    msg = str(err)
    return "No available kernel" in msg or "No viable backend" in msg or "not supported" in msg.lower()


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _set_up(group: list[str], base0: dict, args, dtype) -> tuple[list, list[dict]]:
    """The case's methods in `group`, ready to time: (base row, tensors, fn, context) each, and the rows of those that
    ran out of memory while setting up (one per mode)."""
    live, failed = [], []
    for method in group:
        base = dict(base0, method=method)
        try:
            tensors, fn, context = make_method(method, base0["batch"], base0["heads"], base0["seqlen"], base0["hd"],
                                               base0["causal"], dtype, args.inputs, args.gqa)
        except BackendUnsupported as e:
            print(f"skip {method}: {e}")
            continue
        except torch.OutOfMemoryError:
            failed += [dict(base, mode=m, status="OOM", ms=None, tflops=None, peak_mem_gib=None, note="") for m in args.modes]
            _free()
            continue
        if method in OURS:
            with context():
                base.update(kernel_names(base0["hd"]))
        if method == "ours_candidate" and CANDIDATE_OVERRIDES:
            base["candidate_overrides"] = dict(CANDIDATE_OVERRIDES)
        live.append((base, tensors, fn, context))
    return live, failed


def _dense_flops(row: dict, mode: str) -> float:
    return attention_flops(row["batch"], row["heads"], row["seqlen"], row["hd"], row["causal"], mode)


def _clock_span(clocks: gpu_clocks.ClockRecorder | None):
    """The recorder's span (yields the samples list, or None while it is off); without --clocks a span yielding None."""
    return clocks.span() if clocks is not None else contextlib.nullcontext(None)


def clock_fields(rounds: list[list[dict]]) -> dict:
    """Row fields of a cell's clock samples, one list per round that sampled: the medians over all of them pooled and
    their count (gpu_clocks.summarize), and with more than one round each round's median SM clock (None for a round
    without samples). No rounds sampled: no fields."""
    if not rounds:
        return {}
    fields = gpu_clocks.summarize([s for samples in rounds for s in samples])
    if len(rounds) > 1:
        per_round = [gpu_clocks.summarize(samples) for samples in rounds]
        fields["sm_clock_mhz_rounds"] = [f.get(gpu_clocks.CLOCK_FIELD) for f in per_round]
    return fields


def _time_mode(mode: str, live: list, args, flops=_dense_flops, clocks: gpu_clocks.ClockRecorder | None = None
               ) -> list[dict]:
    """One row per live method: each timed args.rounds times in turn (a method that fails stops there); ms is the
    median of its rounds, TFLOP/s flops(row, mode) over it. With clocks, each run_mode call runs in a clocks span and
    ok rows gain clock_fields."""
    rows = [dict(base, mode=mode, status="ok", ms=None, tflops=None, peak_mem_gib=None, note="") for base, *_ in live]
    times = [[] for _ in live]
    clock_samples = [[] for _ in live]  # per method, the samples of each round that sampled
    for _ in range(args.rounds):
        for row, ms_list, sampled, (_, tensors, fn, context) in zip(rows, times, clock_samples, live):
            if row["status"] != "ok":
                continue
            try:
                with context(), _clock_span(clocks) as samples:
                    ms, peak = run_mode(mode, tensors, fn, args.warmup_ms, args.rep_ms)
                ms_list.append(ms)
                if samples is not None:
                    sampled.append(samples)
                row["peak_mem_gib"] = max(peak, row["peak_mem_gib"] or 0.0)
            except torch.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as e:  # RuntimeError mostly; a compiler's or another library's own error types too
                row["status"] = "n/a" if _is_unsupported(e) else "error"
                row["note"] = (str(e).splitlines() or [type(e).__name__])[0][:200]
            for t in tensors[:3]:
                t.grad = None
            _free()
    for row, ms_list, sampled in zip(rows, times, clock_samples):
        if row["status"] != "ok":
            row["peak_mem_gib"] = None
            continue
        row["ms"] = statistics.median(ms_list)
        row["tflops"] = flops(row, mode) / (row["ms"] * 1e-3) / 1e12
        if args.rounds > 1:
            row["ms_rounds"] = ms_list
        row.update(clock_fields(sampled))
    return rows


def benchmark(args, device: str, on_progress=lambda results: None,
              clocks: gpu_clocks.ClockRecorder | None = None) -> list[dict]:
    """Every requested case; on_progress(results so far) after each sequence length, so that a run stopped
    by a time limit keeps what it measured. With args.rounds > 1 every method of a case stays
    alive and each mode times the methods in turn, rounds times, --rep-ms each: a row's ms is the median of its
    rounds (all of them in ms_rounds), so a clock that drifts over the case (the H100's power cap) moves every
    method alike instead of whichever ran last. clocks (--clocks): the recorder _time_mode samples each timing in."""
    results = []
    for head_dim in args.hdims:
        for causal in args.causal:
            for seqlen in args.seqlens:
                batch, heads = shape_for(seqlen, head_dim)
                base0 = {
                    "device": device, "inputs": args.inputs, "hd": head_dim, "causal": causal,
                    "seqlen": seqlen, "batch": batch, "heads": heads, "dtype": "bf16",
                    **({"gqa": args.gqa} if args.gqa > 1 else {}),
                }  # fmt: skip
                # One case's methods: all alive at once with --rounds, else one after another.
                for group in [args.methods] if args.rounds > 1 else [[m] for m in args.methods]:
                    live, failed = _set_up(group, base0, args, torch.bfloat16)
                    results += failed
                    for mode in args.modes:
                        for row in _time_mode(mode, live, args, clocks=clocks):
                            results.append(row)
                            print(f"hd={head_dim:<3} causal={int(causal)} T={seqlen:<5} {row['method']:<15} {mode:<8} {_shown(row)}", flush=True)
                    del live
                    _free()
                on_progress(results)
    return results


def _shown(row: dict) -> str:
    """One result as the progress lines print it."""
    if row["status"] != "ok":
        return row["status"] + (f" ({row['note']})" if row.get("note") else "")
    spread = ""
    if row.get("ms_rounds"):
        spread = f"  rounds {min(row['ms_rounds']):.3f}-{max(row['ms_rounds']):.3f} ms"
    clock = ""
    if gpu_clocks.COUNT_FIELD in row:
        clock = f"  {_clock_cell(row)} MHz / W ({row[gpu_clocks.COUNT_FIELD]} samples)"
    return f"{row['tflops']:7.1f} TFLOP/s  {row['ms']:8.3f} ms  peak {row['peak_mem_gib']:.2f} GiB{spread}{clock}"


# ------------------------------------------------------------------------------------------ results file
def inputs_kind(row: dict) -> str:
    return row.get("inputs", "native")  # rows from before --inputs existed


def gqa_of(row: dict) -> int:
    return row.get("gqa", 1)  # query heads per key/value head; rows from before --gqa existed have 1


def result_key(row: dict) -> tuple:
    return (row["device"], inputs_kind(row), gqa_of(row), row["method"], row["hd"], bool(row["causal"]), row["seqlen"],
            row["mode"])


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """new replaces old entries with the same (device, inputs, gqa, method, hd, causal, T, mode); the rest is kept."""
    merged = {result_key(r): r for r in old}
    merged.update({result_key(r): r for r in new})
    return sorted(merged.values(), key=lambda r: (r["device"], r["hd"], r["causal"], r["mode"], r["seqlen"], METHODS.index(r["method"]) if r["method"] in METHODS else 99))


def load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"environment": {}, "results": []}


def save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")  # git-ignored; rename is atomic, so an interrupted run leaves the old file
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def environment() -> dict:
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    import flash_kernel

    env["flash_kernel"] = "available" if flash_kernel.is_available() else flash_kernel.unavailable_reason()
    env["kernel_version"] = flash_kernel.KERNEL_VERSION  # of the package's sources (ours; --candidate's is its own)
    try:
        import triton

        env["triton"] = triton.__version__
        env["timer"] = "triton.testing.do_bench (median)"
    except ImportError:
        env["timer"] = "torch.cuda.Event loop (median)"
    return env


# ------------------------------------------------------------------------------------------ table + plot
def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['tflops']:.0f}" if row["status"] == "ok" else row["status"]


def _ratio(a: dict | None, b: dict | None) -> str:
    if a is None or b is None or a["status"] != "ok" or b["status"] != "ok":
        return "-"
    return f"{a['tflops'] / b['tflops']:.2f}"


def _clock_cell(row: dict | None) -> str:
    """The row's SM clock / power draw (medians, MHz / W) as "1755 / 652", "-" for what it lacks."""
    if row is None or (gpu_clocks.CLOCK_FIELD not in row and gpu_clocks.POWER_FIELD not in row):
        return "-"
    return " / ".join(f"{row[f]:.0f}" if f in row else "-" for f in (gpu_clocks.CLOCK_FIELD, gpu_clocks.POWER_FIELD))


def _clock_table(methods: list[str], seqlens: list[int], get) -> list[str]:
    """The lines of a section's clock table (T x method: SM clock MHz / power W); none when no row has clocks."""
    if not any(_clock_cell(get(m, seqlen)) != "-" for m in methods for seqlen in seqlens):
        return []
    header = ["T"] + [LABELS[m] for m in methods]
    out = ["\nSM clock (MHz) / power (W) while timed, medians (--clocks):\n", "| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
    for seqlen in seqlens:
        out.append("| " + " | ".join([str(seqlen)] + [_clock_cell(get(m, seqlen)) for m in methods]) + " |")
    return out


def _inputs_title(inputs: str, gqa: int = 1) -> str:
    same = "" if inputs == "native" else ", every method on the same (B, T, H, D) tensors"
    return same + (f", {gqa} query heads per key/value head" if gqa > 1 else "")


def _rows_of(results: list[dict], device: str, inputs: str, gqa: int) -> list[dict]:
    return [r for r in results if r["device"] == device and inputs_kind(r) == inputs and gqa_of(r) == gqa]


def format_table(results: list[dict], device: str, inputs: str = "native", gqa: int = 1) -> str:
    """Markdown tables (TFLOP/s) per hd x causal x mode, with ours / SDPA-FLASH (FA2), ours / SDPA-default,
    ours / cuDNN and ours / FlashAttention-4 ratios."""
    rows = _rows_of(results, device, inputs, gqa)
    index = {(r["method"], r["hd"], bool(r["causal"]), r["seqlen"], r["mode"]): r for r in rows}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    out = [f"## {device}: attention TFLOP/s (bf16, B*T = {TOKENS}, heads = {HIDDEN} // hd{_inputs_title(inputs, gqa)})"]
    for mode in MODES:
        for head_dim in sorted({r["hd"] for r in rows}):
            for causal in (False, True):
                seqlens = sorted({r["seqlen"] for r in rows if r["hd"] == head_dim and bool(r["causal"]) == causal and r["mode"] == mode})
                if not seqlens:
                    continue
                out.append(f"\n### {MODE_LABELS[mode]}, hd {head_dim}, {'causal' if causal else 'non-causal'}\n")
                candidate = "ours_candidate" in methods
                header = ["T"] + [LABELS[m] for m in methods] + ["ours/FLASH", "ours/SDPA", "ours/cuDNN", "ours/FA4"]
                header += ["candidate/ours", "candidate/FA4"] if candidate else []
                out.append("| " + " | ".join(header) + " |")
                out.append("|" + "---|" * len(header))
                for seqlen in seqlens:
                    get = lambda m: index.get((m, head_dim, causal, seqlen, mode))  # noqa: E731
                    cells = [str(seqlen)] + [_cell(get(m)) for m in methods]
                    cells += [_ratio(get("ours"), get(m)) for m in ("sdpa_flash", "sdpa", "sdpa_cudnn", "fa4")]
                    if candidate:
                        cells += [_ratio(get("ours_candidate"), get(m)) for m in ("ours", "fa4")]
                    out.append("| " + " | ".join(cells) + " |")
                out += _clock_table(methods, seqlens, lambda m, t: index.get((m, head_dim, causal, t, mode)))
    return "\n".join(out)


def plot(results: list[dict], device: str, path: Path, inputs: str = "native", gqa: int = 1) -> Path:
    """FA2 Figure 5 layout: grouped bars of TFLOP/s vs T per method; rows fwd+bwd / fwd / bwd, columns hd x causal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows_of(results, device, inputs, gqa)
    index = {(r["method"], r["hd"], bool(r["causal"]), r["seqlen"], r["mode"]): r for r in rows}
    modes = [m for m in ("fwd_bwd", "fwd", "bwd") if any(r["mode"] == m for r in rows)]
    panels = [(hd, c) for hd in sorted({r["hd"] for r in rows}) for c in (False, True) if any(r["hd"] == hd and bool(r["causal"]) == c for r in rows)]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(len(modes), len(panels), figsize=(4.6 * len(panels), 3.6 * len(modes)), squeeze=False)
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(methods))
    for i, mode in enumerate(modes):
        for j, (head_dim, causal) in enumerate(panels):
            ax = axes[i][j]
            seqlens = sorted({r["seqlen"] for r in rows if r["hd"] == head_dim and bool(r["causal"]) == causal})
            for mi, method in enumerate(methods):
                xs = [s + (mi - (len(methods) - 1) / 2) * width for s in range(len(seqlens))]
                for x, seqlen in zip(xs, seqlens):
                    r = index.get((method, head_dim, causal, seqlen, mode))
                    if r is None:
                        continue
                    if r["status"] == "ok":
                        ax.bar(x, r["tflops"], width, color=colors(mi))
                        ax.text(x, r["tflops"], f"{r['tflops']:.0f}", rotation=90, ha="center", va="bottom", fontsize=5)
                    else:  # OOM / n/a shown, not hidden
                        ax.text(x, 0, r["status"], rotation=90, ha="center", va="bottom", fontsize=6, color=colors(mi))
            ax.set_xticks(range(len(seqlens)))
            ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_title(f"{MODE_LABELS[mode]}, hd {head_dim}, {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.grid(axis="y", alpha=0.3)
    # One legend entry per method, also for methods that only have OOM / n/a here.
    from matplotlib.patches import Patch

    handles = [Patch(color=colors(mi), label=LABELS[m]) for mi, m in enumerate(methods)]
    title = f"Attention TFLOP/s on {device} (bf16, B*T = {TOKENS}, heads = {HIDDEN} // hd{_inputs_title(inputs, gqa)})"
    return save_figure(fig, title, handles, path)


# -------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="default: every method, ours_candidate only with --candidate")
    p.add_argument("--hdims", nargs="+", type=int, default=HEAD_DIMS)
    p.add_argument("--seqlens", nargs="+", type=int, default=SEQLENS)
    p.add_argument("--causal", nargs="+", type=int, choices=[0, 1], default=[0, 1], help="0 non-causal, 1 causal")
    p.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=None,
                   help=f"do_bench's timed span per measurement "
                        f"(default {REP_MS:.0f}, with --clocks {CLOCKS_REP_MS:.0f})")
    p.add_argument("--rounds", type=int, default=1,
                   help="> 1: time a case's methods in turn this many times per mode (--rep-ms each), rows take the median")
    p.add_argument("--inputs", choices=INPUTS, default="native", help="each method's own layout, or the same (B, T, H, D) tensors for all")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSON file the parts merge into")
    p.add_argument("--plot-only", action="store_true", help="no GPU: redraw the table and figure from --results")
    p.add_argument("--device", default=None, help="with --plot-only: which device's results (default: all)")
    add_candidate_arguments(p)
    p.add_argument("--gqa", type=int, default=1, help="query heads per key/value head (k and v get heads / gqa)")
    p.add_argument("--clocks", action="store_true",
                   help="record the SM clock and power draw (nvidia-smi) while each method is timed: row fields "
                        "sm_clock_mhz, power_w, clock_samples (bench/gpu_clocks.py)")
    p.add_argument("--varlen", action="store_true",
                   help="the document-masked and sliding-window grid instead (bench/kernel_varlen.py; `--varlen --help`)")
    args = p.parse_args(argv)
    read_candidate_arguments(p, args, METHODS)
    if args.rep_ms is None:
        args.rep_ms = CLOCKS_REP_MS if args.clocks else REP_MS
    args.causal = [bool(c) for c in args.causal]
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.gqa < 1 or any((HIDDEN // hd) % args.gqa for hd in args.hdims):
        p.error(f"--gqa {args.gqa} must divide every head dim's {HIDDEN} // hd heads: {[HIDDEN // hd for hd in args.hdims]}")
    return args


def add_candidate_arguments(p: argparse.ArgumentParser) -> None:
    """--candidate and --candidate-overrides (this grid's and the varlen grid's)."""
    p.add_argument("--candidate", type=Path, default=None, metavar="SO",
                   help="another build of the extension (`python -m flash_kernel.build --out DIR` prints its file), "
                        "timed as method ours_candidate in turn with ours; keep its rows apart with --results")
    p.add_argument("--candidate-overrides", nargs="+", default=[], metavar="KEY=VALUE",
                   help="flash_kernel.interface.kernel_overrides for ours_candidate (e.g. bwd_causal_group_heads=1, "
                        "causal_group_heads=4, bwd=sm80): the package's build, or --candidate's, under them")


def read_candidate_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, methods: list[str]) -> None:
    """--candidate-overrides parsed; --methods left out: every one of `methods`, ours_candidate only where a
    candidate build or overrides were given."""
    args.candidate_overrides = _parse_overrides(p, args.candidate_overrides)
    if args.methods is None:
        with_candidate = args.candidate is not None or args.candidate_overrides
        args.methods = [m for m in methods if m != "ours_candidate" or with_candidate]


def _parse_overrides(p: argparse.ArgumentParser, pairs: list[str]) -> dict[str, int | str]:
    """KEY=VALUE pairs -> set_kernel_overrides' keyword arguments (values read as bench/common.py parse_sets reads
    them: 1 -> 1, sm80 -> 'sm80'); an unknown switch or a pair without '=' stops here, naming the switches there are."""
    from flash_kernel.interface import set_kernel_overrides

    known = list(inspect.signature(set_kernel_overrides).parameters)
    switches = f"set_kernel_overrides' switches ({', '.join(known)})"
    overrides = parse_sets(pairs, "--candidate-overrides", f"a key of {switches}")
    for key in overrides:
        if key not in known:
            p.error(f"--candidate-overrides takes KEY=VALUE pairs of {switches}, got {key!r}")
    return overrides


def report(data: dict, devices: list[str], results_path: Path, inputs: str = "native", gqa: int = 1) -> None:
    suffix = ("" if inputs == "native" else f"_{inputs}") + (f"_gqa{gqa}" if gqa > 1 else "")
    for device in devices:
        if not _rows_of(data["results"], device, inputs, gqa):
            print(f"\n{device}: no results with --inputs {inputs} --gqa {gqa}")
            continue
        if can_plot("bench/kernel.py"):
            png_path = results_path.parent / f"kernel_{device_slug(device)}{suffix}.png"
            png = plot(data["results"], device, png_path, inputs, gqa)
            print(f"\nfigure: {png}")
        env = data.get("environment", {}).get(device, {})
        if env:
            print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
        print(format_table(data["results"], device, inputs, gqa))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--varlen" in argv:  # the document-masked / sliding-window grid, with its own options
        from bench import kernel_varlen

        return kernel_varlen.main([a for a in argv if a != "--varlen"])
    args = parse_args(argv)
    if args.plot_only:
        data = load(args.results)
        if not data["results"]:
            sys.exit(f"bench/kernel.py --plot-only: no results in {args.results}")
        devices = [args.device] if args.device else sorted({r["device"] for r in data["results"]})
        report(data, devices, args.results, args.inputs, args.gqa)
        return 0
    if not torch.cuda.is_available():
        sys.exit(
            "bench/kernel.py: needs a CUDA GPU (torch.cuda.is_available() is False); "
            "run it on the GPU machine, or `--plot-only` to redraw from " + str(args.results)
        )
    if set(OURS) & set(args.methods):
        import flash_kernel

        if not flash_kernel.is_available():
            print(f"note: ours (flash_kernel) skipped: {flash_kernel.unavailable_reason()}")
    use_candidate(args.candidate, args.candidate_overrides, args.methods)
    torch.manual_seed(0)
    env = environment()
    device = env["device"]
    data = load(args.results)
    data.setdefault("environment", {})[device] = env
    old = data["results"]
    clocks = gpu_clocks.ClockRecorder.for_torch_device(torch.cuda.current_device()) if args.clocks else None

    def save_progress(results: list[dict]) -> None:
        if clocks is not None:
            env["gpu_clocks"] = clocks.description  # also when a span switched the recorder off
        data["results"] = merge(old, results)
        save(args.results, data)

    with clocks or contextlib.nullcontext():  # nvidia-smi ends with the run, also on an error or Ctrl-C
        new = benchmark(args, device, save_progress, clocks)
    print(f"\n{len(new)} results merged into {args.results}")
    report(data, [device], args.results, args.inputs, args.gqa)
    return 0


if __name__ == "__main__":
    sys.exit(main())
