"""Host (CPU) time per attention call: what a method costs before the GPU sees any work.

    python3 bench/host_time.py                      # ours and SDPA's backends, forward and forward + backward
    python3 bench/host_time.py --methods ours sdpa_cudnn --iters 500

Each method runs at a tiny shape (B = 1, T = 128, one head, hd 64: microseconds of GPU work), so the
wall time per call, synchronized at the end of the loop only, is the time Python, autograd and the
launches take on the CPU. Where that exceeds a kernel's GPU time, the GPU waits for the CPU: the small
cells of bench/kernel.py (T <= 1k) then measure the host, not the kernel. Same methods and inputs as
bench/kernel.py; results merge into bench/results/host_time.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import seconds_per_call  # noqa: E402
from bench.kernel import METHODS, environment, load, make_method, save  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "host_time.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["ours", "sdpa_flash", "sdpa_cudnn"])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")

    import flash_kernel

    rows = []
    for method in args.methods:
        (q, k, v, do), fn, context = make_method(method, 1, 1, 128, 64, True, torch.bfloat16)
        for mode in ("fwd", "fwd_bwd"):

            def step():
                with context():
                    if mode == "fwd":
                        fn()
                    else:
                        fn().backward(do)

            us = seconds_per_call(step, 20, args.iters) * 1e6  # GPU work is negligible: this is host time
            q.grad = k.grad = v.grad = None
            rows.append({"device": torch.cuda.get_device_name(), "method": method, "mode": mode, "host_us": us,
                         "kernel_version": flash_kernel.KERNEL_VERSION if method.startswith("ours") else None})
            print(f"| {method} | {mode} | {us:.1f} us |", flush=True)

    data = load(args.results)
    keep = {(r["device"], r["method"], r["mode"]) for r in rows}
    data["results"] = [r for r in data["results"] if (r["device"], r["method"], r["mode"]) not in keep] + rows
    data["environment"] = environment()
    save(args.results, data)
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
