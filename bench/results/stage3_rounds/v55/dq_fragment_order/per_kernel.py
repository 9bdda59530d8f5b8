"""Per-kernel device time of the backward: the package's build against --base, interleaved rounds (torch.profiler)."""
import argparse, contextlib, statistics
import torch
from torch.profiler import profile, ProfilerActivity
from flash_kernel.interface import _fwd_impl, _bwd_impl, load_extension, using_extension

ap = argparse.ArgumentParser()
ap.add_argument("--base", required=True)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--cases", nargs="+", default=["128:0:8192", "128:1:8192", "64:1:8192", "128:0:2048"])
a = ap.parse_args()
base = load_extension(a.base)
for case in a.cases:
    hd, causal, T = (int(x) for x in case.split(":"))
    H, B = 2048 // hd, 16384 // T
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    sc = hd ** -0.5
    o, lse = _fwd_impl(q, k, v, sc, bool(causal))[:2]
    times = {}
    for r in range(a.rounds):
        for label, ctx in (("patch", contextlib.nullcontext), ("v55", lambda: using_extension(base))):
            with ctx():
                for _ in range(3): _bwd_impl(do, q, k, v, o, lse, sc, bool(causal), False)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.iters): _bwd_impl(do, q, k, v, o, lse, sc, bool(causal), False)
                    torch.cuda.synchronize()
            for ev in prof.key_averages():
                if ev.device_time_total > 0:
                    times.setdefault((label, ev.key[:60]), []).append(ev.device_time_total / a.iters)
    print(f"hd={hd} causal={causal} T={T}: per-call device us, median of {a.rounds} rounds")
    for (label, name), ts in sorted(times.items(), key=lambda x: (x[0][1], x[0][0])):
        print(f"  {label:6s} {statistics.median(ts):9.1f}  {name}")
