"""Where a profiled training step's GPU time goes, from a finished torch.profiler: each CUDA kernel's time per step
and by category, the GPU's idle gaps, and how NCCL's kernels meet compute. bench/profile_step.py's bare step and
bench/pipeline_profiler.py's pipeline step are summed up alike, so that the two compare line by line."""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

KEEP_KERNELS = 40  # the JSON keeps this many of the largest kernels (the categories sum them all)

# First match wins, so the specific names come before the generic ones ("copy", "elementwise"). Inductor's
# kernels carry the aten ops they fused in their names (triton_red_fused_native_layer_norm_...), so they fall
# into the category of the first op named here.
CATEGORIES: list[tuple[str, str]] = [
    ("communication", r"nccl"),
    ("attention", r"flash|fmha|sdpa|attn"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|\bmm\b|addmm"),
    ("AdamW", r"adam"),
    ("LayerNorm", r"layer_norm|layernorm|gammabeta"),
    ("GELU", r"gelu"),
    ("cross-entropy", r"softmax|nll_loss|cross_entropy"),
    ("dtype casts and copies", r"copy|cast|_to_"),
    ("reductions", r"reduce|norm|sum"),
    ("elementwise", r"elementwise|vectorized|add|mul|fill|where|triton_poi"),
]


def category(kernel: str) -> str:
    """The CATEGORIES name of a kernel (or aten op) name, case-insensitive; 'other' if none matches."""
    name = kernel.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, name)), "other")


def kernel_times(prof, steps: int) -> dict[str, float]:
    """Milliseconds per step of each CUDA kernel name in a finished profiler."""
    out: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.key] += evt.self_device_time_total / 1e3 / steps  # microseconds -> ms
    return dict(out)


def summarize(kernels: dict[str, float]) -> dict[str, float]:
    """ms per step by category, largest first, plus 'all kernels'."""
    cats: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        cats[category(name)] += ms
    out = dict(sorted(cats.items(), key=lambda kv: -kv[1]))
    out["all kernels"] = sum(kernels.values())
    return out


def _merged(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _common_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two _merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def communication_overlap(kernels: list[dict], steps: int) -> dict:
    """From chrome-trace kernel events ({"name", "ts", "dur" in µs, "args": {"grid"}}): ms per step during
    which NCCL kernels run, and how much of it no other kernel runs beside them (exposed); the most CTAs one
    NCCL kernel launched."""
    comm = [k for k in kernels if category(k["name"]) == "communication"]
    nccl = _merged((k["ts"], k["ts"] + k["dur"]) for k in comm)
    compute = _merged((k["ts"], k["ts"] + k["dur"]) for k in kernels if category(k["name"]) != "communication")
    busy = sum(end - start for start, end in nccl)
    hidden = _common_length(nccl, compute)
    return {"nccl_ms": busy / 1e3 / steps, "exposed_ms": (busy - hidden) / 1e3 / steps,
            "nccl_ctas": max((math.prod(k.get("args", {}).get("grid", [0])) for k in comm), default=0)}


def gpu_timeline(events: list[dict], steps: int) -> dict:
    """From chrome-trace GPU events (kernels, memcpys, memsets): ms per step from the first one's start to the
    last one's end (span), and how much of the span no GPU work runs (idle: the gaps the host leaves)."""
    busy = _merged((e["ts"], e["ts"] + e["dur"]) for e in events)
    if not busy:
        return {"span_ms": 0.0, "idle_ms": 0.0}
    span = busy[-1][1] - busy[0][0]
    return {"span_ms": span / 1e3 / steps, "idle_ms": (span - sum(end - start for start, end in busy)) / 1e3 / steps}


def gpu_events(prof) -> list[dict]:
    """The GPU's chrome-trace events of a finished profiler: kernels, memcpys and memsets."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def step_summary(prof, steps: int, wall_ms: float, world: int = 1) -> dict:
    """A finished profiler of `steps` steps that took `wall_ms` each, summed up: wall_ms_per_step, categories (ms per
    step), the KEEP_KERNELS largest kernels, the GPU's timeline, and with several ranks NCCL's overlap."""
    kernels = kernel_times(prof, steps)
    events = gpu_events(prof)
    return {
        **({"overlap": communication_overlap([e for e in events if e["cat"] == "kernel"], steps)} if world > 1 else {}),
        "timeline": gpu_timeline(events, steps),
        "wall_ms_per_step": wall_ms, "categories": summarize(kernels),
        "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:KEEP_KERNELS]),
    }
