"""Document-masked (variable-length) and sliding-window attention benchmark: `python bench/kernel.py --varlen`.

Two grids, bf16, causal, hidden 2048 (hd 64 x 32 heads, hd 128 x 16 heads) as the dense grid of bench/kernel.py:
  docs    16k tokens per call, packed documents whose lengths come from bench/doc_lengths.py (the default
          corpus's documents, a lognormal, fixed 1k / 2k / 4k); each document attends only within itself.
          Methods: ours (flash_kernel.flash_attn_varlen_func on the packed (total, H, D) tensors), ours_dense
          (flash_attn_func, causal, on (B, T) = (16k / T, T) with T the power of two nearest the call's
          token-weighted mean document length: the same tokens and, for fixedN, the same work), flex
          (FlexAttention, torch.compile'd, with a document-causal BlockMask over one (1, H, 16k, D) sequence)
          and fa4 (FlashAttention-4's flash_attn.cute.flash_attn_varlen_func).
  window  dense (16k / T, T) calls, T = 8k and 16k, sliding window (FlashAttention's window_size = (w, 0):
          query i sees keys i - w ... i) for w = 256, 1024, 4096 and unbounded (plain causal, the reference).
          Methods: ours (flash_attn_func with window_size), flex (its sliding-window causal BlockMask), fa4.
Both grids: ours_candidate, ours' function run by another build (--candidate, --candidate-overrides: bench/kernel.py's),
timed in turn with ours, with a candidate/ours column; `python bench/speedup.py <results> --new ours_candidate --old
ours` takes its rounds one by one.
Block masks, cu_seqlens and the compiled flex function are built before timing; flex's compilation happens
in the untimed first call.

TFLOP/s count the unmasked work only, the same count for every method: 4 * H * hd * pairs for the forward
(2.5x that for the backward), where pairs is the area of the visible (query, key) region of each sequence,
the FA2 paper's convention (T^2 / 2 for causal; w * T - w^2 / 2 for a window w < T). A dense causal call
and a fixedN call of the same shape thus count the same FLOPs, and a window's TFLOP/s stay comparable while
its time falls (flash_kernel.flop_count counts the exact discrete pairs, T (T + 1) / 2 for causal, for
FlopCounterMode; the benchmark keeps the paper's area so that its numbers line up with the dense grid's). Times:
triton.testing.do_bench medians over --rounds interleaved rounds (bench/kernel.py's timer). A method that cannot
run here (ours before the varlen kernel or the window argument existed, FA4 without flash_attn.cute) is recorded as
"skipped" with the reason.

    python bench/kernel.py --varlen                                  # both grids, both head dims
    python bench/kernel.py --varlen --hdims 128 --cases fixed2k corpus --methods ours ours_dense flex
    python bench/kernel.py --varlen --cases window --windows 1024 --window-seqlens 16384
    python bench/kernel.py --varlen --candidate DIR/_C*.so --methods ours ours_candidate --modes bwd --rounds 5 \\
        --results /tmp/varlen_candidate.json                         # another build beside the package's
    python bench/kernel.py --varlen --plot-only                      # redraw tables + figure from the JSON

Results merge into bench/results/kernel_varlen.json (one entry per device, grid, case, window, method, hd,
mode); the figure goes to bench/results/kernel_varlen_<device>.png (TFLOP/s for the docs grid, ms for the
window grid).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import doc_lengths  # noqa: E402
from bench import kernel as dense  # noqa: E402
from bench.common import can_plot, device_slug, merge_rows, save_figure  # noqa: E402

RESULTS = REPO / "bench" / "results" / "kernel_varlen.json"
DOC_CASES = list(doc_lengths.DISTRIBUTIONS)
CASES = [*DOC_CASES, "window"]
WINDOWS = [256, 1024, 4096]
WINDOW_SEQLENS = [8192, 16384]
METHODS = ["ours", "ours_candidate", "ours_dense", "flex", "fa4"]
WINDOW_METHODS = ("ours", "ours_candidate", "flex", "fa4")  # the window grid's ours is already the dense function
MODES = ["fwd", "fwd_bwd"]
LABELS = {"ours": "ours", "ours_candidate": "ours, candidate", "ours_dense": "ours dense", "flex": "FlexAttention",
          "fa4": "FlashAttention-4"}
DOC_LABELS = {"ours": "ours varlen", "ours_candidate": "ours varlen, candidate", "ours_dense": "ours dense causal",
              "flex": "flex document mask", "fa4": "FA4 varlen"}
MIN_DENSE_SEQLEN = 128


# ----------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One call's worth of work: the sequences it holds (documents of a packed call, or the B rows of a dense
    (B, T) call), its head shape, and the left window (-1: unbounded)."""

    grid: str  # "docs" | "window"
    name: str  # the distribution (docs), or "T<seqlen>" (window)
    hd: int
    heads: int
    lengths: tuple[int, ...]
    window: int = -1

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def visible_pairs(lengths, window: int = -1) -> float:
    """Unmasked (query, key) pairs of causal attention within each sequence, as the area of the visible region
    (the FA2 paper's T^2 / 2 for causal): a window w (query i sees keys i - w ... i) leaves w * T - w^2 / 2."""
    total = 0.0
    for n in lengths:
        n = float(n)
        total += n * n / 2 if window < 0 or window >= n else window * n - window * window / 2
    return total


