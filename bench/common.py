"""What the benchmark scripts share: file names per device, results merged by key, the rates a training run
logged, figures only where matplotlib is installed, a step's wall time, forward / forward + backward timings by
CUDA graph replay, and options' key=value items."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import yaml


def device_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (for results file names)."""
    return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def merge_rows(old: list[dict], new: list[dict], key: Callable[[dict], tuple],
               order: Callable[[dict], tuple] | None = None) -> list[dict]:
    """old's rows with new's in place of those with the same key(row); sorted by order(row) when given."""
    merged = {key(r): r for r in old}
    merged.update({key(r): r for r in new})
    rows = list(merged.values())
    return sorted(rows, key=order) if order else rows


def fwd_bwd_times(runs: dict[str, tuple[Callable[[], None], Callable[[], None]]], rounds: int) -> dict[str, dict]:
    """{method: (forward, forward + backward)} callables -> {method: {"fwd_ms", "fwd_bwd_ms", "bwd_ms", "rounds"}}.

    Each callable is captured once in a CUDA graph and timed by replaying it (triton.testing.do_bench_cudagraph), so
    the times are the GPU's alone, without the host's Python and autograd calls; the methods are interleaved over
    `rounds` rounds, and each time is the median of its rounds' medians. bwd_ms is the difference of the two."""
    from triton.testing import do_bench_cudagraph

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fwd, fwd_bwd) in runs.items():
            times[name].append((float(do_bench_cudagraph(fwd, return_mode="median")),
                                float(do_bench_cudagraph(fwd_bwd, return_mode="median"))))
    out = {}
    for name, rows in times.items():
        fwd_ms = statistics.median(t[0] for t in rows)
        fwd_bwd_ms = statistics.median(t[1] for t in rows)
        out[name] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "bwd_ms": fwd_bwd_ms - fwd_ms, "rounds": rows}
    return out


def read_rows(path: Path) -> list[dict]:
    """The JSON list of result rows at `path`; none yet: an empty one."""
    return json.loads(path.read_text()) if path.is_file() else []


def merge_file(path: Path, new: list[dict], key: Callable[[dict], tuple],
               order: Callable[[dict], tuple] | None = None, old: list[dict] | None = None) -> list[dict]:
    """merge_rows on the JSON list at `path` (or `old`, its rows already read), written back; returns the rows."""
    rows = merge_rows(read_rows(path) if old is None else old, new, key, order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def rates(metrics: dict) -> dict:
    """The throughput a training run logged (model/perf.py's perf/* keys), under the benchmarks' names."""
    return {
        "tokens_per_s": metrics["perf/tokens_per_s"],
        "tokens_per_s_total": metrics.get("perf/tokens_per_s_total", metrics["perf/tokens_per_s"]),
        "tflops_per_gpu": metrics["perf/tflops_per_gpu"],
        "mfu": metrics.get("perf/mfu"),
        "peak_mem_gib": metrics.get("perf/peak_mem_gib"),
        "step_time_s": metrics.get("perf/step_time_s"),
    }


def can_plot(script: str) -> bool:
    """matplotlib is optional (an offline GPU host may lack it): without it, say how to redraw the figure
    elsewhere instead of failing after the measurements."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print(f"no matplotlib here: no figure; redraw it with `python {script} --plot-only`")
    return False


def save_figure(fig, title: str, handles: list, path):
    """Title, then a one-row legend of handles, then the panels, each in its own band (heights in inches, converted
    to figure fractions); saved to path (its folder made) and closed. Returns path."""
    import matplotlib.pyplot as plt

    height = fig.get_figheight()
    fig.suptitle(title, y=1 - 0.05 / height, va="top")
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.4 / height), ncol=len(handles), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def seconds_per_call(step, warmup: int, iters: int) -> float:
    """Wall seconds per call of `step`: `warmup` calls, then `iters` timed ones, with the GPU synchronized before
    and after the timed loop only (so the CPU may run ahead of the GPU inside it, as in training)."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def join_torchrun_group() -> int:
    """This torchrun rank on its GPU, in the NCCL process group of torchrun's world; returns its local rank."""
    import os

    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return local


def inductor_settings(items: list[str]) -> dict:
    """--inductor's key=value items -> {key: value}: torch._inductor.config's settings (e.g.
    max_pointwise_cat_inputs=1), each key checked against the config and each value against the setting's type."""
    import torch._inductor.config as inductor_config

    settings = parse_sets(items, "--inductor", "a torch._inductor.config setting (e.g. max_pointwise_cat_inputs=1)")
    for key, value in settings.items():
        if not hasattr(inductor_config, key):
            raise SystemExit(f"--inductor {key}=...: torch._inductor.config has no setting {key!r}")
        now = getattr(inductor_config, key)
        if isinstance(now, float) and isinstance(value, int) and not isinstance(value, bool):
            settings[key] = value = float(value)
        if now is not None and type(value) is not type(now):
            raise SystemExit(f"--inductor {key}={value!r}: the setting is a {type(now).__name__} (now {now!r})")
    return settings


def parse_sets(items: list[str], option: str = "--set",
               what: str = "a GPTConfig field (e.g. fp32_residual=true)") -> dict:
    """An option's key=value items (--set's: GPTConfig fields) -> {key: value}, each value read as Hydra reads an
    override; a malformed item stops the script, naming the option and what its keys are."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{option} {item!r}: expected key=value, {what}")
        out[key] = yaml.safe_load(value)  # true -> True, 0.1 -> 0.1, sdpa -> 'sdpa'
    return out
