"""Where a profiled training step's time goes, from a finished torch.profiler: each CUDA kernel's time per step and
by category, the GPU's idle gaps, how NCCL's kernels meet compute, and where the host recorded its ops, their time;
GcPauses times Python's garbage collections beside it, and write_gpu_trace keeps a rank's GPU events to compare
timelines across ranks. bench/profile_step.py's bare step and bench/pipeline_profiler.py's pipeline step are summed
up alike, so that the two compare line by line."""

from __future__ import annotations

import gc
import gzip
import json
import math
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

KEEP_KERNELS = 40  # the JSON keeps this many of the largest kernels (the categories sum them all)
KEEP_HOST_OPS = 25  # and with host ops recorded, this many of the host's largest ops by self time

# First match wins, so the specific names come before the generic ones ("copy", "elementwise"). Inductor's
# kernels carry the aten ops they fused in their names (triton_red_fused_native_layer_norm_...), so they fall
# into the category of the first op named here.
CATEGORIES: list[tuple[str, str]] = [
    ("communication", r"nccl"),
    ("attention", r"flash|fmha|sdpa|attn"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|\bmm\b|addmm"),
    ("AdamW", r"adam"),
    ("norms", r"layer_norm|layernorm|gammabeta|rms_norm"),  # LayerNorm and RMSNorm (eager runs both as layer_norm)
    ("GELU", r"gelu"),
    ("cross-entropy", r"softmax|nll_loss|cross_entropy"),
    ("dtype casts and copies", r"copy|cast|_to_"),
    ("reductions", r"reduce|norm|sum"),
    ("elementwise", r"elementwise|vectorized|add|mul|fill|where|triton_poi|swiglu"),
]


def category(kernel: str) -> str:
    """The CATEGORIES name of a kernel (or aten op) name, case-insensitive; 'other' if none matches."""
    name = kernel.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, name)), "other")


def activities(on_gpu: bool = True, host: bool = False) -> list:
    """What torch.profiler records for a step: the CUDA kernels on a GPU, and the host's ops with `host` (or off the
    GPU, where there is nothing else to record)."""
    from torch.profiler import ProfilerActivity

    return [*([ProfilerActivity.CUDA] if on_gpu else []), *([ProfilerActivity.CPU] if host or not on_gpu else [])]


def kernel_times(prof, steps: int) -> dict[str, float]:
    """Milliseconds per step of each CUDA kernel name in a finished profiler. The GPU ranges of annotations
    (record_function: "Optimizer.step#AdamW.step", "nccl:_reduce_scatter_base"), which a profiler that records the
    CPU puts on the GPU's timeline beside the kernels they span, are not kernels and are left out."""
    out: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and not evt.is_user_annotation:
            out[evt.key] += evt.self_device_time_total / 1e3 / steps  # microseconds -> ms
    return dict(out)


def host_times(prof, steps: int) -> dict[str, float]:
    """Milliseconds per step of host time spent in each op (its self time: not in the ops it calls), largest first,
    from a profiler that recorded the CPU."""
    ops = [(evt.key, evt.self_cpu_time_total / 1e3 / steps) for evt in prof.key_averages()
           if evt.device_type == torch.autograd.DeviceType.CPU]
    return dict(sorted(ops, key=lambda kv: -kv[1]))


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


class GcPauses:
    """Python's garbage collections while the context is open (gc.callbacks): how many per generation, and their
    pauses, during which the host issues no kernel. summary(steps) gives them per step."""

    def __enter__(self) -> "GcPauses":
        self.pauses: list[tuple[int, float]] = []  # (generation, ms)
        self._t0: float | None = None
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pauses.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))
            self._t0 = None

    def summary(self, steps: int) -> dict:
        """gc: collections per step by generation, their ms per step, and the longest pause."""
        per_gen = {str(g): sum(1 for gen, _ in self.pauses if gen == g) / steps for g in range(3)}
        return {"gc": {"collections_per_step": per_gen, "ms_per_step": sum(ms for _, ms in self.pauses) / steps,
                       "longest_ms": max((ms for _, ms in self.pauses), default=0.0)}}


def write_gpu_trace(events: list[dict], path: Path) -> None:
    """gpu_events' events as gzipped JSON (name, ts and dur in µs, stream, grid), to read back with
    read_gpu_trace: one rank's GPU timeline, small enough to keep beside the summary."""
    keep = [{"name": e["name"], "cat": e["cat"], "ts": e["ts"], "dur": e["dur"],
             **{key: e.get("args", {}).get(key) for key in ("stream", "grid")}} for e in events]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(keep, f)


def read_gpu_trace(path: Path) -> list[dict]:
    """The events write_gpu_trace kept, in its order."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


def step_summary(prof, steps: int, wall_ms: float, world: int = 1, host: bool = False,
                 trace: Path | None = None) -> dict:
    """A finished profiler of `steps` steps that took `wall_ms` each, summed up: wall_ms_per_step, categories (ms per
    step), the KEEP_KERNELS largest kernels, the GPU's timeline, with several ranks NCCL's overlap, and with `host`
    (a profiler that recorded the CPU too) the host's time in ops and its largest ones (_host_summary). `trace`: a
    file to keep the GPU's events in (write_gpu_trace; a profiler exports its events once)."""
    kernels = kernel_times(prof, steps)
    events = gpu_events(prof)
    if trace is not None:
        write_gpu_trace(events, trace)
    return {
        **({"overlap": communication_overlap([e for e in events if e["cat"] == "kernel"], steps)} if world > 1 else {}),
        "timeline": gpu_timeline(events, steps),
        "wall_ms_per_step": wall_ms, "categories": summarize(kernels),
        "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:KEEP_KERNELS]),
        **(_host_summary(host_times(prof, steps)) if host else {}),
    }


def rank_summary(prof, pauses: GcPauses, steps: int, wall_ms: float, rank: int, world: int = 1, host: bool = False,
                 trace_dir: Path | None = None) -> dict | None:
    """What one rank of a profiled run keeps: rank 0 the step_summary with its garbage collections (pauses), every
    other rank nothing; with `trace_dir`, each rank's GPU events in trace_dir/rank<N>.json.gz (write_gpu_trace)."""
    trace = trace_dir / f"rank{rank}.json.gz" if trace_dir is not None else None
    if rank == 0:
        return {**step_summary(prof, steps, wall_ms, world, host, trace), **pauses.summary(steps)}
    if trace is not None:
        write_gpu_trace(gpu_events(prof), trace)
    return None


def _host_summary(ops: dict[str, float]) -> dict:
    """host_ms_in_ops: the host's time per step inside recorded ops (the rest of the wall time is Python between
    them, or waiting); host_ops: the KEEP_HOST_OPS largest of them."""
    return {"host_ms_in_ops": sum(ops.values()), "host_ops": dict(list(ops.items())[:KEEP_HOST_OPS])}