def pair_flops(pairs: float, heads: int, head_dim: int, mode: str) -> float:
    """FA2 convention per visible pair: 4 * hd FLOPs per head in the forward (QK^T and PV), 2.5x in the backward."""
    fwd = 4.0 * heads * head_dim * pairs
    return {"fwd": fwd, "bwd": dense.BWD_FLOPS_RATIO * fwd, "fwd_bwd": (1 + dense.BWD_FLOPS_RATIO) * fwd}[mode]


def dense_shape(lengths, tokens: int) -> tuple[int, int]:
    """(B, T) of the dense causal baseline of a packed call: T the power of two nearest (in log) its
    token-weighted mean document length, within [MIN_DENSE_SEQLEN, tokens]; B = tokens // T."""
    mean = doc_lengths.summary(lengths)["token_mean_doc"]
    seqlen = 2 ** round(np.log2(max(mean, 1.0)))
    seqlen = int(min(max(seqlen, MIN_DENSE_SEQLEN), tokens))
    return max(1, tokens // seqlen), seqlen


def make_cases(args, corpus=None) -> list[Case]:
    """The docs cases (every distribution in args.cases, per head dim), then the window cases."""
    out = []
    for hd in args.hdims:
        heads = dense.HIDDEN // hd
        for name in (c for c in args.cases if c in DOC_CASES):
            lengths = doc_lengths.sample_lengths(name, args.tokens, corpus)
            out.append(Case("docs", name, hd, heads, tuple(lengths)))
        if "window" in args.cases:
            for seqlen in args.window_seqlens:
                for window in [-1, *args.windows]:
                    rows = (seqlen,) * max(1, args.tokens // seqlen)
                    out.append(Case("window", f"T{seqlen}", hd, heads, rows, window))
    return out


def methods_of(case: Case, methods: list[str]) -> list[str]:
    return [m for m in methods if case.grid == "docs" or m in WINDOW_METHODS]


# --------------------------------------------------------------------------------------------- methods
def _ours(require: str):
    """flash_kernel's function `require`, or BackendUnsupported saying why it cannot run."""
    import flash_kernel

    if not flash_kernel.is_available():
        raise dense.BackendUnsupported(f"flash_kernel unavailable: {flash_kernel.unavailable_reason()}")
    fn = getattr(flash_kernel, require, None)
    if fn is None:
        raise dense.BackendUnsupported(f"flash_kernel has no {require} (built from a tree without the varlen kernel)")
    return fn


def _accepts_window(fn) -> bool:
    try:
        return "window_size" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True  # a builtin without a signature: let the call itself say


def _fa4(name: str):
    try:
        module = __import__("flash_attn.cute", fromlist=[name])
        return getattr(module, name)
    except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
        raise dense.BackendUnsupported(f"flash_attn.cute (FlashAttention-4) does not import: {type(e).__name__}: {e}") from None


@functools.cache
def _flex_compiled():
    """torch.compile'd flex_attention: every case is another (shape, mask) to compile, so the recompile limit
    rises from its default 8, past which flex would run eagerly and materialize the T x T scores."""
    from torch.nn.attention.flex_attention import flex_attention

    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # older torch
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
    return torch.compile(flex_attention, dynamic=False)


def causal_mask_mod(doc_ids: torch.Tensor | None = None, window: torch.Tensor | None = None):
    """FlexAttention mask_mod: causal; within one document when doc_ids ((total,), the document of each token)
    is given; q - kv <= window when window (a 0-dim tensor) is given. Tensors rather than Python numbers, so
    that every case of one shape compiles to the same kernel."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if doc_ids is not None:
            keep = keep & (doc_ids[q_idx] == doc_ids[kv_idx])
        if window is not None:
            keep = keep & (q_idx - kv_idx <= window)
        return keep

    return mask_mod


def flex_block_mask(case: Case, device):
    """The BlockMask of a case: document causal over the packed sequence (docs), or (sliding-window) causal over
    each of the B rows (window); broadcast over batch and heads."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc_ids = torch.from_numpy(doc_lengths.document_ids(case.lengths)).to(device) if case.grid == "docs" else None
    window = torch.tensor(case.window, device=device) if case.window >= 0 else None
    seqlen = case.tokens if case.grid == "docs" else case.lengths[0]
    return create_block_mask(causal_mask_mod(doc_ids, window), None, None, seqlen, seqlen, device=device)


def _leaves(shape, dtype, device):
    leaves = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    return leaves, torch.randn(shape, device=device, dtype=dtype)


def make_method(method: str, case: Case, dtype, device=dense.DEVICE):
    """((q, k, v, dO), fn computing o, context factory) as bench.kernel.run_mode takes them, and the row field
    naming the layout the method reads."""
    if method not in methods_of(case, METHODS):
        raise ValueError(f"method {method!r} has no {case.grid} case; choose from {methods_of(case, METHODS)}")
    H, D, total = case.heads, case.hd, case.tokens
    window_size = (case.window, 0)
    batch, seqlen = (len(case.lengths), case.lengths[0]) if case.grid == "window" else dense_shape(case.lengths, total)
    # ours_candidate: ours' function and tensors, run by the --candidate build (bench.kernel's candidate context)
    dense.require_candidate(method)
    context = dense._candidate_context if method == "ours_candidate" else contextlib.nullcontext
    ours = method in ("ours", "ours_candidate")
    if case.grid == "docs" and (ours or method == "fa4"):
        fn_of = _ours("flash_attn_varlen_func") if ours else _fa4("flash_attn_varlen_func")
        (q, k, v), do = _leaves((total, H, D), dtype, device)  # (total, H, D)
        cu = torch.from_numpy(doc_lengths.cu_seqlens(case.lengths)).to(device)
        longest = max(case.lengths)
        if ours:
            fn = lambda: fn_of(q, k, v, cu, cu, longest, longest, causal=True)  # noqa: E731
        else:
            fn = lambda: fn_of(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,  # noqa: E731
                               max_seqlen_k=longest, causal=True)[0]  # (out, lse) -> out
        return (q, k, v, do), fn, context, {"layout": f"packed ({total}, H, D)"}
    if method == "flex":
        flex = _flex_compiled()
        shape = (1, H, total, D) if case.grid == "docs" else (batch, H, seqlen, D)
        (q, k, v), do = _leaves(shape, dtype, device)  # (B, H, T, D), flex's layout
        block_mask = flex_block_mask(case, device)
        fn = lambda: flex(q, k, v, block_mask=block_mask)  # noqa: E731
        return (q, k, v, do), fn, contextlib.nullcontext, {"layout": f"({shape[0]}, H, {shape[2]}, D)"}
    # dense (B, T, H, D) calls: ours_dense (docs baseline), ours (and its candidate) and fa4 of the window grid
    fn_of = _ours("flash_attn_func") if method != "fa4" else _fa4("flash_attn_func")
    if case.grid == "window" and case.window >= 0 and ours and not _accepts_window(fn_of):
        raise dense.BackendUnsupported("flash_kernel.flash_attn_func has no window_size (built from a tree without it)")
    (q, k, v), do = _leaves((batch, seqlen, H, D), dtype, device)  # (B, T, H, D)
    kwargs = {"window_size": window_size} if case.grid == "window" and case.window >= 0 else {}
    if method == "fa4":
        fn = lambda: fn_of(q, k, v, causal=True, **kwargs)[0]  # noqa: E731  (out, lse) -> out
    else:
        fn = lambda: fn_of(q, k, v, causal=True, **kwargs)  # noqa: E731
    return (q, k, v, do), fn, context, {"layout": f"({batch}, {seqlen}, H, D)"}


# ----------------------------------------------------------------------------------------------- timing
def base_row(case: Case, method: str, device: str) -> dict:
    """The fields every result row of (case, method) carries; pairs are the method's own work (ours_dense runs
    its (B, T) shape, every other method the case's sequences)."""
    lengths, shape = case.lengths, {}
    if case.grid == "window":
        shape = {"batch": len(lengths), "seqlen": lengths[0]}
    elif method == "ours_dense":
        batch, seqlen = dense_shape(lengths, case.tokens)
        lengths, shape = (seqlen,) * batch, {"batch": batch, "seqlen": seqlen}
    s = doc_lengths.summary(case.lengths)
    return {
        "device": device, "grid": case.grid, "case": case.name, "window": case.window, "method": method,
        "hd": case.hd, "heads": case.heads, "tokens": case.tokens, "dtype": "bf16", "causal": True,
        "docs": s["docs"], "max_doc": s["max_doc"], "token_mean_doc": round(s["token_mean_doc"], 1),
        "pairs": visible_pairs(lengths, case.window), **shape,
    }  # fmt: skip


def row_flops(row: dict, mode: str) -> float:
    return pair_flops(row["pairs"], row["heads"], row["hd"], mode)


def _status_rows(base: dict, modes, status: str, note: str = "") -> list[dict]:
    return [dict(base, mode=m, status=status, ms=None, tflops=None, peak_mem_gib=None, note=note) for m in modes]


def set_up(case: Case, methods: list[str], args, device: str, dtype=torch.bfloat16) -> tuple[list, list[dict]]:
    """The case's methods ready to time, (base row, tensors, fn, context) each, and the rows of those that could
    not be set up ("skipped" with the reason, "OOM", or "error" with the message)."""
    live, failed = [], []
    for method in methods_of(case, methods):
        base = base_row(case, method, device)
        try:
            tensors, fn, context, fields = make_method(method, case, dtype)
        except dense.BackendUnsupported as e:
            print(f"skip {method} ({case.grid} {case.name}): {e}")
            failed += _status_rows(base, args.modes, "skipped", str(e)[:200])
            continue
        except torch.OutOfMemoryError:
            failed += _status_rows(base, args.modes, "OOM")
            dense._free()
            continue
        except Exception as e:  # a mask or a compiler that fails on this host: one row, not the whole grid
            note = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            print(f"error {method} ({case.grid} {case.name}): {note}")
            failed += _status_rows(base, args.modes, "error", note)
            dense._free()
            continue
        live.append((dict(base, **fields), tensors, fn, context))
    return live, failed


def benchmark(args, device: str, corpus=None, on_progress=lambda results: None) -> list[dict]:
    """Every case, its methods timed in turn args.rounds times per mode (bench.kernel._time_mode); on_progress
    after each case, so that a run stopped by a time limit keeps what it measured."""
    results = []
    for case in make_cases(args, corpus):
        live, failed = set_up(case, args.methods, args, device)
        results += failed
        for mode in args.modes:
            for row in dense._time_mode(mode, live, args, flops=row_flops):
                results.append(row)
                print(f"{case.grid:<6} {case.name:<9} w={case.window:<5} hd={case.hd:<3} {row['method']:<10} {mode:<8} {dense._shown(row)}", flush=True)
        del live
        dense._free()
        on_progress(results)
    return results


# ------------------------------------------------------------------------------------------ results file
def result_key(row: dict) -> tuple:
    return (row["device"], row["grid"], row["case"], row["window"], row["method"], row["hd"], row["mode"])


def _order(row: dict) -> tuple:
    case = DOC_CASES.index(row["case"]) if row["case"] in DOC_CASES else 99
    return (row["device"], row["grid"], row["hd"], row["mode"], case, row["case"], row["window"], METHODS.index(row["method"]))


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """new replaces old entries with the same result_key; the rest is kept."""
    return merge_rows(old, new, result_key, _order)


# ------------------------------------------------------------------------------------------ table + plot
def _cell(row: dict | None, key: str = "tflops", fmt: str = "{:.0f}") -> str:
    if row is None:
        return "-"
    return fmt.format(row[key]) if row["status"] == "ok" else row["status"]


def _ratio(a: dict | None, b: dict | None, key: str = "tflops") -> str:
    if a is None or b is None or a["status"] != "ok" or b["status"] != "ok":
        return "-"
    return f"{a[key] / b[key]:.2f}"


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _window_name(window: int) -> str:
    return "causal" if window < 0 else str(window)


def format_table(results: list[dict], device: str) -> str:
    """Markdown tables per grid x mode x hd: TFLOP/s of every method (unmasked work), with ours / dense,
    ours / flex and ours / FA4 ratios; the window tables add ms and ours' time against plain causal."""
    rows = [r for r in results if r["device"] == device]
    index = {(r["grid"], r["case"], r["window"], r["method"], r["hd"], r["mode"]): r for r in rows}
    out = [f"## {device}: document-masked and sliding-window attention TFLOP/s (bf16, causal, heads = "
           f"{dense.HIDDEN} // hd, unmasked pairs only)"]
    docs = [r for r in rows if r["grid"] == "docs"]
    candidate = any(r["method"] == "ours_candidate" for r in rows)  # its column and candidate/ours only where it ran
    methods = [m for m in METHODS if m != "ours_candidate" or candidate]
    window_methods = [m for m in WINDOW_METHODS if m != "ours_candidate" or candidate]
    for mode in MODES + ["bwd"]:
        for hd in sorted({r["hd"] for r in docs if r["mode"] == mode}):
            cases = sorted({r["case"] for r in docs if r["hd"] == hd and r["mode"] == mode}, key=lambda c: (DOC_CASES.index(c) if c in DOC_CASES else 99, c))
            out.append(f"\n### documents, {dense.MODE_LABELS[mode]}, hd {hd}, {docs[0]['tokens']} tokens per call\n")
            header = ["documents", "n", "longest", "mean len", *(DOC_LABELS[m] for m in methods), "dense (B x T)",
                      "ours/dense", "ours/flex", "ours/FA4"] + (["candidate/ours"] if candidate else [])  # fmt: skip
            out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for case in cases:
                get = lambda m: index.get(("docs", case, -1, m, hd, mode))  # noqa: E731
                any_row = next(get(m) for m in METHODS if get(m) is not None)
                d = get("ours_dense")
                shape = f"{d['batch']} x {_short(d['seqlen'])}" if d is not None and d.get("seqlen") else "-"
                cells = [case, str(any_row["docs"]), str(any_row["max_doc"]), f"{any_row['token_mean_doc']:.0f}"]
                cells += [_cell(get(m)) for m in methods] + [shape]
                cells += [_ratio(get("ours"), get(m)) for m in ("ours_dense", "flex", "fa4")]
                cells += [_ratio(get("ours_candidate"), get("ours"))] if candidate else []
                out.append("| " + " | ".join(cells) + " |")
    windows = [r for r in rows if r["grid"] == "window"]
    for mode in MODES + ["bwd"]:
        for hd in sorted({r["hd"] for r in windows if r["mode"] == mode}):
            keys = sorted({(int(r["case"][1:]), r["window"]) for r in windows if r["hd"] == hd and r["mode"] == mode},
                          key=lambda k: (k[0], k[1] < 0, k[1]))  # causal after the windows of its T
            out.append(f"\n### sliding window, {dense.MODE_LABELS[mode]}, hd {hd}, dense (16k / T, T)\n")
            header = ["T", "window", *(LABELS[m] for m in window_methods), "ours ms", "flex ms", "ours ms / causal",
                      "ours/flex", "ours/FA4"] + (["candidate/ours"] if candidate else [])  # fmt: skip
            out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for seqlen, window in keys:
                get = lambda m, w=window: index.get(("window", f"T{seqlen}", w, m, hd, mode))  # noqa: E731
                cells = [_short(seqlen), _window_name(window), *(_cell(get(m)) for m in window_methods)]
                cells += [_cell(get("ours"), "ms", "{:.3f}"), _cell(get("flex"), "ms", "{:.3f}")]
                cells += [_ratio(get("ours"), get("ours", -1), "ms")]
                cells += [_ratio(get("ours"), get(m)) for m in ("flex", "fa4")]
                cells += [_ratio(get("ours_candidate"), get("ours"))] if candidate else []
                out.append("| " + " | ".join(cells) + " |")
    notes = sorted({f"{r['method']}: {r['note']}" for r in rows if r["status"] in ("skipped", "error") and r.get("note")})
    if notes:
        out.append("\n" + "\n".join(f"- {n}" for n in notes))
    return "\n".join(out)


def plot(results: list[dict], device: str, path: Path) -> Path:
    """Grouped bars: docs panels (TFLOP/s per distribution and method) and window panels (ms per T / window and
    method); rows fwd+bwd / fwd, one column per grid x hd."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [r for r in results if r["device"] == device]
    index = {(r["grid"], r["case"], r["window"], r["method"], r["hd"], r["mode"]): r for r in rows}
    modes = [m for m in ("fwd_bwd", "fwd", "bwd") if any(r["mode"] == m for r in rows)]
    panels = [(g, hd) for g in ("docs", "window") for hd in sorted({r["hd"] for r in rows if r["grid"] == g})]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]  # colors by this index in every panel
    fig, axes = plt.subplots(len(modes), len(panels), figsize=(5.2 * len(panels), 3.6 * len(modes)), squeeze=False)
    colors = plt.get_cmap("tab10")
    for i, mode in enumerate(modes):
        for j, (grid, hd) in enumerate(panels):
            ax = axes[i][j]
            mine = [r for r in rows if r["grid"] == grid and r["hd"] == hd and r["mode"] == mode]
            if grid == "docs":
                xs = sorted({(r["case"], -1) for r in mine}, key=lambda k: DOC_CASES.index(k[0]) if k[0] in DOC_CASES else 99)
                labels, key, unit = [c for c, _ in xs], "tflops", "TFLOP/s"
            else:
                xs = sorted({(r["case"], r["window"]) for r in mine}, key=lambda k: (int(k[0][1:]), k[1] < 0, k[1]))
                labels, key, unit = [f"{_short(int(c[1:]))}\n{_window_name(w)}" for c, w in xs], "ms", "ms"
            here = [m for m in methods if any(r["method"] == m for r in mine)]
            width = 0.8 / max(1, len(here))
            for slot, method in enumerate(here):
                mi = methods.index(method)
                for x, (case, window) in enumerate(xs):
                    r = index.get((grid, case, window, method, hd, mode))
                    if r is None:
                        continue
                    pos = x + (slot - (len(here) - 1) / 2) * width
                    if r["status"] == "ok":
                        ax.bar(pos, r[key], width, color=colors(mi))
                        ax.text(pos, r[key], f"{r[key]:.0f}" if key == "tflops" else f"{r[key]:.2f}", rotation=90,
                                ha="center", va="bottom", fontsize=5)
                    else:  # skipped / OOM / error shown, not hidden
                        ax.text(pos, 0, r["status"], rotation=90, ha="center", va="bottom", fontsize=6, color=colors(mi))
            ax.set_xticks(range(len(xs)))
            ax.set_xticklabels(labels, fontsize=7)
            title = "documents" if grid == "docs" else "sliding window (T, window)"
            ax.set_title(f"{title}, {dense.MODE_LABELS[mode]}, hd {hd}", fontsize=9)
            ax.set_ylabel(unit)
            ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=colors(mi), label=LABELS[m]) for mi, m in enumerate(methods)]
    title = f"Document-masked and sliding-window attention on {device} (bf16, causal, TFLOP/s of unmasked pairs)"
    return save_figure(fig, title, handles, path)


# -------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench/kernel.py --varlen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=CASES, default=CASES, help="document-length distributions, and/or window")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="default: every method, ours_candidate only with --candidate or --candidate-overrides")
    p.add_argument("--hdims", nargs="+", type=int, default=dense.HEAD_DIMS)
    p.add_argument("--windows", nargs="+", type=int, default=WINDOWS, help="left window sizes of the window grid")
    p.add_argument("--window-seqlens", nargs="+", type=int, default=WINDOW_SEQLENS)
    p.add_argument("--tokens", type=int, default=dense.TOKENS, help="tokens per call")
    p.add_argument("--modes", nargs="+", choices=dense.MODES, default=MODES)
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=3, help="time a case's methods in turn this many times per mode")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSON file the parts merge into")
    p.add_argument("--data-cache-dir", type=Path, default=doc_lengths.CACHE_DIR,
                   help="where `make data` prepared the default corpus (else the committed lengths are used)")
    p.add_argument("--plot-only", action="store_true", help="no GPU: redraw the tables and figure from --results")
    p.add_argument("--device", default=None, help="with --plot-only: which device's results (default: all)")
    dense.add_candidate_arguments(p)
    args = p.parse_args(argv)
    dense.read_candidate_arguments(p, args, METHODS)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    for name, values in (("--hdims", args.hdims), ("--window-seqlens", args.window_seqlens)):
        if any(x < 1 for x in values):
            p.error(f"{name} must be positive, got {values}")
    if any(w < 0 for w in args.windows):
        p.error(f"--windows must be >= 0 (the unbounded causal row is always run), got {args.windows}")
    if any(args.tokens % t for t in args.window_seqlens if "window" in args.cases):
        p.error(f"--window-seqlens {args.window_seqlens} must divide --tokens {args.tokens}")
    return args


def report(data: dict, devices: list[str], results_path: Path) -> None:
    for device in devices:
        if can_plot("bench/kernel.py --varlen"):
            png = plot(data["results"], device, results_path.parent / f"kernel_varlen_{device_slug(device)}.png")
            print(f"\nfigure: {png}")
        env = data.get("environment", {}).get(device, {})
        if env:
            print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
        print(format_table(data["results"], device))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        data = dense.load(args.results)
        if not data["results"]:
            sys.exit(f"bench/kernel.py --varlen --plot-only: no results in {args.results}")
        devices = [args.device] if args.device else sorted({r["device"] for r in data["results"]})
        report(data, devices, args.results)
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench/kernel.py --varlen: needs a CUDA GPU (torch.cuda.is_available() is False); run it on the GPU "
                 "machine, or `--varlen --plot-only` to redraw from " + str(args.results))
    dense.use_candidate(args.candidate, args.candidate_overrides, args.methods)
    corpus, corpus_info = None, {}
    if "corpus" in args.cases:
        corpus, corpus_info = doc_lengths.corpus_lengths(args.data_cache_dir)
    torch.manual_seed(0)
    env = dense.environment()
    if corpus_info:
        env["corpus_lengths"] = corpus_info["from"]
    device = env["device"]
    data = dense.load(args.results)
    data.setdefault("environment", {})[device] = env
    old = data["results"]

    def save_progress(results: list[dict]) -> None:
        data["results"] = merge(old, results)
        dense.save(args.results, data)

    new = benchmark(args, device, corpus, save_progress)
    print(f"\n{len(new)} results merged into {args.results}")
    report(data, [device], args.results)
    return 0
